"""The corpus flow end to end under Prefect: counts per stage, caching, partial reruns, kill and resume."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.corpus import CorpusConfig, corpus_flow, main
from stages.clean import CleanParams
from stages.download import DownloadParams
from stages.registry import STAGE_MODULES
from stages.tokenize import TokenizeParams
from stages.tokenize import main as tokenize_main
from storage.artifacts import ArtifactStore
from storage.indexed_dataset import IndexedDataset
from tests.helpers.corpus_flow import clean_chapters, corpus_config
from tests.helpers.prefect_runs import artifacts, task_states
from tests.helpers.read_only import read_only

ROOT = Path(__file__).resolve().parents[1]
N_BASE, EXACT, NEAR = 30, [0, 5, 9], [2, 12, 20]
JUNK = [
    "too short to keep",
    "lorem ipsum dolor sit amet " * 30,
    "#### ### ## # " * 40 + " and the of " * 10,
]


def _near_copy(text: str) -> str:
    """A few words changed in a long document: Jaccard far above 0.8."""
    words = text.split(" ")
    for i in range(7, len(words), len(words) // 4):
        words[i] = "changed"
    return " ".join(words)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """30 real chapters, 3 exact and 3 near duplicates, 3 junk documents and one malformed line."""
    base = clean_chapters(N_BASE)
    docs = list(base)
    docs += [{"id": f"exact-{i}", "text": base[i]["text"]} for i in EXACT]
    docs += [{"id": f"near-{i}", "text": _near_copy(base[i]["text"])} for i in NEAR]
    docs += [{"id": f"junk-{i}", "text": t} for i, t in enumerate(JUNK)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    lines = [json.dumps(d) for d in docs]
    lines.insert(17, '{"id": "broken", "text": "no closing brace"')
    path.write_text("\n".join(lines) + "\n")
    return path


def _manifest(refs: dict, stage: str) -> dict:
    return ArtifactStore(refs[stage]["url"].rsplit("/", 2)[0]).ref(refs[stage]).manifest()


def _token_files(refs: dict) -> dict[str, bytes]:
    url = refs["tokenize"]["url"]
    return {Path(p).name: Path(p).read_bytes() for p in sorted(glob.glob(f"{url}/tokens_*"))}


@pytest.mark.processes
def test_flow_counts_caching_and_partial_rerun(prefect_api_url, corpus, tmp_path, monkeypatch, capsys):
    emitted: list[dict] = []  # the Prefect events the flow emits (new token data triggers the pipeline)
    monkeypatch.setattr("flows.events.emit_event", lambda **event: emitted.append(event))
    store = tmp_path / "store"
    refs = corpus_flow(corpus_config(store, corpus))
    assert not any(r["cache_hit"] for r in refs.values())
    assert [event["payload"]["key"] for event in emitted] == [refs["tokenize"]["key"]]

    download = _manifest(refs, "download")["counts"]
    assert download["docs"] == N_BASE + 3 + 3 + 3 and download["skipped_bad_records"] == 1
    clean = _manifest(refs, "clean")["counts"]
    assert clean["docs_in"] == 39 and clean["docs_out"] == 36
    assert sum(clean["dropped"].values()) == 3 and clean["dropped"]["too_few_words"] == 1
    dedup = _manifest(refs, "dedup")["counts"]
    assert dedup["dropped"] == {"exact": 3, "near": 3} and dedup["docs_out"] == N_BASE

    # Near-duplicate recall and precision on the planted pairs: every copy dropped, every original kept.
    import pyarrow.parquet as pq

    report = pq.read_table(f"{refs['dedup']['url']}/duplicates.parquet").to_pylist()
    dropped = {r["id"] for r in report if not r["kept"]}
    assert dropped == {f"exact-{i}" for i in EXACT} | {f"near-{i}" for i in NEAR}
    base = clean_chapters(N_BASE)
    clusters = {r["id"]: r["cluster"] for r in report}
    assert all(
        clusters[f"{kind}-{i}"] == base[i]["id"]
        for kind, ids in (("exact", EXACT), ("near", NEAR))
        for i in ids
    )

    tokenize = _manifest(refs, "tokenize")["summary"]
    dataset = IndexedDataset(f"{refs['tokenize']['url']}/tokens_text_document")
    assert tokenize["documents"] == N_BASE == len(dataset.document_indices) - 1
    assert tokenize["tokens"] == int(dataset.sequence_lengths.sum()) > 10_000
    assert _manifest(refs, "train_tokenizer")["counts"]["vocab_size"] <= 8192

    # Nothing changed: every stage is a cache hit, Prefect shows Cached on this first rerun already, and no
    # file is rewritten.
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}
    state = corpus_flow(corpus_config(store, corpus), return_state=True)
    again = state.result()
    assert all(r["cache_hit"] for r in again.values())
    assert task_states(state) == dict.fromkeys(refs, "Cached")
    published = artifacts(state)
    kind, table = published["corpus-summary"]
    assert kind == "table" and [row["stage"] for row in table] == list(refs)
    assert all(row["cache_hit"] == "hit" for row in table) and table[-1]["tokens"] == tokenize["tokens"]
    for stage, ref in refs.items():
        kind, link = published[f"{stage.replace('_', '-')}-artifact"]  # Prefect keeps links as markdown
        assert kind == "markdown" and link == f"[{ref['url']}]({Path(ref['url']).as_uri()})", stage
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()} == before
    assert len(emitted) == 1  # unchanged data announces nothing

    # An artifact deleted from the store is rebuilt (the Prefect record is stale), with the same key and bytes.
    tokens = _token_files(refs)
    shutil.rmtree(refs["tokenize"]["url"])
    state = corpus_flow(corpus_config(store, corpus), return_state=True)
    rebuilt = state.result()
    assert not rebuilt["tokenize"]["cache_hit"] and rebuilt["tokenize"]["key"] == refs["tokenize"]["key"]
    assert _token_files(rebuilt) == tokens
    assert task_states(state) == {**dict.fromkeys(refs, "Cached"), "tokenize": "Completed"}

    # One clean parameter changed: download is a hit, everything after it reruns.
    changed = corpus_flow(corpus_config(store, corpus, clean=CleanParams(min_words=20)))
    assert changed["download"]["cache_hit"] and changed["download"]["key"] == refs["download"]["key"]
    for stage in ("clean", "dedup", "train_tokenizer", "tokenize"):
        assert not changed[stage]["cache_hit"] and changed[stage]["key"] != refs[stage]["key"], stage
    # The rebuilt artifact is announced again (the pipeline it triggers finds its stages cached), then the new one.
    assert [event["payload"]["key"] for event in emitted[1:]] == [
        refs["tokenize"]["key"],
        changed["tokenize"]["key"],
    ]

    # A committed file changed behind the store's back (dedup's first shard): the next stage that reads it
    # (tokenize, asked for other settings) refuses, naming the file and the stage to rebuild, in one line...
    argv = [
        "--store",
        str(store),
        *_cli_source_args(corpus),
        "--clean.min-words",
        "20",
        "--task-runner",
        "threads",
    ]
    dedup = ArtifactStore(str(store)).ref(changed["dedup"])
    shard = Path(dedup.local_path("shards/00000.parquet"))
    original, tokens = shard.read_bytes(), _token_files(changed)
    shard.chmod(0o644)
    shard.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    capsys.readouterr()
    assert main([*argv, "--tokenize.append-eod", "false"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: the tokenize stage failed: {shard}: its content differs from its manifest's hash; the dedup "
        f"artifact {dedup.url} changed after it was committed: rebuild it (--rebuild dedup)"
    )
    # ... and --rebuild dedup recovers it, with the same bytes, rebuilding the stages after it too.
    assert main([*argv, "--rebuild", "dedup"]) == 0
    assert "cache hits: 2/5 stages" in capsys.readouterr().out
    assert shard.read_bytes() == original and _token_files(changed) == tokens


@pytest.mark.processes
def test_malformed_record_without_skip_names_file_and_line(prefect_api_url, corpus, tmp_path):
    config = corpus_config(
        tmp_path / "store", corpus, download=DownloadParams(source=str(corpus), docs_per_shard=16)
    )
    with pytest.raises(Exception, match=r"corpus.jsonl:18: "):
        corpus_flow(config)
    # The shard committed before the bad record is kept for the rerun.
    assert len(glob.glob(str(tmp_path / "store" / "download" / "*" / "_shards" / "*.json"))) == 1


def _cli_source_args(corpus: Path) -> list[str]:
    """The flags that give the CLI the same settings as `corpus_config`."""
    return [
        "--download.source", str(corpus), "--download.docs-per-shard", "16",
        "--download.skip-bad-records", "true", "--tokenize.workers", "1",
    ]  # fmt: skip


@pytest.mark.processes
def test_cli_runs_on_process_pool_and_matches_flow(prefect_api_url, corpus, tmp_path, capsys, monkeypatch):
    reference = corpus_flow(corpus_config(tmp_path / "a", corpus))
    argv = ["--store", str(tmp_path / "b"), *_cli_source_args(corpus), "--task-runner", "processes"]
    # `make corpus`'s command, as a user runs it (the flow then validates a config parsed in `__main__`)
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    cli = subprocess.run(
        [sys.executable, "-m", "flows.corpus_plan", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert cli.returncode == 0 and "cache hits: 0/5 stages" in cli.stdout, cli.stderr[-3000:]
    refs = {s: ArtifactStore(str(tmp_path / "b")).find(s, reference[s]["key"]) for s in reference}
    assert all(refs.values()), "the CLI produced other keys than the flow for the same settings"
    assert _token_files({"tokenize": refs["tokenize"].to_dict()}) == _token_files(reference)

    # Prefect's record of a stage is per store: the flow on store a still answers with a's artifacts.
    again = corpus_flow(corpus_config(tmp_path / "a", corpus))
    assert all(r["cache_hit"] for r in again.values())
    assert {stage: ref["url"] for stage, ref in again.items()} == {s: r["url"] for s, r in reference.items()}

    # Nothing left to do: decided from the store, without starting or contacting a Prefect server.
    monkeypatch.setattr("flows.server.prefect_api", _no_server)
    monkeypatch.setattr("flows.corpus.run_corpus", _no_server)
    with read_only(tmp_path / "b"):  # a store that cannot be written still serves what it holds
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cache hits: 5/5 stages" in out and f"tokens: {refs['tokenize'].url}" in out
    # ... and without importing Prefect (most of a second command line's time, `make corpus`).
    # Nor torch: the stages' keys cover their code, found by parsing it (storage.code_fingerprint).
    code = (
        f"import sys; from flows.corpus_plan import main; main({argv!r}); "
        "print('prefect' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "cache hits: 5/5 stages" in done.stdout and done.stdout.split()[-2:] == ["False", "False"]


@pytest.mark.processes
def test_a_read_only_store_ends_in_one_line_naming_it(corpus, tmp_path, capsys):
    """`make corpus` (and `python -m stages.tokenize`) with a --store that cannot be written: one line, before any
    work and without a Prefect server, naming the store and what to do."""
    store = tmp_path / "store"
    store.mkdir()
    tokenize_argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--store", str(store),
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--skip-bad-records"]  # fmt: skip
    with read_only(store) as reason:
        assert main(["--store", str(store), *_cli_source_args(corpus)]) == 1
        assert capsys.readouterr().err.splitlines() == [
            f"error: --store {store} cannot be written ({reason}: {store}/.write-check-{os.getpid()}); give a "
            "writable folder or URL with --store, or make it writable"
        ]
        assert tokenize_main(tokenize_argv) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"error: --store {store} cannot be written ({reason}: {store}/.scratch); give a writable folder or "
            "URL with --store, or make it writable"
        )


def _no_server(*args, **kwargs):
    raise AssertionError("an all-cached corpus started a Prefect server or flow run")


@pytest.mark.processes
def test_sigkill_during_tokenize_then_rerun_is_byte_identical(prefect_api_url, corpus, tmp_path):
    reference = corpus_flow(corpus_config(tmp_path / "clean-run", corpus))
    store = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "flows.corpus",
        "--store",
        str(store),
        *_cli_source_args(corpus),
        "--tokenize.shard-size-mb",
        "0.002",
        "--task-runner",
        "threads",
    ]
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if glob.glob(str(store / "tokenize" / "*" / "_shards" / "*.json")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the flow finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not glob.glob(str(store / "tokenize" / "*" / "manifest.json"))

    resumed = corpus_flow(corpus_config(store, corpus))
    assert resumed["tokenize"]["key"] == reference["tokenize"]["key"]
    assert _token_files(resumed) == _token_files(reference)


def test_cli_flags_cover_every_stage_parameter():
    from flows.cli import parse_config

    config = parse_config(
        CorpusConfig,
        [
            "--clean.min-words",
            "None",
            "--dedup.threshold",
            "0.7",
            "--tokenize.json-keys",
            '["text", "title"]',
        ],
        "test",
    )
    assert config.clean.min_words is None and config.clean.max_words == CleanParams().max_words
    assert config.dedup.threshold == 0.7 and tuple(config.tokenize.json_keys) == ("text", "title")
    assert config.tokenize.append_eod  # the flow's own default survives an override of a sibling field
    with pytest.raises(SystemExit):
        parse_config(CorpusConfig, ["--clean.no-such-flag", "1"], "test")


def test_a_bad_section_value_is_a_usage_error_naming_the_flag(capsys):
    from flows.cli import parse_config
    from flows.pretrain import parse as pretrain_parse
    from flows.retro_flow import RetroFlowConfig

    with pytest.raises(SystemExit) as raised:
        parse_config(CorpusConfig, ["--download.docs-per-shard", "0"], "test")
    assert raised.value.code == 2
    assert "error: --download: docs_per_shard must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # checked when the flow's config is parsed, before any stage runs
        parse_config(RetroFlowConfig, ["--query.num-neighbors-save", "70"], "test")
    assert "error: --query: --retro-query-num-neighbors-save (70) exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(RetroFlowConfig, ["--embedder.source", "/no/such/embedder"], "test")
    assert (
        "error: --embedder: /no/such/embedder: neither a Megatron-Flow checkpoint" in capsys.readouterr().err
    )
    # --rebuild takes stage names (commas or a JSON list), checked against the stages there are, on every flow.
    config = parse_config(
        CorpusConfig, ["--rebuild", "clean,tokenize", "--reuse-across-code-changes"], "test"
    )
    assert config.rebuild == ("clean", "tokenize") and config.reuse_across_code_changes
    assert parse_config(RetroFlowConfig, ["--corpus.rebuild", '["retro_query"]'], "t").corpus.rebuild == (
        "retro_query",
    )
    stages = ", ".join(STAGE_MODULES)
    with pytest.raises(SystemExit):
        parse_config(CorpusConfig, ["--rebuild", "clean,toknize"], "test")
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(f"error: --rebuild: unknown stage toknize; stages: {stages}")
    )
    with pytest.raises(SystemExit):
        pretrain_parse(["--rebuild", "pretrian"])
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(f"error: argument --rebuild: unknown stage pretrian; stages: {stages}")
    )


@pytest.mark.processes
def test_bert_tokenizer_type_trains_wordpiece(prefect_api_url, corpus, tmp_path):
    config = corpus_config(
        tmp_path / "store",
        corpus,
        tokenize=TokenizeParams(tokenizer_type="BertWordPieceLowerCase", workers=1),
    )
    refs = corpus_flow(config)
    trained = _manifest(refs, "train_tokenizer")
    assert trained["params"]["kind"] == "wordpiece" and trained["tokenizer"]["tokenizer_type"].startswith(
        "BertWordPiece"
    )
    assert _manifest(refs, "tokenize")["summary"]["documents"] == N_BASE
