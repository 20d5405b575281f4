"""stages/download.py: every kind of source into Parquet shards, source fingerprints, resume, bad records."""

import gzip
import http.server
import json
import os
import tarfile
import threading
from functools import partial

import fsspec
import pyarrow.parquet as pq
import pytest
import zstandard

from stages import download
from stages.download import DownloadParams
from storage.artifacts import ArtifactStore, ArtifactWriter
from storage.documents import BadRecordError, write_parquet_shard


def _docs(ref) -> list[dict]:
    return [row for f in ref.files("shards/") for row in pq.read_table(ref.local_path(f)).to_pylist()]


def _write_jsonl(path, docs, compress=lambda b: b):
    path.write_bytes(compress("".join(json.dumps(d) + "\n" for d in docs).encode()))


@pytest.fixture
def store(tmp_path):
    return ArtifactStore(str(tmp_path / "store"))


def test_embedded_corpus_is_the_default(store):
    ref = download.run(DownloadParams(docs_per_shard=500), [], store)
    assert ref.files("shards/") == ["shards/00000.parquet", "shards/00001.parquet", "shards/00002.parquet"]
    docs = _docs(ref)
    assert len(docs) == 1189
    assert docs[0]["id"] == "kjv-Ge-1" and docs[0]["title"] == "Ge 1"
    assert docs[0]["text"].startswith("In the beginning God created the heaven and the earth.")
    counts = ref.manifest()["counts"]
    assert counts["docs"] == 1189 and counts["bytes"] == sum(len(d["text"].encode()) for d in docs)
    again = download.run(DownloadParams(docs_per_shard=500), [], store)
    assert again.cache_hit and again.url == ref.url
    assert download.key(DownloadParams(docs_per_shard=500), []) == ref.key


def test_glob_of_compressed_jsonl_and_parquet_with_generated_ids(tmp_path, store):
    src = tmp_path / "src"
    src.mkdir()
    _write_jsonl(
        src / "a.jsonl.gz", [{"body": "first", "lang": "en"}, {"body": "second", "lang": "fr"}], gzip.compress
    )
    _write_jsonl(
        src / "b.jsonl.zst", [{"body": "third", "id": 7}], lambda b: zstandard.ZstdCompressor().compress(b)
    )
    write_parquet_shard([{"id": "p1", "body": "fourth"}], str(src / "c.parquet"))
    params = DownloadParams(source=str(src / "*"), text_key="body", docs_per_shard=3)
    ref = download.run(params, [], store)
    docs = _docs(ref)
    assert [(d["id"], d["text"]) for d in docs] == [
        ("a.jsonl.gz:1", "first"),
        ("a.jsonl.gz:2", "second"),
        ("7", "third"),
        ("p1", "fourth"),
    ]
    assert [d["lang"] for d in docs[:3]] == ["en", "fr", None]
    assert ref.files("shards/") == ["shards/00000.parquet", "shards/00001.parquet"]


def test_text_files_are_one_document_each_from_a_folder_a_glob_or_an_archive(tmp_path, store):
    src = tmp_path / "code"
    (src / "pkg").mkdir(parents=True)
    files = {"pkg/a.py": "def f():\n    return {1: 2}\n", "README.md": "# Title\n", "notes.txt": "plain\n"}
    for name, text in files.items():
        (src / name).write_text(text)
    _write_jsonl(src / "more.jsonl", [{"text": "a json line"}])
    (src / "logo.png").write_bytes(b"\x89PNG")  # not a document file: left out
    docs = _docs(download.run(DownloadParams(source=str(src)), [], store))
    assert [(d["id"], d["text"]) for d in docs] == [
        ("README.md", "# Title\n"), ("more.jsonl:1", "a json line"), ("notes.txt", "plain\n"),
        ("pkg/a.py", files["pkg/a.py"]),
    ]  # fmt: skip
    assert [d["id"] for d in _docs(download.run(DownloadParams(source=f"{src}/**/*.py"), [], store))] == [
        "a.py"
    ]
    archive = tmp_path / "code.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "pkg", arcname="pkg")
        tar.add(src / "notes.txt", arcname="notes.txt")
    ref = download.run(DownloadParams(source=f"tar://**/*.py::{archive}"), [], store)
    assert [(d["id"], d["text"]) for d in _docs(ref)] == [("a.py", files["pkg/a.py"])]

    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(BadRecordError, match=r"latin1.txt:1: not UTF-8 text \(byte 3"):
        download.run(DownloadParams(source=str(src)), [], store)
    skipped = download.run(DownloadParams(source=str(src), skip_bad_records=True), [], store)
    assert len(_docs(skipped)) == 4 and skipped.manifest()["counts"]["skipped_bad_records"] == 1


def test_changed_source_gets_a_new_key_unchanged_is_a_cache_hit(tmp_path, store):
    path = tmp_path / "docs.jsonl"
    _write_jsonl(path, [{"text": "version one"}])
    first = download.run(DownloadParams(source=str(path)), [], store)
    assert download.run(DownloadParams(source=str(path)), [], store).cache_hit
    _write_jsonl(path, [{"text": "version two, longer"}])
    second = download.run(DownloadParams(source=str(path)), [], store)
    assert not second.cache_hit and second.key != first.key
    assert [d["text"] for d in _docs(second)] == ["version two, longer"]
    assert [d["text"] for d in _docs(first)] == ["version one"]  # the old artifact is untouched


def test_memory_and_http_urls(tmp_path, store):
    fsspec.filesystem("memory").pipe("/corpus/docs.jsonl", b'{"text": "from memory"}\n')
    assert [
        d["text"] for d in _docs(download.run(DownloadParams(source="memory://corpus/docs.jsonl"), [], store))
    ] == ["from memory"]

    _write_jsonl(tmp_path / "served.jsonl", [{"id": "h1", "text": "over http"}])
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/served.jsonl"
        ref = download.run(DownloadParams(source=url), [], store)
        assert [(d["id"], d["text"]) for d in _docs(ref)] == [("h1", "over http")]
    finally:
        server.shutdown()


def test_hugging_face_saved_and_json_datasets(tmp_path, store, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": ["alpha", "beta"], "score": [1, 2]}).save_to_disk(str(saved))
    ref = download.run(DownloadParams(hf_name=str(saved), text_key="content"), [], store)
    assert _docs(ref) == [
        {"id": "train-0", "text": "alpha", "score": 1},
        {"id": "train-1", "text": "beta", "score": 2},
    ]

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["t"]}),
            "validation": datasets.Dataset.from_dict({"text": ["v"]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "splits"))
    ref = download.run(DownloadParams(hf_name=str(tmp_path / "splits"), hf_split="validation"), [], store)
    assert _docs(ref) == [{"id": "validation-0", "text": "v"}]
    with pytest.raises(ValueError, match=r"row 0: no string field 'body'"):
        download.run(DownloadParams(hf_name=str(tmp_path / "splits"), text_key="body"), [], store)

    _write_jsonl(tmp_path / "part.jsonl", [{"id": "j1", "text": "gamma"}, {"id": "j2", "text": "delta"}])
    params = DownloadParams(hf_name="json", hf_data_files=[str(tmp_path / "part.jsonl")])
    ref = download.run(params, [], store)
    assert [(d["id"], d["text"]) for d in _docs(ref)] == [("j1", "gamma"), ("j2", "delta")]


def test_bad_record_names_file_and_line_and_loses_nothing(tmp_path, store):
    path = tmp_path / "docs.jsonl"
    good = [{"text": f"doc {i}"} for i in range(4)]
    path.write_text(
        "".join(json.dumps(d) + "\n" for d in good) + '{"txt": "oops"}\n' + json.dumps(good[0]) + "\n"
    )
    with pytest.raises(BadRecordError, match=r"docs.jsonl:5: no 'text' field .*--skip-bad-records"):
        download.run(DownloadParams(source=str(path), docs_per_shard=2), [], store)
    partial_dirs = list((tmp_path / "store" / "download").iterdir())
    assert len(partial_dirs) == 1 and not (partial_dirs[0] / "manifest.json").exists()
    assert sorted(p.name for p in (partial_dirs[0] / "_shards").iterdir()) == ["00000.json", "00001.json"]

    ref = download.run(DownloadParams(source=str(path), docs_per_shard=2, skip_bad_records=True), [], store)
    assert ref.manifest()["counts"]["skipped_bad_records"] == 1
    assert [d["id"] for d in _docs(ref)] == [
        "docs.jsonl:1",
        "docs.jsonl:2",
        "docs.jsonl:3",
        "docs.jsonl:4",
        "docs.jsonl:6",
    ]


def test_crash_then_rerun_reuses_committed_shards(tmp_path, store, monkeypatch):
    path = tmp_path / "docs.jsonl"
    _write_jsonl(path, [{"text": f"doc {i}"} for i in range(10)])
    params = DownloadParams(source=str(path), docs_per_shard=3)
    commit_shard = ArtifactWriter.commit_shard
    calls = []

    def crash_on_third(self, name, files):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        commit_shard(self, name, files)

    monkeypatch.setattr(ArtifactWriter, "commit_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        download.run(params, [], store)
    monkeypatch.setattr(ArtifactWriter, "commit_shard", commit_shard)
    resumed = download.run(params, [], store)
    assert resumed.manifest()["counts"]["shards_reused"] == 2
    fresh = download.run(params, [], ArtifactStore(str(tmp_path / "fresh")))
    for name in fresh.files("shards/"):
        with open(resumed.local_path(name), "rb") as a, open(fresh.local_path(name), "rb") as b:
            assert a.read() == b.read()


def test_missing_source_is_a_clear_error(tmp_path, store):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        download.run(DownloadParams(source=str(tmp_path / "nothing-here*.jsonl")), [], store)
    with pytest.raises(ValueError, match="docs_per_shard must be at least 1, got 0"):
        DownloadParams(docs_per_shard=0)
    assert not os.path.exists(tmp_path / "store" / "download")


def test_s3_source_with_storage_options(tmp_path, store, monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    for name, value in [("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "skip_instance_cache": True}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("corpus-bucket")
        fs.pipe("corpus-bucket/raw/part-0.jsonl.gz", gzip.compress(b'{"id": "s1", "text": "from s3"}\n'))
        params = DownloadParams(source="s3://corpus-bucket/raw/*.jsonl.gz", storage_options=options)
        ref = download.run(params, [], store)
        assert [(d["id"], d["text"]) for d in _docs(ref)] == [("s1", "from s3")]
        assert ref.manifest()["params"]["storage_options"] == {}  # credentials stay out of manifests
        assert download.run(params, [], store).cache_hit
        fs.pipe(
            "corpus-bucket/raw/part-0.jsonl.gz", gzip.compress(b'{"id": "s1", "text": "changed in s3"}\n')
        )
        changed = download.run(params, [], store)
        assert changed.key != ref.key and _docs(changed)[0]["text"] == "changed in s3"
    finally:
        server.stop()
