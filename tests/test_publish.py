"""Links and keys of the Prefect artifacts flows publish (the artifacts themselves: tests/test_corpus_flow.py and
tests/test_eval_flow.py read them back through the Prefect API)."""

from __future__ import annotations

from pathlib import Path

from flows.publish import artifact_key, link_url


def test_links_are_file_uris_for_local_paths_and_store_urls_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert link_url("artifacts/tokenize/abc") == (tmp_path / "artifacts/tokenize/abc").as_uri()
    assert (
        link_url("/store/tokenize/abc")
        == Path("/store/tokenize/abc").as_uri()
        == "file:///store/tokenize/abc"
    )
    assert link_url("s3://bucket/flow/tokenize/abc") == "s3://bucket/flow/tokenize/abc"


def test_artifact_keys_use_only_what_prefect_accepts():
    assert artifact_key("train_tokenizer-artifact") == "train-tokenizer-artifact"
    assert artifact_key("Corpus-Summary") == "corpus-summary"
