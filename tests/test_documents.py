"""storage/documents.py: input expansion, streaming readers, bad records, the Parquet shard writer."""

import gzip
import json
import lzma

import fsspec
import pyarrow.parquet as pq
import pytest
import zstandard

from storage.documents import (
    BadRecordError,
    Record,
    expand_inputs,
    iter_records,
    read_parquet_columns,
    write_parquet_shard,
)

DOCS = [{"id": f"d{i}", "text": f"document number {i}", "lang": "en"} for i in range(5)]


def _jsonl_bytes(docs) -> bytes:
    return "".join(json.dumps(d) + "\n" for d in docs).encode()


@pytest.mark.parametrize(
    "suffix, compress",
    [
        (".jsonl", lambda b: b),
        (".json", lambda b: b),
        (".jsonl.gz", gzip.compress),
        (".jsonl.xz", lzma.compress),
        (".jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_reads_jsonl_plain_and_compressed(tmp_path, suffix, compress):
    path = tmp_path / f"docs{suffix}"
    path.write_bytes(compress(_jsonl_bytes(DOCS)))
    records = list(iter_records(str(path)))
    assert [r.data for r in records] == DOCS
    assert [r.line for r in records] == [1, 2, 3, 4, 5]
    assert records[0] == Record(str(path), 1, DOCS[0])


def test_reads_parquet_with_row_numbers(tmp_path):
    path = tmp_path / "docs.parquet"
    write_parquet_shard(DOCS, str(path))
    records = list(iter_records(str(path)))
    assert [r.data for r in records] == DOCS
    assert [r.line for r in records] == [1, 2, 3, 4, 5]


def test_reads_fsspec_memory_url():
    with fsspec.open("memory://docs/a.jsonl", "wb") as f:
        f.write(_jsonl_bytes(DOCS[:2]))
    assert expand_inputs("memory://docs/*.jsonl") == ["memory:///docs/a.jsonl"]
    assert [r.data["id"] for r in iter_records("memory://docs/a.jsonl")] == ["d0", "d1"]


def test_expand_inputs_file_dir_glob_and_error(tmp_path):
    for name in ["b.jsonl", "a.jsonl.gz", "sub/c.parquet", "notes.pdf"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    assert expand_inputs(str(tmp_path / "b.jsonl")) == [str(tmp_path / "b.jsonl")]
    assert expand_inputs(str(tmp_path)) == [
        str(tmp_path / "a.jsonl.gz"),
        str(tmp_path / "b.jsonl"),
        str(tmp_path / "sub/c.parquet"),
    ]
    assert expand_inputs(str(tmp_path / "*.jsonl*")) == [
        str(tmp_path / "a.jsonl.gz"),
        str(tmp_path / "b.jsonl"),
    ]
    with pytest.raises(FileNotFoundError, match="no input files match .*missing"):
        expand_inputs(str(tmp_path / "missing*.jsonl"))


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"title": "x"}', "no 'text' field"),
        ('{"text": 7}', "field 'text' is int, not a string"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(DOCS[0]) + "\n\n" + line + "\n" + json.dumps(DOCS[1]) + "\n")
    with pytest.raises(BadRecordError, match=rf"bad.jsonl:3: {problem}.*--skip-bad-records") as err:
        list(iter_records(str(path)))
    assert err.value.line == 3

    stats: dict = {}
    kept = list(iter_records(str(path), skip_bad_records=True, stats=stats))
    assert [r.data["id"] for r in kept] == ["d0", "d1"]
    assert stats == {"skipped_bad_records": 1, "invalid_utf8_lines": 0}


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n{"text": "fine"}\n')
    stats: dict = {}
    texts = [r.data["text"] for r in iter_records(str(path), stats=stats)]
    assert texts == ["caf\ufffd", "fine"]
    assert stats["invalid_utf8_lines"] == 1


def test_custom_text_key(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"content": "hello"}\n')
    assert [r.data["content"] for r in iter_records(str(path), text_keys=("content",))] == ["hello"]
    with pytest.raises(BadRecordError, match="no 'text' field"):
        list(iter_records(str(path)))


def test_write_parquet_shard_keeps_metadata_union_and_column_order(tmp_path):
    rows = [
        {"text": "a", "id": "1", "url": "u"},
        {"id": "2", "text": "b", "score": 0.5},
        {"id": "3", "text": "c"},
    ]
    path = tmp_path / "out" / "00000.parquet"
    write_parquet_shard(rows, str(path))
    table = pq.read_table(path)
    assert table.column_names == ["id", "text", "url", "score"]
    assert table.to_pylist()[1] == {"id": "2", "text": "b", "url": None, "score": 0.5}
    assert read_parquet_columns(str(path), ["text"]).column("text").to_pylist() == ["a", "b", "c"]
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_write_empty_shard(tmp_path):
    path = tmp_path / "empty.parquet"
    write_parquet_shard([], str(path))
    assert pq.read_table(path).column_names == ["id", "text"]
    assert list(iter_records(str(path))) == []


@pytest.mark.parametrize("name", ["notes.pdf", "table.parquet.gz", "data.csv"])
def test_unknown_format_is_a_clear_error(tmp_path, name):
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ValueError, match=rf"{name}: unknown document format; expected JSON Lines"):
        list(iter_records(str(tmp_path / name)))
