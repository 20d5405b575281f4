"""The tokenize stage's per-unit work, run in worker processes: read one unit's documents (through
`storage.documents`), tokenize them in batches, and commit them as one shard: a partial `.bin/.idx` per
`--json-keys` key plus the unit's counts.

Each process builds its tokenizer once (`worker_tokenizer`) and runs it single-threaded in a worker process, so
`--workers` is the number of cores used. Tokens are what Megatron's `Encoder.encode` makes: one `tokenize` per
sentence, empty sentences dropped, EOD appended to a non-empty document, memory bounded by the batch.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import uuid
from itertools import chain

import numpy as np

from megatron_train.tokenizer import MegatronTokenizer
from stages.sentences import split_sentences
from stages.shards import write_json
from stages.tokenize_inputs import WorkUnit
from stages.tokenize_params import COUNTERS, PARTIALS_DIR, TokenizeParams
from storage.artifacts import ArtifactWriter
from storage.documents import iter_records
from storage.indexed_dataset import IndexedDatasetBuilder, best_dtype, data_file_path, index_file_path

BATCH_DOCS = 512
BATCH_TEXT_BYTES = 4 << 20


@functools.lru_cache(maxsize=1)
def worker_tokenizer(params: TokenizeParams) -> MegatronTokenizer:
    """The process's tokenizer, built on its first unit and kept for the next ones."""
    if multiprocessing.parent_process() is not None:  # a worker process: one thread, one core
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return params.build_tokenizer()


def encode_batch(
    documents: list[str | list[str]],
    params: TokenizeParams,
    tokenizer: MegatronTokenizer,
    dtype: np.dtype,
    stats: dict,
) -> list[tuple[np.ndarray, list[int]]]:
    """Tokens and sequence lengths of each document, as Megatron's `Encoder.encode` makes them."""
    sentences_per_document = [
        document if isinstance(document, list)
        else split_sentences(document, params.keep_newlines) if params.split_sentences
        else [document]
        for document in documents
    ]  # fmt: skip
    flat = [sentence for sentences in sentences_per_document for sentence in sentences]
    ids = iter(tokenizer.tokenize_batch(flat) if flat else [])
    encoded = []
    for sentences in sentences_per_document:
        kept = [sentence_ids for sentence_ids in (next(ids) for _ in sentences) if sentence_ids]
        lengths = [len(sentence_ids) for sentence_ids in kept]
        if kept and params.append_eod:
            kept.append([tokenizer.eod])
            lengths[-1] += 1
        tokens = np.array(list(chain.from_iterable(kept)), dtype=dtype)
        encoded.append((tokens, lengths))
        stats["sentences"] += len(lengths)
        stats["tokens"] += tokens.size
        stats["empty_documents"] += not lengths
    return encoded


def _utf8_size(value: str | list[str]) -> int:
    return len(value.encode()) if isinstance(value, str) else sum(len(s.encode()) for s in value)


def tokenize_unit(
    writer: ArtifactWriter, unit: WorkUnit, params: TokenizeParams, storage_options: dict
) -> dict:
    """Tokenize one unit and commit it as shard `unit.name` (`partials/<name>/...`); return its counts."""
    tokenizer = worker_tokenizer(params)
    keys = params.json_keys
    stats = dict.fromkeys(COUNTERS, 0)
    dtype = best_dtype(tokenizer.vocab_size)
    # A unique local name: a worker left running by a killed run never writes the files a rerun commits.
    scratch = os.path.join(writer.local_dir, PARTIALS_DIR, f"{unit.name}.{uuid.uuid4().hex}")
    os.makedirs(os.path.dirname(scratch), exist_ok=True)
    builders = {key: IndexedDatasetBuilder(data_file_path(f"{scratch}.{key}"), dtype=dtype) for key in keys}
    batch: list[list] = []
    text_bytes = 0

    def flush() -> None:
        nonlocal text_bytes
        for k, key in enumerate(keys):
            documents = [values[k] for values in batch]
            for tokens, lengths in encode_batch(documents, params, tokenizer, dtype, stats):
                builders[key].add_document(tokens, lengths)
        stats["documents"] += len(batch)
        stats["bytes"] += text_bytes
        batch.clear()
        text_bytes = 0

    records = iter_records(
        unit.url,
        text_keys=keys,
        key_flag="--json-keys",
        sentence_lists=True,
        skip_bad_records=params.skip_bad_records,
        stats=stats,
        span=unit.span,
        columns=keys,
        **storage_options,
    )
    for record in records:
        values = [record.data[key] for key in keys]
        batch.append(values)
        text_bytes += sum(_utf8_size(value) for value in values)
        if len(batch) >= BATCH_DOCS or text_bytes >= BATCH_TEXT_BYTES:
            flush()
    flush()
    files = {f"{PARTIALS_DIR}/{unit.name}/stats.json": write_json(stats, f"{scratch}.stats.json")}
    for key in keys:
        builders[key].finalize(index_file_path(f"{scratch}.{key}"))
        name = params.output_name(key)
        files[f"{PARTIALS_DIR}/{unit.name}/{name}.bin"] = data_file_path(f"{scratch}.{key}")
        files[f"{PARTIALS_DIR}/{unit.name}/{name}.idx"] = index_file_path(f"{scratch}.{key}")
    writer.commit_shard(unit.name, files)
    return stats
