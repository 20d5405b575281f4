"""The tokenize stage's settings, shared by the stage, its work planning and its worker processes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import fsspec

from megatron_train.tokenizer import MegatronTokenizer, build_tokenizer
from storage.verify import content_hash

ARTIFACT_PREFIX = "tokens"
PARTIALS_DIR = "partials"
# The summary's counters; sentences, tokens and empty_documents are summed over all --json-keys.
COUNTERS = (
    "documents",
    "sentences",
    "tokens",
    "bytes",
    "skipped_bad_records",
    "invalid_utf8_lines",
    "empty_documents",
)


@dataclass(frozen=True)
class TokenizeParams:
    """The settings of `tools/preprocess_data.py` (same names) plus ours (`skip_bad_records`, `shard_size_mb`,
    `fail_on_empty`: an input without documents is an error rather than a warning); see stages/tokenize.py.

    Only the fields that change the output (`OUTPUT_FIELDS`) and the tokenizer files' hashes enter the
    artifact's key: more workers or other partitions give the same bytes, hence the same artifact.
    """

    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    json_keys: tuple[str, ...] = ("text",)
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    skip_bad_records: bool = False
    workers: int = max(1, os.cpu_count() or 1)
    partitions: int = 1
    shard_size_mb: float = 64.0
    log_interval: int = 1000
    fail_on_empty: bool = False

    OUTPUT_FIELDS: ClassVar[tuple[str, ...]] = (
        "tokenizer_type",
        "vocab_file",
        "merge_file",
        "tokenizer_model",
        "vocab_size",
        "vocab_extra_ids",
        "json_keys",
        "split_sentences",
        "keep_newlines",
        "append_eod",
    )

    def __post_init__(self) -> None:
        # A tuple even when given a list: worker processes cache their tokenizer by (hashable) params.
        object.__setattr__(self, "json_keys", tuple(self.json_keys))

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_name(self, key: str) -> str:
        """Megatron's `<prefix>_<json-key>_<level>` with the artifact's prefix."""
        return f"{ARTIFACT_PREFIX}_{key}_{self.level}"

    def build_tokenizer(self) -> MegatronTokenizer:
        return build_tokenizer(
            self.tokenizer_type,
            vocab_file=local_copy(self.vocab_file),
            merge_file=local_copy(self.merge_file),
            tokenizer_model=local_copy(self.tokenizer_model),
            vocab_size=self.vocab_size,
            vocab_extra_ids=self.vocab_extra_ids,
        )

    def fingerprint_fields(self) -> dict:
        """What the artifact's key depends on: output-changing settings, tokenizer files by content (not
        by path, so the same files elsewhere give the same key)."""
        fields = {name: getattr(self, name) for name in self.OUTPUT_FIELDS}
        for name in ("vocab_file", "merge_file", "tokenizer_model"):
            if fields[name] is not None:
                fields[name] = content_hash(fields[name])
        return fields


def local_copy(path: str | None) -> str | None:
    """A tokenizer file given as an fsspec URL (`s3://.../vocab.json`: what a flow on a cluster passes, so that
    workers on any machine reach it) as a local file, downloaded once per machine to
    `$MEGATRON_FLOW_CACHE/tokenizer-files`; a local path or a name as it is."""
    if path is None or "://" not in path:
        return path
    cache = os.environ.get("MEGATRON_FLOW_CACHE", os.path.expanduser("~/.cache/megatron-flow"))
    return fsspec.open_local(
        f"filecache::{path}", filecache={"cache_storage": os.path.join(cache, "tokenizer-files")}
    )
