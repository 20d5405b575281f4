"""The tokenize stage: Megatron's bytes, sharding and merging, resume after kill -9, bad input, caching."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import zstandard

import stages.tokenize as tokenize_stage
from megatron_train.tokenizer import build_tokenizer
from stages.sentences import split_sentences
from stages.tokenize import main, run
from stages.tokenize_inputs import plan_units
from stages.tokenize_params import PARTIALS_DIR, TokenizeParams
from storage.artifacts import ArtifactStore, ArtifactWriter
from storage.documents import read_lines
from storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The shared data beside the checkout; the GPT-2 tests skip without it.
VOCAB = os.path.join(REPO, "..", "shared", "vocab")
GPT2_FILES = (os.path.join(VOCAB, "gpt2-vocab.json"), os.path.join(VOCAB, "gpt2-merges.txt"))
needs_gpt2 = pytest.mark.skipif(
    not all(map(os.path.isfile, GPT2_FILES)), reason="shared GPT-2 vocabulary absent"
)

NULL = TokenizeParams(tokenizer_type="NullTokenizer", vocab_size=1000, append_eod=True, workers=2)


def null_text(i: int) -> str:
    """A NullTokenizer document (its text is the ids); every 7th is empty."""
    return "" if i % 7 == 3 else " ".join(str((i * 31 + j) % 1000) for j in range(1 + i % 13))


def write_jsonl(path: str, rows: list[dict]) -> str:
    """JSON Lines, gzip- or zstd-compressed by the file's suffix."""
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    if path.endswith(".gz"):
        data = gzip.compress(data)
    elif path.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def megatron_reference(prefix: str, documents: list, params: TokenizeParams) -> bytes:
    """What Megatron's `Encoder.encode` + `add_document` write for `documents`, one tokenize() per sentence."""
    tokenizer = params.build_tokenizer()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=best_dtype(tokenizer.vocab_size))
    for text in documents:
        sentences = (
            text if isinstance(text, list) else split_sentences(text) if params.split_sentences else [text]
        )
        ids, lengths = [], []
        for sentence in sentences:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids and params.append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(prefix + ".idx")
    return read_pair(prefix)


def read_pair(prefix: str) -> bytes:
    with open(prefix + ".bin", "rb") as b, open(prefix + ".idx", "rb") as i:
        return b.read() + b"|" + i.read()


def artifact_prefix(ref, params: TokenizeParams, key: str = "text") -> str:
    """A local prefix of the artifact's `.bin/.idx` for `key` (downloaded from a remote store)."""
    ref.local_path(params.output_name(key) + ".idx")
    return ref.local_path(params.output_name(key) + ".bin")[: -len(".bin")]


def artifact_pair(ref, params: TokenizeParams, key: str = "text") -> bytes:
    return read_pair(artifact_prefix(ref, params, key))


# --- sentence splitting ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("Mr. Smith came. He left.", ["Mr. Smith came.", "He left."]),
        ("It cost 3.50 dollars. Cheap!", ["It cost 3.50 dollars.", "Cheap!"]),
        ('He said "Stop." Then he ran? Yes...  Done', ['He said "Stop."', "Then he ran?", "Yes...", "Done"]),
        ("J. R. R. Tolkien, e.g. here, wrote it. The U.S. Army won.", ["J. R. R. Tolkien, e.g. here, wrote it.", "The U.S. Army won."]),
        ("lower case. no split here", ["lower case. no split here"]),
        ("A title\n\nfirst line\nsecond line. Next", ["A title", "first line\nsecond line.", "Next"]),
        ("See Fig. 3 and No. 5. (Aside.) End", ["See Fig. 3 and No. 5.", "(Aside.)", "End"]),
        ("  \n\n", []),
    ],
)  # fmt: skip
def test_split_sentences(text, sentences):
    assert split_sentences(text) == sentences


def test_keep_newlines_keeps_every_character():
    text = "\n\nFirst one.  Second one!\n\nThird\n\n\n  Fourth.\n"
    pieces = split_sentences(text, keep_newlines=True)
    assert "".join(pieces) == text
    assert pieces == ["\n\nFirst one.  ", "Second one!\n\n", "Third\n\n\n  ", "Fourth.\n"]


# --- planning --------------------------------------------------------------------------------------------


def test_plain_jsonl_is_cut_in_byte_ranges_at_line_boundaries(tmp_path):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": null_text(i)} for i in range(300)])
    with open(path, "rb") as f:
        data = f.read()
    units = plan_units([path], dataclasses.replace(NULL, workers=1, shard_size_mb=1000 / 2**20), {})
    spans = [u.span for u in units]
    assert len(units) > 5 and all(u.url == path for u in units)
    assert spans[0].start == 0 and spans[-1].stop == len(data)
    assert all(a.stop == b.start for a, b in zip(spans[:-1], spans[1:], strict=True))
    for span in spans:
        chunk = data[span.start : span.stop]
        assert chunk.endswith(b"\n") and len(chunk) >= 1000 or span is spans[-1]
        assert data[: span.start].count(b"\n") + 1 == span.first_line
        assert chunk.count(b"\n") == span.lines
    assert [u.name for u in units] == sorted(u.name for u in units)
    # --partitions asks for about that many units (cut at the line after each 1/40 of the bytes)
    assert 30 <= len(plan_units([path], dataclasses.replace(NULL, partitions=40, shard_size_mb=64), {})) <= 40


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_units_read_back_every_line_once(tmp_path, suffix):
    lines = [json.dumps({"text": null_text(i)}).encode() for i in range(300)]
    lines[10] = lines[11] = b""  # blank lines count as lines
    data = b"\n".join(lines)  # and the last line has no newline
    path = str(tmp_path / f"in{suffix}")
    with open(path, "wb") as f:
        f.write(
            {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}.get(suffix[6:], bytes)(data)
        )
    params = dataclasses.replace(NULL, workers=3, shard_size_mb=1000 / 2**20)
    units = plan_units([path], params, {})
    # a compressed file cannot seek: it is cut in at most --workers line ranges
    assert len(units) == 3 if suffix != ".jsonl" else len(units) > 5
    assert sum(u.span.lines for u in units) == 300
    read = [item for unit in units for item in read_lines(unit.url, unit.span)]
    assert read == list(enumerate(lines, start=1))


# --- end to end ------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_output_is_megatrons_bytes_whatever_the_cut(tmp_path, caplog):
    texts = [null_text(i) for i in range(400)]
    rows = [{"text": t, "title": t[:9], "id": i} for i, t in enumerate(texts)]
    rows[5]["text"] = ["1 2 3", "", "4 5"]  # a list is the document's sentences, as in Megatron
    texts[5] = rows[5]["text"]
    write_jsonl(str(tmp_path / "a.jsonl"), rows[:150])
    write_jsonl(str(tmp_path / "b.jsonl.gz"), rows[150:300])
    write_jsonl(str(tmp_path / "c.jsonl.zst"), rows[300:])  # not seekable: workers read past earlier units
    pattern = str(tmp_path / "*.json*")
    params = dataclasses.replace(NULL, json_keys=("text", "title"), shard_size_mb=2000 / 2**20)

    with caplog.at_level(logging.INFO, logger="megatron_flow.stage.tokenize"):
        ref = run(
            dataclasses.replace(params, log_interval=100), pattern, ArtifactStore(str(tmp_path / "store"))
        )
    assert artifact_pair(ref, params) == megatron_reference(str(tmp_path / "expected"), texts, params)
    # Megatron's throughput lines as units finish: one per 100 documents crossed, ending at the 400th
    processed = [
        int(r.getMessage().split()[1]) for r in caplog.records if r.getMessage().startswith("Processed ")
    ]
    assert processed == sorted(processed) and processed[-1] == 400 and len(processed) <= 4
    titles = [row["title"] for row in rows]
    assert artifact_pair(ref, params, "title") == megatron_reference(str(tmp_path / "titles"), titles, params)
    summary = ref.manifest()["summary"]
    assert summary["documents"] == 400
    # sentences, tokens and empty documents are counted over all --json-keys
    assert summary["empty_documents"] == 2 * sum(1 for i in range(400) if i % 7 == 3)
    datasets = [IndexedDataset(artifact_prefix(ref, params, key)) for key in params.json_keys]
    assert summary["tokens"] == sum(d.sequence_lengths.sum() for d in datasets)
    assert summary["sentences"] == sum(len(d) for d in datasets)
    assert not ref.files(PARTIALS_DIR)

    # One worker, one unit per file: other shards, same bytes, and the same key (a cache hit).
    one_unit = dataclasses.replace(params, workers=1, shard_size_mb=64)
    again = run(one_unit, pattern, ArtifactStore(str(tmp_path / "store2")))
    assert again.key == ref.key and not again.cache_hit
    assert artifact_pair(again, params) == artifact_pair(ref, params)
    started = time.time()
    hit = run(one_unit, pattern, ArtifactStore(str(tmp_path / "store2")))
    assert hit.cache_hit and hit.url == again.url and time.time() - started < 5


@pytest.mark.processes
def test_parquet_artifact_input_matches_jsonl(tmp_path):
    texts = [null_text(i) for i in range(120)]
    store = ArtifactStore(str(tmp_path / "store"))
    writer = store.begin("clean", "k1")
    for shard in range(2):
        local = str(tmp_path / f"{shard}.parquet")
        part = texts[shard * 60 : (shard + 1) * 60]
        pq.write_table(pa.table({"id": [str(i) for i in range(60)], "text": part}), local, row_group_size=16)
        writer.commit_shard(f"{shard:05d}", {f"shards/{shard:05d}.parquet": local})
    documents = writer.commit({})
    params = dataclasses.replace(NULL, shard_size_mb=500 / 2**20)

    ref = run(params, documents, store)
    assert artifact_pair(ref, params) == megatron_reference(str(tmp_path / "expected"), texts, params)
    assert ref.manifest()["inputs"] == [documents.fingerprint]

    writer = store.begin("clean", "k2")
    local = str(tmp_path / "null.parquet")
    pq.write_table(pa.table({"text": ["1", None, "2"]}), local)
    writer.commit_shard("00000", {"shards/00000.parquet": local})
    with pytest.raises(ValueError, match=r"00000\.parquet:2: field 'text' is null"):
        run(params, writer.commit({}), store)
    with pytest.raises(
        ValueError, match=r"00000\.parquet: no column 'body' \(columns: text\); set --json-keys"
    ):
        run(dataclasses.replace(params, json_keys=("body",)), store.find("clean", "k2"), store)


BAD_LINES = {
    3: (b'{"text": "3"', r"not valid JSON \(Expecting ',' delimiter; column 13\)"),
    4: (b'{"other": "4"}', r"no 'text' field \(fields: other\); set --json-keys"),
    5: (b'{"text": 5}', r"field 'text' is int, not a string or a list of strings"),
    6: (b"[1, 2]", r"expected a JSON object, got list"),
}


def write_lines(path: str, bad: list[int]) -> str:
    """Good records, a blank line 2, invalid UTF-8 on line 7, and the BAD_LINES numbered in `bad`."""
    lines = [
        b'{"text": "1 2"}',
        b"",
        *(BAD_LINES[n][0] if n in bad else b'{"text": "0"}' for n in (3, 4, 5, 6)),
    ]
    lines += [b'{"text": "6", "junk": "\xff"}', b'{"text": "7"}']
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.processes
@pytest.mark.parametrize("line", sorted(BAD_LINES))
def test_a_bad_record_stops_the_run_naming_file_line_and_problem(tmp_path, line):
    path = write_lines(str(tmp_path / "bad.jsonl"), [line])
    with pytest.raises(
        ValueError, match=rf"bad\.jsonl:{line}: {BAD_LINES[line][1]}; .*pass --skip-bad-records"
    ):
        run(NULL, path, ArtifactStore(str(tmp_path / "store")))


@pytest.mark.processes
def test_skip_bad_records_counts_them(tmp_path):
    path = write_lines(str(tmp_path / "bad.jsonl"), sorted(BAD_LINES))
    params = dataclasses.replace(NULL, skip_bad_records=True, vocab_size=70000)
    ref = run(params, path, ArtifactStore(str(tmp_path / "store")))
    summary = ref.manifest()["summary"]
    assert summary["skipped_bad_records"] == 4
    assert summary["invalid_utf8_lines"] == 1
    assert summary["documents"] == 3
    assert ref.manifest()["dtype"] == "int32"
    dataset = IndexedDataset(artifact_prefix(ref, params))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 70000], [6, 70000], [7, 70000]]


@pytest.mark.processes
def test_cli_resumes_after_kill_9_with_identical_bytes(tmp_path, caplog, capsys):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": null_text(i)} for i in range(3000)])
    out = str(tmp_path / "out" / "corpus")
    argv = [
        "--input", path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--append-eod",
        "--workers", "1", "--shard-size-mb", str(1500 / 2**20), "--output-prefix", out,
    ]  # fmt: skip
    killed_store = str(tmp_path / "killed")
    process = subprocess.Popen(
        [sys.executable, "-m", "stages.tokenize", *argv, "--store", killed_store],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shards = os.path.join(killed_store, "tokenize")
    deadline = time.time() + 60
    while time.time() < deadline and process.poll() is None:
        markers = [
            m
            for folder, _, files in os.walk(shards)
            if folder.endswith("_shards")
            for m in files
            if m.endswith(".json")
        ]
        if len(markers) >= 3:
            break
        time.sleep(0.002)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    (artifact,) = os.listdir(shards)
    assert not os.path.exists(os.path.join(shards, artifact, "manifest.json")), "run ended before the kill"
    committed = sum(m.endswith(".json") for m in os.listdir(os.path.join(shards, artifact, "_shards")))

    with caplog.at_level(logging.INFO, logger="megatron_flow.stage"):
        assert main([*argv, "--store", killed_store]) == 0
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming")]
    assert resumed and resumed[0].startswith(f"resuming: {committed} of ")
    killed_output = read_pair(out + "_text_document")

    assert main([*argv, "--store", str(tmp_path / "clean")]) == 0
    assert read_pair(out + "_text_document") == killed_output
    os.remove(out + "_text_document.bin")
    capsys.readouterr()
    assert main([*argv, "--store", killed_store]) == 0  # a cache hit exports the files again
    printed = capsys.readouterr().out
    assert printed.startswith("cache hit: ") and "3000 documents" in printed
    assert read_pair(out + "_text_document") == killed_output
    assert not os.path.exists(os.path.join(shards, artifact, ".scratch"))
    assert not os.path.exists(os.path.join(shards, artifact, PARTIALS_DIR))


@pytest.mark.processes
@needs_gpt2
@pytest.mark.parametrize("split", [False, True])
def test_gpt2_matches_megatron_per_document_encoding(tmp_path, split):
    texts = [
        "Hello world. This is GPT-2's tokenizer, café, naïve, 日本語. Mr. Smith paid $3.50!",
        "",
        "Second document.\n\nWith a paragraph. And another sentence? Yes.",
        "x" * 5000 + " a very long word",
    ] * 10
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": t} for t in texts])
    params = TokenizeParams(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=GPT2_FILES[0],
        merge_file=GPT2_FILES[1],
        append_eod=True,
        split_sentences=split,
        workers=2,
        shard_size_mb=2000 / 2**20,
    )
    ref = run(params, path, ArtifactStore(str(tmp_path / "store")))
    assert ref.manifest()["dtype"] == "uint16"
    assert artifact_pair(ref, params) == megatron_reference(str(tmp_path / "expected"), texts, params)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_FILES[0], merge_file=GPT2_FILES[1])
    dataset = IndexedDataset(artifact_prefix(ref, params))
    first = dataset.document_indices[:2]
    decoded = "".join(tokenizer.detokenize(dataset[s].tolist()) for s in range(*first))
    expected = " ".join(split_sentences(texts[0])) if split else texts[0]
    assert decoded.replace(" ", "") == (expected + "<|endoftext|>").replace(" ", "")


def test_a_tokenizer_that_cannot_start_reports_its_own_error(tmp_path):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": "hello"}])
    params = TokenizeParams(
        vocab_file=str(tmp_path / "missing.json"), merge_file=str(tmp_path / "m.txt"), workers=1
    )
    with pytest.raises(FileNotFoundError, match=r"--vocab-file .*missing\.json: no such file"):
        run(params, path, ArtifactStore(str(tmp_path / "store")))


def test_empty_input_and_a_remote_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))
    empty = write_jsonl(str(tmp_path / "empty.jsonl"), [])
    ref = run(NULL, empty, ArtifactStore(str(tmp_path / "store")))
    assert ref.manifest()["summary"]["documents"] == 0 and ref.manifest()["dtype"] == "uint16"
    assert IndexedDataset(artifact_prefix(ref, NULL)).document_indices.tolist() == [0]

    texts = [null_text(i) for i in range(50)]
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": t} for t in texts])
    remote = ArtifactStore(f"memory://tokenize-test-{os.getpid()}")
    # One worker: units run in this process, since a memory:// store lives in one process only.
    params = dataclasses.replace(NULL, shard_size_mb=100 / 2**20, workers=1)
    ref = run(params, path, remote)
    assert ref.url.startswith("memory://")
    assert artifact_pair(ref, params) == megatron_reference(str(tmp_path / "expected"), texts, params)
    assert not ref.files(PARTIALS_DIR)


@pytest.mark.processes
def test_an_input_without_documents_warns_or_fails_on_request(tmp_path, caplog, capsys):
    blank = str(tmp_path / "blank.jsonl")
    with open(blank, "w") as f:
        f.write("\n  \n")
    store = ArtifactStore(str(tmp_path / "store"))
    with caplog.at_level(logging.WARNING, logger="megatron_flow.stage.tokenize"):
        ref = run(NULL, blank, store)
    assert ref.manifest()["summary"]["documents"] == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"no documents in {blank}: the dataset ") and "--fail-on-empty" in warning

    with pytest.raises(ValueError, match=r"no documents in .*blank\.jsonl.*--fail-on-empty is set"):
        run(dataclasses.replace(NULL, fail_on_empty=True), blank, store)
    argv = ["--input", blank, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "1"]
    argv += ["--store", str(tmp_path / "store"), "--output-prefix", str(tmp_path / "out")]
    assert main([*argv, "--fail-on-empty"]) == 1
    assert "blank.jsonl" in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "out_text_document.bin"))
    assert main(argv) == 0 and os.path.exists(str(tmp_path / "out_text_document.bin"))


def test_an_unwritable_output_prefix_fails_before_tokenizing(tmp_path, capsys):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": null_text(i)} for i in range(20)])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    argv = ["--input", path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--workers", "1"]
    argv += ["--store", str(tmp_path / "store"), "--output-prefix", str(blocker / "out" / "corpus")]
    assert main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: --output-prefix {blocker}/out/corpus: cannot create the folder ")
    assert error.endswith("choose a writable path")
    assert not os.path.exists(tmp_path / "store" / "tokenize"), "tokenized before checking the output"


def test_cli_reports_bad_input_and_missing_files_in_one_line(tmp_path, capsys):
    common = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "1"]
    common += ["--store", str(tmp_path / "store"), "--output-prefix", str(tmp_path / "out")]
    assert main(["--input", str(tmp_path / "nothing*.jsonl"), *common]) == 1
    assert "error: no input files match" in capsys.readouterr().err
    path = write_lines(str(tmp_path / "bad.jsonl"), [5])
    assert main(["--input", path, *common]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "bad.jsonl:5: field 'text' is int, not a string or a list of strings; to skip such records and count "
            "them, pass --skip-bad-records (in the corpus flow: --download.skip-bad-records true)"
        )
    )
    assert not os.path.exists(str(tmp_path / "out_text_document.bin"))


def test_key_depends_on_tokenizer_content_not_paths_or_workers(tmp_path):
    for folder in ("a", "b"):
        os.makedirs(tmp_path / folder)
        (tmp_path / folder / "vocab.txt").write_text("[PAD]\nhello\n")
    a = TokenizeParams(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(tmp_path / "a" / "vocab.txt"))
    b = dataclasses.replace(a, vocab_file=str(tmp_path / "b" / "vocab.txt"), workers=7, partitions=3)
    assert a.fingerprint_fields() == b.fingerprint_fields()
    assert "vocab.txt" not in json.dumps(a.fingerprint_fields())
    (tmp_path / "b" / "vocab.txt").write_text("[PAD]\nworld\n")
    assert a.fingerprint_fields() != b.fingerprint_fields()
    assert a.fingerprint_fields() != dataclasses.replace(a, append_eod=True).fingerprint_fields()
    assert dataclasses.replace(a, split_sentences=True).output_name("body") == "tokens_body_sentence"
    assert a.output_name("text") == "tokens_text_document"


@pytest.mark.processes
def test_a_crash_after_the_merge_is_resumed_without_tokenizing_again(tmp_path, monkeypatch):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": null_text(i)} for i in range(200)])
    params = dataclasses.replace(NULL, shard_size_mb=500 / 2**20)
    clean = artifact_pair(run(params, path, ArtifactStore(str(tmp_path / "clean"))), params)

    def crash(self, manifest):
        raise RuntimeError("killed before the manifest")

    store = ArtifactStore(str(tmp_path / "store"))
    with monkeypatch.context() as patch:
        patch.setattr(ArtifactWriter, "commit", crash)
        with pytest.raises(RuntimeError, match="killed before the manifest"):
            run(params, path, store)
    (artifact,) = os.listdir(tmp_path / "store" / "tokenize")
    assert not os.path.exists(tmp_path / "store" / "tokenize" / artifact / PARTIALS_DIR)  # already merged

    def no_tokenizing(*args):
        raise AssertionError("the merged output was committed: nothing is left to tokenize")

    monkeypatch.setattr(tokenize_stage, "run_shards", no_tokenizing)
    ref = run(params, path, store)
    assert artifact_pair(ref, params) == clean
    assert ref.manifest()["summary"]["documents"] == 200


def write_tokenizer_json(path: str, eos: bool) -> str:
    """A word-level tokenizer.json whose post-processor puts <s> in front, as Llama's does."""
    words = ["<s>", "[UNK]", "the", "cat", "sat", "."] + (["</s>"] if eos else [])
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>"] + (["</s>"] if eos else []))
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(path)
    return path


def test_hugging_face_tokenizer_json_with_special_tokens(tmp_path):
    texts = ["the cat sat . The cat sat .", "", "cat"]
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": t} for t in texts])
    os.makedirs(tmp_path / "tok")
    model = write_tokenizer_json(str(tmp_path / "tok" / "tokenizer.json"), eos=True)
    params = TokenizeParams(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model, append_eod=True, workers=1
    )
    for split in (False, True):
        params = dataclasses.replace(params, split_sentences=split)
        ref = run(params, path, ArtifactStore(str(tmp_path / "store")))
        assert artifact_pair(ref, params) == megatron_reference(
            str(tmp_path / f"expected{split}"), texts, params
        )
    dataset = IndexedDataset(artifact_prefix(ref, params))
    assert dataset[0].tolist() == [0, 2, 3, 4, 5]  # "<s> the cat sat ." (one sentence of the split document)
    assert dataset[1].tolist() == [0, 1, 3, 4, 5, 6]  # "<s> [UNK] cat sat . </s>"

    no_eos = write_tokenizer_json(str(tmp_path / "tok" / "no-eos.json"), eos=False)
    with pytest.raises(
        ValueError, match="--append-eod: the HuggingFaceTokenizer tokenizer has no end-of-document"
    ):
        run(dataclasses.replace(params, tokenizer_model=no_eos), path, ArtifactStore(str(tmp_path / "store")))


@pytest.mark.processes
def test_cli_parses_its_flags_without_importing_torch():
    """The command line's tokenizer flags come from the config dataclasses (`megatron_train.config_flags`),
    not from the training engine: no torch import (seconds) before tokenizing."""
    code = (
        "import sys; from stages.tokenize import parse_args; "
        "args = parse_args(['--input', 'x.jsonl', '--tokenizer-type', 'GPT2BPETokenizer', '--vocab-file', 'v',"
        " '--output-prefix', 'out']); "
        "assert args.vocab_file == 'v', args; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
