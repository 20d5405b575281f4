"""Download stage: documents from files, fsspec URLs or a Hugging Face dataset into Parquet shards.

Sources: a local path, directory, glob or any fsspec URL (file, http(s), s3, gs, memory, tar, ...) of JSON Lines
(optionally .gz/.zst/.xz/.bz2), Parquet or web archive files (WARC/WET, optionally .gz: storage/warc.py), or of
text files that are one document each (.py, .txt, .md: a folder of source code, `tar://**/*.py::code.tar.xz`);
or a Hugging Face dataset by name (streamed), by local folder given to `load_dataset`, or saved with
`save_to_disk`. Output: `shards/00000.parquet`, ... with columns `id`, `text` and the source's other fields.
Documents without an id get a deterministic one. A web archive's pages keep their HTML (the clean stage
extracts the main text after its URL filter) with columns `url`, `date` and `content_type`; the manifest
counts the records read, the records dropped (`non_html`, `empty_page`, `unparsable_record`) and the offsets
of the records that could not be parsed.

The key depends on the source's fingerprint (URL plus size, mtime, ETag of every file), so a scheduled
refresh rebuilds a changed source and is a cache hit on an unchanged one. Reading is one stream; shards are
committed as they fill, and a rerun after a crash skips writing the shards already committed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from stages.base import Inputs, Stage, expect_inputs
from stages.shards import log, shard_file, shard_name
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.documents import document_format, expand_inputs, iter_records, write_parquet_shard
from storage.fingerprint import canonical_json, hash_bytes, source_fingerprint
from storage.warc import is_warc, iter_warc_pages, new_warc_stats

EMBEDDED_CORPUS = str(Path(__file__).parent / "corpora" / "kjv.jsonl.xz")


@dataclass(frozen=True)
class DownloadParams:
    """Where the documents come from and how they are sharded.

    `source` is a path, glob or fsspec URL; `hf_name` (when set) a Hugging Face dataset name or local
    folder and wins over `source`.
    """

    source: str = EMBEDDED_CORPUS
    hf_name: str | None = None
    hf_config: str | None = None
    hf_split: str = "train"
    hf_data_files: list[str] | None = None
    hf_revision: str | None = None
    text_key: str = "text"
    id_key: str = "id"
    docs_per_shard: int = 10_000
    skip_bad_records: bool = False
    storage_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.docs_per_shard < 1:
            raise ValueError(f"docs_per_shard must be at least 1, got {self.docs_per_shard}")


def _is_saved_dataset(path: str) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, marker)) for marker in ("state.json", "dataset_dict.json")
    )


def source_description(params: DownloadParams) -> str:
    """The fingerprint of the external source the artifact's key depends on."""
    if params.hf_name is None:
        return source_fingerprint(params.source, **params.storage_options)
    if os.path.isdir(params.hf_name):
        return source_fingerprint(params.hf_name)
    # A hub dataset cannot be inspected offline: its name, config, split and revision identify it.
    hub = {
        k: getattr(params, k) for k in ("hf_name", "hf_config", "hf_split", "hf_data_files", "hf_revision")
    }
    return hash_bytes(canonical_json(hub).encode())


def _hf_documents(params: DownloadParams) -> Iterator[dict]:
    """The documents of a Hugging Face dataset, streamed where the dataset allows it."""
    import datasets

    if _is_saved_dataset(params.hf_name):
        dataset = datasets.load_from_disk(params.hf_name)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[params.hf_split]
    else:
        dataset = datasets.load_dataset(
            params.hf_name,
            params.hf_config,
            split=params.hf_split,
            data_files=params.hf_data_files,
            revision=params.hf_revision,
            streaming=True,
        )
    for index, row in enumerate(dataset):
        if not isinstance(row.get(params.text_key), str):
            raise ValueError(
                f"{params.hf_name}[{params.hf_split}] row {index}: no string field {params.text_key!r} "
                f"(fields: {', '.join(sorted(row))}); set text_key"
            )
        yield _document(f"{params.hf_split}-{index}", row, params.text_key, params.id_key)


def _file_documents(params: DownloadParams, stats: dict, warc_stats: dict) -> Iterator[dict]:
    """The documents of every file the source names; a record's default id is `<relative path>:<line>`, a text
    file's (one document) its relative path, a web archive page's its WARC-Record-ID (else
    `<relative path>@<offset>`)."""
    urls = expand_inputs(params.source, **params.storage_options)
    names = [url.partition("::")[0] for url in urls]  # tar://a.py::code.tar.xz: the file in the archive
    prefix = os.path.commonprefix(names)
    root = prefix[: prefix.rfind("/") + 1]  # the deepest folder holding every file
    for url, name in zip(urls, names, strict=True):
        relative = name[len(root) :]
        if is_warc(url):
            for offset, page in iter_warc_pages(url, warc_stats, **params.storage_options):
                yield _document(f"{relative}@{offset}", page, "text", "id")
            continue
        records = iter_records(
            url,
            text_keys=(params.text_key,),
            skip_bad_records=params.skip_bad_records,
            stats=stats,
            **params.storage_options,
        )
        whole_file = document_format(url) == "text"
        for record in records:
            default_id = relative if whole_file else f"{relative}:{record.line}"
            yield _document(default_id, record.data, params.text_key, params.id_key)


def _document(default_id: str, row: dict, text_key: str, id_key: str) -> dict:
    """`id` and `text` first, then the other fields as metadata (a field named id or text that is not the
    id or text key would clash, and is dropped)."""
    doc_id = row.get(id_key)
    metadata = {k: v for k, v in row.items() if k not in (text_key, id_key, "id", "text")}
    return {"id": default_id if doc_id is None else str(doc_id), "text": row[text_key], **metadata}


def _warc_counts(warc_stats: dict) -> dict:
    """The web archive counts for the manifest (none when the source had no WARC/WET file)."""
    if not warc_stats["warc_records"] and not any(warc_stats["bad_offsets"].values()):
        return {}
    offsets = {url: found for url, found in warc_stats["bad_offsets"].items() if found}
    return {
        "warc_records": warc_stats["warc_records"],
        "dropped": warc_stats["dropped"],
        "bad_record_offsets": offsets,
    }


def _build(params: DownloadParams, writer: ArtifactWriter) -> dict:
    stats: dict = {"skipped_bad_records": 0, "invalid_utf8_lines": 0}
    warc_stats = new_warc_stats()
    docs = _hf_documents(params) if params.hf_name is not None else _file_documents(params, stats, warc_stats)
    counts = {"docs": 0, "bytes": 0, "shards": 0, "shards_reused": 0}
    started = time.time()
    batch: list[dict] = []

    def flush() -> None:
        name = shard_name(counts["shards"])
        counts["shards"] += 1
        if writer.has_shard(name):
            counts["shards_reused"] += 1
        else:
            local = os.path.join(writer.local_dir, shard_file(name))
            write_parquet_shard(batch, local)
            writer.commit_shard(name, {shard_file(name): local})
        batch.clear()

    for doc in tqdm(docs, desc="download", unit="doc"):
        batch.append(doc)
        counts["docs"] += 1
        counts["bytes"] += len(doc["text"].encode())
        if len(batch) == params.docs_per_shard:
            flush()
    if batch or counts["shards"] == 0:
        flush()
    seconds = time.time() - started
    log.info(
        "download: %d documents, %.1f MB in %d shards, %.1f s (%.0f docs/s)",
        counts["docs"],
        counts["bytes"] / 1e6,
        counts["shards"],
        seconds,
        counts["docs"] / max(seconds, 1e-9),
    )
    return {
        "counts": {**counts, **stats, **_warc_counts(warc_stats)},
        "throughput": {"docs_per_s": round(counts["docs"] / max(seconds, 1e-9), 1)},
    }


class DownloadStage(Stage):
    name = "download"
    version = "1"
    libraries = ("pyarrow", "datasets", "warcio")
    Params = DownloadParams

    def key_params(self, params: DownloadParams) -> DownloadParams:
        return dataclasses.replace(params, storage_options={})  # credentials never go into keys or manifests

    def key_inputs(self, params: DownloadParams, inputs: Inputs) -> list[str]:
        """The source's current fingerprint: a changed source gets a new key."""
        return [source_description(params)]

    def run(self, params: DownloadParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Read the source named by `params` into Parquet shards (one stream; the stage takes no inputs)."""
        expect_inputs(self, inputs, 0, "no inputs (its source is params.source or params.hf_name)")
        return self.build_artifact(params, inputs, store, lambda writer: _build(params, writer))


STAGE = DownloadStage()
run = STAGE.run
key = STAGE.key
