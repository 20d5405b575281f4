"""Retro chunk database: chunk boundaries, valid/invalid chunks, blend and split, resume after a crash or SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from retro.config import ChunkDatabaseConfig
from retro.db import ChunkDatabase, build_chunk_database, document_chunk_bounds
from tests.helpers.retro_corpus import EOD, NEWLINE, WORDS, WordTokenizer, topic_documents, write_corpus
from tests.helpers.wordpiece_corpus import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERGED_FILES = ("chunks.npy", "chunks_invalid.npy", "datasets.json")


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([5, 6, 7, 8, 9, EOD], [(0, 4), (4, 5)]),  # last chunk shorter, EOD stripped
        ([5, 6, 7, 8, 9, 10, 11, 12, EOD], [(0, 4), (4, 8)]),  # exact multiple: no empty last chunk
        ([5, 6, 7, EOD], [(0, 3)]),  # document shorter than a chunk
        ([5, 6, 7, 8], [(0, 4)]),  # no trailing EOD: nothing stripped
        ([5, EOD, 6, EOD], [(0, 3)]),  # only the trailing EOD goes
        ([EOD], []),  # EOD only: no chunk
        ([], []),
    ],
)
def test_document_chunk_bounds(tokens, expected):
    assert document_chunk_bounds(np.array(tokens), EOD, 4) == expected


def _word(stem: str) -> int:
    return WORDS.index(f" {stem}")


def test_database_rows_invalid_chunks_blend_and_split(tmp_path):
    ba, ke, mi = _word("ba"), _word("ke"), _word("mi")
    a = write_corpus(
        str(tmp_path / "a"),
        [
            [ba, ke, mi, ba, ke, EOD],  # chunks [0,4) [4,5)
            [NEWLINE] * 4 + [mi, EOD],  # [0,4) is only newlines: invalid for BERT
            [ke, ke, ke, ke, EOD],  # exactly one chunk
            [mi, mi, EOD],  # valid, but a validation document under --split 75,25,0
        ],
    )
    b = write_corpus(str(tmp_path / "b"), [[mi, ba, EOD], [ba] * 9, [ke, EOD], [mi, EOD]])
    config = ChunkDatabaseConfig(retro_gpt_chunk_length=4, retro_doc_block_size=3, retro_gpt_split="75,25,0")
    bert = build_tokenizer(tmp_path)
    db = build_chunk_database(["3", a, "1", b], str(tmp_path / "db"), config, WordTokenizer(), bert)

    expected = [  # dataset_idx, doc_id, start, end, bert_len (one WordPiece per word)
        [0, 0, 0, 4, 4],
        [0, 0, 4, 5, 1],
        [0, 1, 4, 5, 1],
        [0, 2, 0, 4, 4],
        [1, 0, 0, 2, 2],
        [1, 1, 0, 4, 4],
        [1, 1, 4, 8, 4],
        [1, 1, 8, 9, 1],
        [1, 2, 0, 1, 1],
    ]
    np.testing.assert_array_equal(db.chunks, np.array(expected, dtype=np.uint32))
    assert db.chunks.dtype == np.uint32
    np.testing.assert_array_equal(np.load(tmp_path / "db" / "chunks_invalid.npy"), [[0, 1, 0, 4, 0]])
    infos = json.loads((tmp_path / "db" / "datasets.json").read_text())
    assert [
        (i["ratio"], i["n_docs"], i["n_docs_train"], i["n_chunks_train"], i["n_chunks_invalid"])
        for i in infos
    ] == [
        (3.0, 4, 3, 4, 1),
        (1.0, 4, 3, 5, 0),
    ]
    assert WordTokenizer().detokenize(db.chunk_tokens(6).tolist()) == " ba ba ba ba"
    assert db.chunk_texts([1, 4], WordTokenizer()) == [" ke", " mi ba"]
    # A finished database is opened, not rebuilt; other settings in the same directory are refused.
    assert (
        len(build_chunk_database(["3", a, "1", b], str(tmp_path / "db"), config, WordTokenizer(), bert)) == 9
    )
    other = ChunkDatabaseConfig(retro_gpt_chunk_length=8, retro_doc_block_size=3, retro_gpt_split="75,25,0")
    with pytest.raises(ValueError, match="retro_gpt_chunk_length differ"):
        build_chunk_database(["3", a, "1", b], str(tmp_path / "db"), other, WordTokenizer(), bert)


class CountingTokenizer:
    """Wraps the BERT tokenizer: counts `tokenize_batch` calls (one per block built), crashes at call `fail_at`."""

    def __init__(self, tokenizer, fail_at: int | None = None, kill: bool = False) -> None:
        self.tokenizer, self.fail_at, self.kill, self.calls = tokenizer, fail_at, kill, 0

    def tokenize_batch(self, texts):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("crash while building a block")
        return self.tokenizer.tokenize_batch(texts)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


CONFIG = ChunkDatabaseConfig(retro_gpt_chunk_length=16, retro_doc_block_size=10, retro_gpt_split="90,10,0")


def _corpus(tmp_path) -> list[str]:
    return [
        write_corpus(str(tmp_path / "corpus"), topic_documents(45, seed=3))
    ]  # 5 blocks of <= 10 documents


def _assert_same_files(dir_a, dir_b) -> None:
    for name in MERGED_FILES:
        assert (dir_a / name).read_bytes() == (dir_b / name).read_bytes(), name


def test_crashed_build_resumes_missing_blocks_only(tmp_path):
    data_path, bert = _corpus(tmp_path), build_tokenizer(tmp_path)
    clean = CountingTokenizer(bert)
    build_chunk_database(data_path, str(tmp_path / "clean"), CONFIG, WordTokenizer(), clean)
    assert clean.calls == 5

    crashing = CountingTokenizer(bert, fail_at=3)
    with pytest.raises(RuntimeError, match="crash"):
        build_chunk_database(data_path, str(tmp_path / "db"), CONFIG, WordTokenizer(), crashing)
    assert sorted(os.listdir(tmp_path / "db" / "blocks" / "000")) == [
        "0000000000-0000000010.npy",
        "0000000010-0000000020.npy",
    ]
    assert not (tmp_path / "db" / "datasets.json").exists()
    resumed = CountingTokenizer(bert)
    build_chunk_database(data_path, str(tmp_path / "db"), CONFIG, WordTokenizer(), resumed)
    assert resumed.calls == 3  # the 2 committed blocks are not rebuilt
    _assert_same_files(tmp_path / "clean", tmp_path / "db")


@pytest.mark.processes
def test_sigkilled_build_resumes_to_identical_bytes(tmp_path):
    data_path, bert = _corpus(tmp_path), build_tokenizer(tmp_path)
    build_chunk_database(data_path, str(tmp_path / "clean"), CONFIG, WordTokenizer(), bert)
    script = textwrap.dedent(
        f"""
        import pathlib
        from retro.config import ChunkDatabaseConfig
        from retro.db import build_chunk_database
        from tests.helpers.retro_corpus import WordTokenizer
        from tests.test_retro_db import CONFIG, CountingTokenizer
        from tests.helpers.wordpiece_corpus import build_tokenizer
        bert = CountingTokenizer(build_tokenizer(pathlib.Path({str(tmp_path)!r})), fail_at=4, kill=True)
        build_chunk_database({data_path!r}, {str(tmp_path / "db")!r}, CONFIG, WordTokenizer(), bert)
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, timeout=120
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    assert len(os.listdir(tmp_path / "db" / "blocks" / "000")) == 3
    resumed = CountingTokenizer(bert)
    db = build_chunk_database(data_path, str(tmp_path / "db"), CONFIG, WordTokenizer(), resumed)
    assert resumed.calls == 2
    _assert_same_files(tmp_path / "clean", tmp_path / "db")
    assert len(db) == len(ChunkDatabase(str(tmp_path / "clean"))) > 300
