"""The artifact store and fingerprints (docs/architecture.md, stage contract): local, memory and S3 stores."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from storage import verify
from storage.artifacts import AlreadyCommitted, ArtifactRef, ArtifactStore, CachePolicy, run_stage, stage_key
from storage.fingerprint import canonical_json, fingerprint_params, hash_bytes, hash_file, source_fingerprint
from storage.verify import ChangedArtifactError, with_checksum


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


@pytest.mark.processes
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

    # On the object store, size and the ETag recorded at commit stand in for the hash: an object rewritten with
    # other bytes of the same size is refused. A local copy that changed on disk is downloaded again.
    ref.verify()
    record = ref.manifest()["files"]["data/00001.txt"]
    assert record["etag"] and record["size"] == 8
    local = ref.local_path("data/00001.txt")
    with open(local, "r+b") as f:
        f.write(b"S")
    assert ref.local_path("data/00001.txt") == local and Path(local).read_bytes() == b"shard 1\n"
    fs.pipe(f"{ref.url.removeprefix('s3://')}/data/00001.txt", b"shard 9\n")
    with pytest.raises(ChangedArtifactError) as refused:
        ref.verify()
    assert str(refused.value) == (
        f"flow-bucket/artifacts/toy/{ref.key}/data/00001.txt: its ETag differs from the one recorded at commit; "
        f"the toy artifact {ref.url} changed after it was committed: rebuild it (--rebuild toy)"
    )
    os.remove(local)  # ... and then its fresh copy differs too: refused
    with pytest.raises(
        ChangedArtifactError, match=f"^{local}: its content differs from its manifest's hash; "
    ):
        ref.local_path("data/00001.txt")


def _write_refused(path: str) -> bool:
    """Whether opening `path` for writing fails with a permission error for a user other than root, whom file
    modes do not stop (CI runs as root: there the check runs in a child process that became `nobody`)."""
    if os.geteuid() != 0:
        try:
            open(path, "r+b").close()  # noqa: SIM115
        except PermissionError:
            return True
        return False
    pid = os.fork()
    if pid == 0:  # the child: give up root, try, report by exit status
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            open(path, "r+b").close()  # noqa: SIM115
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 13


def test_committed_files_are_read_only_and_verified_once_per_process(monkeypatch):
    root = tempfile.mkdtemp(
        prefix="read-only-store-"
    )  # not under pytest's root-only folder: others may enter
    try:
        os.chmod(root, 0o755)
        store = ArtifactStore(root)
        ref = run_stage(store, "toy", "1", Params(), [], _build_counting([]))
        folder = os.path.join(root, "toy", ref.key)
        files = [os.path.join(d, name) for d, _, names in os.walk(folder) for name in names]
        assert len(files) == 7  # 3 data files, 3 shard markers, the manifest
        assert {stat.S_IMODE(os.stat(path).st_mode) for path in files} == {0o444}
        assert _write_refused(os.path.join(folder, "data", "00001.txt"))

        # Every file is checked once; a run pays again only for a file that changed since.
        hashed: list[str] = []
        real = verify.hash_file
        monkeypatch.setattr(verify, "hash_file", lambda path, fs: hashed.append(path) or real(path, fs))
        ref.verify()
        ref.verify()
        assert sorted(os.path.basename(p) for p in hashed) == ["00000.txt", "00001.txt", "00002.txt"]
        changed = os.path.join(folder, "data", "00001.txt")
        os.chmod(changed, 0o644)
        with open(changed, "r+b") as f:
            f.write(b"S")
        with pytest.raises(ChangedArtifactError) as error:
            ref.verify()
        assert str(error.value) == (
            f"{changed}: its content differs from its manifest's hash; the toy artifact {ref.url} changed after "
            "it was committed: rebuild it (--rebuild toy)"
        )
        with open(changed, "ab") as f:
            f.write(b"more")
        with pytest.raises(ChangedArtifactError, match=r"00001.txt: 12 bytes where its manifest says 8; "):
            ref.verify()

        # A stage using the artifact refuses before it builds anything; --rebuild (CachePolicy) recovers it with
        # the same bytes, replacing the read-only files.
        calls: list[str] = []
        with pytest.raises(ChangedArtifactError, match="rebuild it \\(--rebuild toy\\)"):
            run_stage(store, "user", "1", Params(), [ref], _build_counting(calls))
        assert calls == [] and store.find("user", stage_key("user", "1", Params(), [ref])) is None
        rebuilt = run_stage(
            store.with_policy(CachePolicy(rebuild=True)), "toy", "1", Params(), [], _build_counting([])
        )
        assert rebuilt.key == ref.key and rebuilt.rebuilt and not rebuilt.cache_hit
        assert Path(changed).read_bytes() == b"shard 1\n"
        rebuilt.verify()
        assert run_stage(store, "user", "1", Params(), [ref], _build_counting(calls)).key
        assert not os.path.exists(os.path.join(root, ".scratch", "discarded", f"{ref.key}"))
    finally:
        shutil.rmtree(root)  # read-only files in writable folders: removed like any others
    assert not os.path.exists(root)


def test_a_damaged_manifest_is_refused_naming_it(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    ref = run_stage(store, "toy", "1", Params(), [], _build_counting([]))
    path = tmp_path / "store" / "toy" / ref.key / "manifest.json"
    original = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(original.replace(b'"shards": 3', b'"shards": 4'))
    with pytest.raises(ChangedArtifactError) as error:
        ref.manifest()
    assert str(error.value) == (
        f"{ref.url}/manifest.json: its fields do not match its checksum; the toy artifact {ref.url} changed after "
        "it was committed: rebuild it (--rebuild toy)"
    )
    path.write_bytes(original[:-40])
    with pytest.raises(ChangedArtifactError, match=r"manifest.json: not valid JSON \(Expecting"):
        ref.manifest()


def test_reuse_across_code_changes_finds_the_artifact_built_by_earlier_code(tmp_path):
    """Keys cover the code; `reuse_across_code_changes` finds what other code built for the same params and
    inputs (the last one committed), and without it a code change builds anew."""
    store = ArtifactStore(str(tmp_path / "store"))
    reuse = store.with_policy(CachePolicy(reuse_across_code_changes=True))

    def run(on: ArtifactStore, code: str) -> ArtifactRef:
        return run_stage(on, "toy", "1", Params(), [], _build_counting([]), code={"fingerprint": code})

    yesterday = run(store, "a")
    assert yesterday.key == stage_key("toy", "1", Params(), [], "a") != stage_key("toy", "1", Params(), [])
    assert yesterday.manifest()["base_key"] == stage_key("toy", "1", Params(), [])
    kept = run(reuse, "b")
    assert kept.cache_hit and kept.key == yesterday.key
    today = run(store, "b")
    assert not today.cache_hit and today.key != yesterday.key
    assert run(reuse, "c").key == today.key  # the last one committed for these params and inputs
    assert run(reuse, "b").key == today.key  # the current code's own artifact first
    assert run(reuse, "a").key == yesterday.key


def test_manifest_names_that_leave_the_artifact_are_rejected(tmp_path, monkeypatch):
    from stages.pretrain import run_directory

    monkeypatch.setenv("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex}")
    ref = run_stage(store, "pretrain", "1", Params(), [], _build_counting([]))
    manifest = {k: v for k, v in ref.manifest().items() if k != "checksum"}
    for evil in ("../../escaped.txt", "/abs/escaped.txt", "data/../../../escaped.txt"):
        # forged with a checksum that matches: the names are refused on their own
        forged = with_checksum({**manifest, "files": {**manifest["files"], evil: {"size": 8, "hash": "0"}}})
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


@pytest.mark.processes
def test_two_processes_build_one_artifact_on_a_local_store(tmp_path):
    results = _race(tmp_path, str(tmp_path / "store"))
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert results[0]["manifest"] == results[1]["manifest"]
    assert set(results[0]["manifest"]["files"]) == {"data/0.txt", "data/1.txt", "data/2.txt"}


@pytest.mark.processes
def test_two_processes_build_one_artifact_on_s3(s3_endpoint, tmp_path, monkeypatch):
    import s3fs

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))):  # fmt: skip
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir("race-bucket")
    results = _race(tmp_path, "s3://race-bucket/artifacts", s3_endpoint)
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert results[0]["manifest"] == results[1]["manifest"]
