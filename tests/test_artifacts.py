"""The artifact store and fingerprints (docs/architecture.md, stage contract): local, memory and S3 stores."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from storage.artifacts import AlreadyCommitted, ArtifactRef, ArtifactStore, run_stage, stage_key
from storage.fingerprint import canonical_json, fingerprint_params, hash_bytes, hash_file, source_fingerprint


@dataclasses.dataclass
class Params:
    n: int = 3
    name: str = "x"


def _build_counting(calls: list[str], n_shards: int = 3, fail_at: int | None = None):
    def build(writer) -> dict:
        for i in range(n_shards):
            shard = f"{i:05d}"
            if writer.has_shard(shard):
                continue
            if i == fail_at:
                raise RuntimeError("killed")
            calls.append(shard)
            local = os.path.join(writer.local_dir, f"{shard}.txt")
            with open(local, "w") as f:
                f.write(f"shard {i}\n")
            writer.commit_shard(shard, {f"data/{shard}.txt": local})
        return {"counts": {"shards": n_shards}}

    return build


def test_canonical_json_and_params_fingerprint_are_order_independent():
    assert canonical_json({"b": 1, "a": (1, 2)}) == '{"a":[1,2],"b":1}'
    assert fingerprint_params({"a": 1, "b": 2}) == fingerprint_params({"b": 2, "a": 1})
    assert fingerprint_params(Params()) == fingerprint_params({"n": 3, "name": "x"})
    assert fingerprint_params(Params(n=4)) != fingerprint_params(Params())
    with pytest.raises(TypeError, match="cannot fingerprint a object"):
        canonical_json(object())


def test_hash_file_matches_hash_bytes(tmp_path):
    data = os.urandom(3 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert hash_file(str(path)) == hash_bytes(data)
    assert len(hash_bytes(b"")) == 32


def test_source_fingerprint_sees_changes_without_reading(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n')
    glob = str(tmp_path / "*.jsonl")
    first = source_fingerprint(glob)
    assert source_fingerprint(glob) == first
    os.utime(tmp_path / "a.jsonl", (time.time() + 10, time.time() + 10))
    assert source_fingerprint(glob) != first
    assert source_fingerprint(str(tmp_path)) != first  # a directory names its files under another URL
    with pytest.raises(FileNotFoundError, match="matches no file"):
        source_fingerprint(str(tmp_path / "*.parquet"))


def test_run_stage_commits_manifest_last_and_hits_cache(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    calls: list[str] = []
    ref = run_stage(store, "toy", "1", Params(), ["src:abc"], _build_counting(calls))
    assert not ref.cache_hit and calls == ["00000", "00001", "00002"]
    manifest = ref.manifest()
    assert manifest["stage"] == "toy" and manifest["version"] == "1"
    assert manifest["params"] == {"n": 3, "name": "x"} and manifest["inputs"] == ["src:abc"]
    assert manifest["counts"] == {"shards": 3}
    assert set(manifest["files"]) == {"data/00000.txt", "data/00001.txt", "data/00002.txt"}
    assert manifest["files"]["data/00001.txt"] == {"size": 8, "hash": hash_bytes(b"shard 1\n")}
    assert "numpy" in manifest["library_versions"]
    assert not os.path.exists(os.path.join(ref.url, ".scratch"))

    again = run_stage(store, "toy", "1", Params(), ["src:abc"], _build_counting(calls))
    assert again.cache_hit and again.key == ref.key and calls == ["00000", "00001", "00002"]
    other = run_stage(store, "toy", "1", Params(n=4), ["src:abc"], _build_counting(calls))
    assert other.key != ref.key
    assert stage_key("toy", "2", Params(), ["src:abc"]) != ref.key


def test_interrupted_stage_is_not_done_and_resumes_committed_shards(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="killed"):
        run_stage(store, "toy", "1", Params(), [], _build_counting(calls, fail_at=2))
    key = stage_key("toy", "1", Params(), [])
    assert store.find("toy", key) is None
    ref = run_stage(store, "toy", "1", Params(), [], _build_counting(calls))
    assert calls == ["00000", "00001", "00002"]  # the rerun did only the missing shard
    assert ref.files("data/") == ["data/00000.txt", "data/00001.txt", "data/00002.txt"]


def test_ref_round_trips_through_a_plain_dict(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    ref = run_stage(store, "toy", "1", Params(), [], _build_counting([]))
    again = store.ref(json.loads(json.dumps(ref.to_dict())))
    assert again == ref and again.local_path("data/00000.txt") == os.path.join(ref.url, "data/00000.txt")


def test_memory_store():
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex}")
    ref = run_stage(store, "toy", "1", Params(), [], _build_counting([]))
    assert store.find("toy", ref.key) == ref
    with open(ref.local_path("data/00002.txt")) as f:
        assert f.read() == "shard 2\n"


def test_s3_store_against_a_real_server(s3_endpoint, tmp_path, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    s3fs.S3FileSystem(**options).mkdir("flow-bucket")
    store = ArtifactStore("s3://flow-bucket/artifacts", **options)
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="killed"):
        run_stage(store, "toy", "1", Params(), [], _build_counting(calls, fail_at=1))
    assert store.find("toy", stage_key("toy", "1", Params(), [])) is None
    ref = run_stage(store, "toy", "1", Params(), [], _build_counting(calls))
    assert calls == ["00000", "00001", "00002"]
    assert ref.url.startswith("s3://flow-bucket/artifacts/toy/")
    assert ref.manifest()["files"]["data/00002.txt"]["hash"] == hash_bytes(b"shard 2\n")
    with open(ref.local_path("data/00001.txt")) as f:
        assert f.read() == "shard 1\n"
    assert run_stage(store, "toy", "1", Params(), [], _build_counting(calls)).cache_hit
    # An S3 source's fingerprint follows its ETag.
    fs = s3fs.S3FileSystem(**options)
    fs.pipe("flow-bucket/src/a.jsonl", b'{"text": "a"}\n')
    before = source_fingerprint("s3://flow-bucket/src/*.jsonl", **options)
    fs.pipe("flow-bucket/src/a.jsonl", b'{"text": "b"}\n')
    assert source_fingerprint("s3://flow-bucket/src/*.jsonl", **options) != before
    assert isinstance(ref, ArtifactRef)


def test_manifest_names_that_leave_the_artifact_are_rejected(tmp_path, monkeypatch):
    from stages.pretrain import run_directory

    monkeypatch.setenv("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex}")
    ref = run_stage(store, "pretrain", "1", Params(), [], _build_counting([]))
    manifest = ref.manifest()
    for evil in ("../../escaped.txt", "/abs/escaped.txt", "data/../../../escaped.txt"):
        forged = {**manifest, "files": {**manifest["files"], evil: {"size": 8, "hash": "0"}}}
        store.fs.pipe_file(f"{store.root}/pretrain/{ref.key}/manifest.json", json.dumps(forged).encode())
        with pytest.raises(ValueError, match="leaves the artifact"):
            run_directory(ref)
    assert sorted(p.name for p in tmp_path.rglob("escaped.txt")) == []
    assert {p.parent.name for p in (tmp_path / "cache").rglob("*.txt")} <= {"data"}
    assert ref.local_path("data/./00001.txt").endswith(os.path.join(ref.key, "data", "00001.txt"))


def test_commit_leaves_out_temporary_files_and_incomplete_checkpoints(tmp_path):
    """A kill during a checkpoint save leaves a temporary file and a folder without metadata (or beyond the
    latest marker): none of it may become part of the finished pretrain artifact."""
    from stages.pretrain import committable_files
    from storage.atomic import temporary_name

    run = tmp_path / "run"
    for iteration in (2, 4, 8):  # 8: metadata written, then killed before the marker moved on
        shard = run / f"iter_{iteration:07d}" / "mp_rank_00"
        shard.mkdir(parents=True)
        (shard / "model.safetensors").write_bytes(b"weights")
        (shard.parent / "metadata.json").write_text("{}")
    (run / "iter_0000006" / "mp_rank_00").mkdir(parents=True)  # killed before its metadata
    (run / "iter_0000006" / "mp_rank_00" / "model.safetensors").write_bytes(b"half")
    open(temporary_name(str(run / "iter_0000004" / "mp_rank_00" / "optimizer.safetensors")), "w").close()
    open(temporary_name(str(run / "metrics.jsonl")), "w").close()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    names = committable_files(str(run))
    assert names == [
        "iter_0000002/metadata.json",
        "iter_0000002/mp_rank_00/model.safetensors",
        "iter_0000004/metadata.json",
        "iter_0000004/mp_rank_00/model.safetensors",
        "latest_checkpointed_iteration.txt",
        "metrics.jsonl",
    ]
    # The writer's own rule: a temporary name inside the artifact is never described by the manifest.
    writer = ArtifactStore(str(tmp_path / "store")).begin("pretrain", "k")
    for name in names:
        writer.put_file(str(run / name), name)
    open(temporary_name(f"{writer.path}/iter_0000004/mp_rank_00/model.safetensors"), "w").close()
    assert sorted(writer.commit({}).files()) == sorted(names)


def test_writers_have_their_own_scratch_and_the_first_commit_wins(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    first, second = store.begin("toy", "k"), store.begin("toy", "k")
    assert first.local_dir != second.local_dir
    for writer in (first, second):
        local = os.path.join(writer.local_dir, "a.txt")
        with open(local, "w") as f:
            f.write("same bytes\n")
        writer.commit_shard("a", {"a.txt": local})
    won = first.commit({"counts": {"by": "first"}})
    manifest = won.manifest()
    lost = second.commit({"counts": {"by": "second"}})
    assert not won.cache_hit and lost.cache_hit and lost.manifest() == manifest
    assert manifest["counts"] == {"by": "first"}
    late = store.begin("toy", "k")
    with pytest.raises(AlreadyCommitted):
        late.put_file(__file__, "late.py")  # a slow writer stops placing files once it sees a manifest
    late.release(remove=True)
    scratch = os.listdir(os.path.join(store.root, ".scratch", "toy", "k"))
    assert scratch and all(name.endswith(".lock") for name in scratch)  # no writer's files are left


def test_a_killed_writers_scratch_goes_to_the_next_writer(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="killed"):

        def build(writer) -> dict:
            open(os.path.join(writer.local_dir, "resume-from-here"), "w").close()
            raise RuntimeError("killed")

        run_stage(store, "toy", "1", Params(), [], build)

    def resume(writer) -> dict:
        calls.append(sorted(os.listdir(writer.local_dir)))
        return {}

    run_stage(store, "toy", "1", Params(), [], resume)
    assert calls == [["resume-from-here"]]


def test_a_writer_that_fails_after_another_committed_returns_the_winners_artifact(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    key = stage_key("toy", "1", Params(), [])

    def loses_the_race(writer) -> dict:
        winner = store.begin("toy", key)
        winner.commit({"counts": {"by": "winner"}})
        raise FileNotFoundError("partials/00000/stats.json")  # what the winner's clean-up does to a loser

    ref = run_stage(store, "toy", "1", Params(), [], loses_the_race)
    assert ref.cache_hit and ref.manifest()["counts"] == {"by": "winner"}


def race_writer(store_url: str, meet: str, n: int, delay: float, out: str, endpoint: str | None) -> None:
    """One of two processes building the same artifact at once (started by the concurrency tests): both
    begin building before either commits; then the one with the longer `delay` is the slower."""
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    store = ArtifactStore(store_url, **options)

    def build(writer) -> dict:
        open(os.path.join(meet, str(n)), "w").close()
        while len(os.listdir(meet)) < 2:
            time.sleep(0.01)
        for i in range(3):
            time.sleep(delay)
            local = os.path.join(writer.local_dir, f"{i}.txt")
            with open(local, "w") as f:
                f.write(f"shard {i}\n")
            writer.commit_shard(f"{i:05d}", {f"data/{i}.txt": local})
        return {"counts": {"shards": 3}}

    ref = run_stage(store, "toy", "1", Params(), [], build)
    with open(out, "w") as f:
        json.dump({"cache_hit": ref.cache_hit, "manifest": ref.manifest()}, f)


def _race(tmp_path, store_url: str, endpoint: str | None = None) -> list[dict]:
    meet = tmp_path / "meet"
    meet.mkdir()
    procs, outs = [], []
    for n, delay in enumerate((0.0, 0.5)):  # the slow one writes its scratch after the fast one committed
        outs.append(tmp_path / f"out{n}.json")
        code = (
            "from tests.test_artifacts import race_writer; "
            f"race_writer({store_url!r}, {str(meet)!r}, {n}, {delay}, {str(outs[-1])!r}, {endpoint!r})"
        )
        procs.append(
            subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
        )
    assert [p.wait(120) for p in procs] == [0, 0]
    return [json.loads(out.read_text()) for out in outs]


def test_two_processes_build_one_artifact_on_a_local_store(tmp_path):
    results = _race(tmp_path, str(tmp_path / "store"))
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert results[0]["manifest"] == results[1]["manifest"]
    assert set(results[0]["manifest"]["files"]) == {"data/0.txt", "data/1.txt", "data/2.txt"}


def test_two_processes_build_one_artifact_on_s3(s3_endpoint, tmp_path, monkeypatch):
    import s3fs

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))):  # fmt: skip
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir("race-bucket")
    results = _race(tmp_path, "s3://race-bucket/artifacts", s3_endpoint)
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert results[0]["manifest"] == results[1]["manifest"]
