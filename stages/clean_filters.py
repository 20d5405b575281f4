"""The clean stage's URL blocklist and decontamination n-gram index: built once, stored in the artifact.

The flow's process reads the user's files (blocklists, evaluation sets) and commits what the shard tasks need as
files of the clean artifact, `filters/url_blocklist.json` and `filters/decontamination*` (one unit of work
named `filters`, so a rerun does not rebuild it). A shard task loads them from the store once per process, so
workers on other machines need neither the user's files nor a copy of a large list in every task's arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from stages.decontaminate import NgramIndex, reason_names
from stages.shards import read_committed_json, read_committed_npy, write_json
from stages.url_filter import UrlBlocklist, read_blocklists
from storage.artifacts import ArtifactWriter

FILTERS_SHARD = "filters"
BLOCKLIST_FILE = "filters/url_blocklist.json"
DECONTAMINATION_FILE = "filters/decontamination.json"  # n, the evaluation files and their reasons
NGRAM_KEYS_FILE = "filters/decontamination_keys.npy"  # uint64 n-gram keys, sorted
NGRAM_FILES_FILE = "filters/decontamination_files.npy"  # int32: the first file holding each n-gram


@dataclass(frozen=True)
class CleanFilters:
    """What the URL filter and the decontamination step of one clean artifact match against."""

    blocklist: UrlBlocklist | None
    index: NgramIndex | None
    reasons: tuple[str, ...]  # the decontamination reason of each evaluation file, in the order given


def commit_filters(
    writer: ArtifactWriter,
    url_blocklist: tuple[str, ...],
    url_banned_words: tuple[str, ...],
    decontaminate: tuple[str, ...],
    ngram: int,
) -> None:
    """Build the blocklist and the n-gram index from the user's files and commit them (once per artifact)."""
    if not (url_blocklist or url_banned_words or decontaminate) or writer.has_shard(FILTERS_SHARD):
        return
    files = {}
    scratch = os.path.join(writer.local_dir, FILTERS_SHARD)
    if url_blocklist or url_banned_words:
        blocklist = read_blocklists(url_blocklist, url_banned_words, "--clean.url-blocklist")
        files[BLOCKLIST_FILE] = write_json(blocklist.to_json(), os.path.join(scratch, "url_blocklist.json"))
    if decontaminate:
        reasons = reason_names(decontaminate, "--clean.decontaminate")
        index = NgramIndex.build(decontaminate, ngram)
        described = {"n": index.n, "files": list(decontaminate), "reasons": reasons}
        files[DECONTAMINATION_FILE] = write_json(described, os.path.join(scratch, "decontamination.json"))
        for name, array in ((NGRAM_KEYS_FILE, index.keys), (NGRAM_FILES_FILE, index.files)):
            files[name] = os.path.join(scratch, os.path.basename(name))
            np.save(files[name], array)
    writer.commit_shard(FILTERS_SHARD, files)


_loaded: dict[str, CleanFilters] = {}


def load_filters(writer: ArtifactWriter) -> CleanFilters:
    """The filters committed into `writer`'s artifact (none when it has none), read once per process."""
    if writer.url not in _loaded:
        blocklist, index, reasons = None, None, ()
        if writer.has_file(BLOCKLIST_FILE):
            blocklist = UrlBlocklist.from_json(read_committed_json(writer, BLOCKLIST_FILE))
        if writer.has_file(DECONTAMINATION_FILE):
            described = read_committed_json(writer, DECONTAMINATION_FILE)
            keys, files = (read_committed_npy(writer, name) for name in (NGRAM_KEYS_FILE, NGRAM_FILES_FILE))
            index = NgramIndex(described["n"], keys, files)
            reasons = tuple(described["reasons"])
        _loaded[writer.url] = CleanFilters(blocklist, index, reasons)
    return _loaded[writer.url]
