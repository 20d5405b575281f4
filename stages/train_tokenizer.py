"""Train-tokenizer stage: a byte-level BPE (GPT-2 style) or WordPiece (BERT) vocabulary from document shards.

Input: one artifact of Parquet document shards (`shards/*.parquet`, columns `id`, `text`). The text column
is streamed in record batches, shard by shard in name order, into the trainer, so memory stays bounded and
the same input gives the same files. Output: the tokenizer files and a manifest with the vocabulary size,
the documents read and the `--tokenizer-type` to use them with; `load_trained_tokenizer` builds it.
Training is one indivisible unit of work: a rerun after a crash trains again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from tqdm import tqdm

from megatron_train.tokenizer import MegatronTokenizer, build_tokenizer
from megatron_train.tokenizer.train import train_byte_level_bpe, train_wordpiece
from stages.base import Inputs, Stage, expect_inputs
from stages.shards import document_shards, shard_file
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.documents import iter_records

# Per kind: default vocabulary size, default special tokens.
_DEFAULTS = {
    "bpe": (32000, ("<|endoftext|>",)),
    "wordpiece": (30522, ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")),
}


@dataclass(frozen=True)
class TrainTokenizerParams:
    """What to train. `vocab_size` and `special_tokens` left as None take the kind's defaults (BPE: 32000,
    <|endoftext|>; WordPiece: 30522, BERT's five); `lowercase` applies to WordPiece only."""

    kind: Literal["bpe", "wordpiece"] = "bpe"
    vocab_size: int | None = None
    special_tokens: tuple[str, ...] | None = None
    min_frequency: int = 2
    lowercase: bool = True
    text_key: str = "text"
    max_documents: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _DEFAULTS:
            raise ValueError(f"kind must be one of {', '.join(_DEFAULTS)}, got {self.kind!r}")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(f"max_documents must be at least 1 (or None for all), got {self.max_documents}")
        vocab_size, special_tokens = _DEFAULTS[self.kind]
        # Resolved here, so that equal settings give equal artifact keys whether defaulted or spelled out.
        object.__setattr__(self, "vocab_size", self.vocab_size or vocab_size)
        object.__setattr__(self, "special_tokens", tuple(self.special_tokens or special_tokens))


def iter_texts(
    ref: ArtifactRef, text_key: str, counts: dict[str, int], limit: int | None = None
) -> Iterator[str]:
    """The texts of an artifact's document shards in shard order, at most `limit`; counts documents and
    characters as they are read."""
    for name in document_shards(ref):
        url = ref.file_url(shard_file(name))
        records = iter_records(
            url, text_keys=(text_key,), key_flag="text_key", columns=(text_key,), **ref.storage_options
        )
        for text in (record.data[text_key] for record in records):
            if limit is not None and counts["documents"] >= limit:
                return
            counts["documents"] += 1
            counts["characters"] += len(text)
            yield text


def _build(params: TrainTokenizerParams, source: ArtifactRef, writer: ArtifactWriter) -> dict:
    counts = {"documents": 0, "characters": 0}
    texts = tqdm(
        iter_texts(source, params.text_key, counts, params.max_documents), desc="train_tokenizer", unit="doc"
    )
    out_dir = os.path.join(writer.local_dir, "tokenizer")
    started = time.perf_counter()
    if params.kind == "bpe":
        files = train_byte_level_bpe(
            texts, out_dir, params.vocab_size, params.special_tokens, params.min_frequency
        )
        tokenizer_type = (
            "GPT2BPETokenizer" if "<|endoftext|>" in params.special_tokens else "HuggingFaceTokenizer"
        )
    else:
        files = train_wordpiece(
            texts, out_dir, params.vocab_size, params.lowercase, params.special_tokens, params.min_frequency
        )
        tokenizer_type = "BertWordPieceLowerCase" if params.lowercase else "BertWordPieceCase"
    seconds = time.perf_counter() - started
    if counts["documents"] == 0:
        raise ValueError(f"{source.url}: no documents to train a tokenizer on")
    tokenizer = {"tokenizer_type": tokenizer_type, **{role: os.path.basename(p) for role, p in files.items()}}
    # Loaded before the files move into the artifact: a check that they work, and Megatron's vocab size.
    vocab_size = load_tokenizer_files(tokenizer, lambda name: os.path.join(out_dir, name)).vocab_size
    for path in files.values():
        writer.put_file(path, os.path.basename(path))
    return {
        "counts": {**counts, "vocab_size": vocab_size},
        "tokenizer": tokenizer,
        "throughput": {"characters_per_s": round(counts["characters"] / max(seconds, 1e-9), 1)},
    }


def load_tokenizer_files(tokenizer: dict[str, str], path_of: Callable[[str], str]) -> MegatronTokenizer:
    """Build the tokenizer a manifest's "tokenizer" entry describes; `path_of` maps file names to paths."""
    tokenizer_type = tokenizer["tokenizer_type"]
    if tokenizer_type == "HuggingFaceTokenizer":
        return build_tokenizer(tokenizer_type, tokenizer_model=path_of(tokenizer["tokenizer_json"]))
    merge_file = tokenizer.get("merge_file")
    return build_tokenizer(
        tokenizer_type,
        vocab_file=path_of(tokenizer["vocab_file"]),
        merge_file=None if merge_file is None else path_of(merge_file),
    )


def load_trained_tokenizer(ref: ArtifactRef) -> MegatronTokenizer:
    """The tokenizer of a train_tokenizer artifact (files fetched to a local cache on remote stores)."""
    return load_tokenizer_files(ref.manifest()["tokenizer"], ref.local_path)


class TrainTokenizerStage(Stage):
    name = "train_tokenizer"
    version = "1"
    libraries = ("tokenizers",)
    Params = TrainTokenizerParams

    def run(self, params: TrainTokenizerParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Train a tokenizer on the documents of `inputs[0]` (an artifact of Parquet document shards)."""
        (source,) = expect_inputs(self, inputs, 1, "exactly one input: an artifact of document shards")
        if not isinstance(source, ArtifactRef):
            raise ValueError(f"the {self.name} stage takes an artifact of document shards, got {source!r}")
        return self.build_artifact(params, [source], store, lambda writer: _build(params, source, writer))


STAGE = TrainTokenizerStage()
run = STAGE.run
key = STAGE.key
