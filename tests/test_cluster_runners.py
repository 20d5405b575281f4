"""The corpus flow on real clusters: a dask.distributed LocalCluster and a local Ray instance give the same
artifacts, byte for byte, as the process runner; a Dask worker SIGKILLed mid-run costs nothing but a rerun.

The corpus is a crawl the tests write (tests/helpers/web_pages.py: a WARC and a WET file of pages in four languages), run
with every web step on (URL filter, extraction, language ID, decontamination, FineWeb rules, PII), so the runners
are compared on those steps too."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from flows.corpus import CorpusConfig, run_corpus
from stages.clean import CleanParams
from stages.download import DownloadParams
from stages.tokenize import TokenizeParams
from stages.tokenize_params import local_copy
from storage.artifacts import ArtifactStore
from tests.helpers.web_pages import Crawl, write_crawl

pytestmark = pytest.mark.processes  # every test here starts processes


@pytest.fixture(scope="module")
def crawl(tmp_path_factory) -> Crawl:
    """28 pages in 4 download shards (12 kept): a flow on it takes seconds."""
    return write_crawl(str(tmp_path_factory.mktemp("web")))


@pytest.fixture(scope="module")
def tiny_corpus(crawl) -> Path:
    return Path(crawl.folder)


def corpus_config(store: Path | str, corpus: Path | str, crawl: Crawl, **overrides) -> CorpusConfig:
    base = {
        "store": str(store),
        "download": DownloadParams(source=str(corpus), docs_per_shard=8),
        "clean": CleanParams(
            url_blocklist=(crawl.domains,),
            url_banned_words=("casino",),
            languages=("en",),
            decontaminate=(crawl.lambada, crawl.wikitext),
            fineweb=True,
            pii=True,
        ),
        "tokenize": TokenizeParams(append_eod=True, workers=1),
        "workers": 2,
    }
    return CorpusConfig(**{**base, **overrides})


def artifact_contents(refs: dict) -> dict[str, tuple[str, dict]]:
    """Each stage's key and committed files (name -> size and xxh3 hash): equal means byte-identical (an object
    store's manifest also records ETags, left out here). A shard's counts (`stats/*.json`) also hold how long it
    took: those are compared without the seconds."""
    contents = {}
    for stage, ref in refs.items():
        artifact = ArtifactStore(ref["url"].rsplit("/", 2)[0]).ref(ref)
        files: dict = {
            name: {"size": r["size"], "hash": r["hash"]} for name, r in artifact.manifest()["files"].items()
        }
        for name in [n for n in files if n.startswith("stats/")]:
            with artifact.fs.open(f"{ref['url']}/{name}") as f:
                files[name] = {k: v for k, v in json.load(f).items() if k != "seconds"}
        contents[stage] = (ref["key"], files)
    return contents


@pytest.fixture(scope="module")
def reference(prefect_api_url, tiny_corpus, crawl, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """The artifacts of the default runner: local worker processes."""
    store = tmp_path_factory.mktemp("process-runner")
    refs = run_corpus(corpus_config(store, tiny_corpus, crawl, task_runner="process"))
    clean = ArtifactStore(str(store)).ref(refs["clean"]).manifest()["counts"]
    assert clean["docs_out"] == 12 and set(clean["steps"]) >= {"url_filter", "extract", "language", "pii"}
    return artifact_contents(refs)


def test_dask_local_cluster_matches_process_runner(reference, tiny_corpus, crawl, tmp_path):
    pytest.importorskip("prefect_dask")
    refs = run_corpus(corpus_config(tmp_path / "store", tiny_corpus, crawl, task_runner="dask"))
    assert artifact_contents(refs) == reference


def test_ray_local_instance_matches_process_runner(reference, tiny_corpus, crawl, tmp_path):
    pytest.importorskip("prefect_ray")
    refs = run_corpus(corpus_config(tmp_path / "store", tiny_corpus, crawl, task_runner="ray"))
    assert artifact_contents(refs) == reference


def _kill_mid_run(store: Path, pid: int, killed: list[bool]) -> None:
    """SIGKILL `pid` as soon as the clean stage commits a shard; record whether the flow was still running."""
    deadline = time.time() + 300
    while time.time() < deadline and not glob.glob(str(store / "clean" / "*" / "_shards" / "*.json")):
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    killed.append(not glob.glob(str(store / "tokenize" / "*" / "manifest.json")))


def test_dask_worker_sigkilled_mid_run_then_rerun_is_identical(reference, tiny_corpus, crawl, tmp_path):
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("prefect_dask")
    store = tmp_path / "store"
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        victim = sorted(client.run(os.getpid).values())[0]
        config = corpus_config(
            store, tiny_corpus, crawl, task_runner="dask", dask_address=cluster.scheduler_address
        )
        killed: list[bool] = []
        killer = threading.Thread(target=_kill_mid_run, args=(store, victim, killed))
        killer.start()
        # The scheduler may reschedule the lost tasks and finish, or the flow may fail: the rerun must complete.
        with contextlib.suppress(Exception):
            run_corpus(config)
        killer.join()
        assert killed == [True], "the flow finished before the worker was killed"
        with pytest.raises(ProcessLookupError):
            os.kill(victim, 0)
        assert victim not in client.run(os.getpid).values()
        rerun = run_corpus(config)
    assert artifact_contents(rerun) == reference


def test_corpus_flow_on_s3_store_and_s3_source_matches_local_run(
    reference, tiny_corpus, crawl, s3_endpoint, tmp_path, monkeypatch
):
    """The store and the source on a real S3-compatible server (moto), reached through the standard AWS
    environment variables as on a cluster: every stage's files equal the local run's (the keys differ, since
    the source URL is part of the download key)."""
    import s3fs

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "MEGATRON_FLOW_CACHE": str(tmp_path / "cache"),
    }.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem()
    fs.mkdir("corpus-flow")
    for path in tiny_corpus.iterdir():  # the WARC and the WET file, read from S3 by the download stage
        fs.put_file(str(path), f"corpus-flow/source/{path.name}")
    config = corpus_config("s3://corpus-flow/store", "s3://corpus-flow/source/", crawl)
    refs = run_corpus(config)
    assert all(ref["url"].startswith("s3://corpus-flow/store/") for ref in refs.values())
    assert fs.exists(f"corpus-flow/store/tokenize/{refs['tokenize']['key']}/manifest.json")
    # Workers got the trained tokenizer's files by URL (a cluster's workers cannot read the flow's disk), keyed
    # by content like local paths.
    vocab, merges = (f"{refs['train_tokenizer']['url']}/{name}" for name in ("vocab.json", "merges.txt"))
    assert len(list((tmp_path / "cache" / "tokenizer-files").iterdir())) >= 2
    by_url = TokenizeParams(vocab_file=vocab, merge_file=merges)
    local = TokenizeParams(vocab_file=local_copy(vocab), merge_file=local_copy(merges))
    assert by_url.fingerprint_fields() == local.fingerprint_fields() and local.vocab_file.startswith(
        str(tmp_path)
    )
    tokens = ArtifactStore(config.store).ref(refs["tokenize"]).manifest()["files"]
    assert all(record["etag"] for record in tokens.values())  # what verification compares on an object store
    on_s3 = artifact_contents(refs)
    assert {stage: files for stage, (_, files) in on_s3.items()} == {
        stage: files for stage, (_, files) in reference.items()
    }
