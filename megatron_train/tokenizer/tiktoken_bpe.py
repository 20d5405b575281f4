"""TikTokenizer: Megatron's `--tokenizer-type TikTokenizer`, byte-level BPE run by OpenAI's `tiktoken`.

The vocabulary is Megatron's JSON file (`--tokenizer-model`): a list of `{"rank": i, "token_bytes": base64,
"token_str": str}` in rank order, the first 256 being the single bytes. The first `--tiktoken-num-special-tokens`
ids (default 1000) are special tokens — `<unk> <s> </s> <mask> <pad> <cls> <sep>` then `<SPECIAL_7>`, ... — and
BPE rank r gets id r + that number, as in Megatron-Core's TikTokenTokenizer. `--tiktoken-pattern` picks the
pre-tokenisation regex: v1 (letters, digits, punctuation runs) or v2 (also splits at case changes, cl100k style).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence

from megatron_train.tokenizer.base import MegatronTokenizer, stored_id

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


def read_tiktoken_vocab(path: str, max_entries: int | None = None) -> dict[bytes, int]:
    """Megatron's `reload_mergeable_ranks` without the shift: token bytes -> BPE rank, checked record by record."""
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--tokenizer-model {path}: not a TikTokenizer JSON vocabulary ({error})") from error
    if not isinstance(entries, list):
        raise ValueError(
            f"--tokenizer-model {path}: expected a JSON list of {{rank, token_bytes, token_str}} records"
        )
    ranks: dict[bytes, int] = {}
    for index, entry in enumerate(entries[:max_entries]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            raise ValueError(
                f"--tokenizer-model {path}: record {index} is not {{rank, token_bytes, token_str}}"
            )
        token = base64.b64decode(entry["token_bytes"])
        if entry["rank"] != index or (index < 256 and token != bytes([index])) or token in ranks:
            raise ValueError(
                f"--tokenizer-model {path}: record {index} has rank {entry['rank']} and bytes {token!r}; ranks "
                "must be 0, 1, ... in order, the first 256 the single bytes, every token once"
            )
        ranks[token] = index
    return ranks


class TikTokenizer(MegatronTokenizer):
    """Megatron's TikTokenizer; `vocab_size` (--vocab-size) keeps the first vocab_size - num_special_tokens BPE
    tokens (default: all of them)."""

    def __init__(
        self,
        path: str,
        pattern: str | None,
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
    ) -> None:
        import tiktoken

        if pattern not in PATTERNS:
            raise ValueError(f"TikTokenizer needs --tiktoken-pattern v1 or v2, got {pattern}")
        if num_special_tokens < len(SPECIAL_TOKENS):
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens}: TikTokenizer needs at least "
                f"{len(SPECIAL_TOKENS)} ({' '.join(SPECIAL_TOKENS)})"
            )
        max_entries = None if vocab_size is None else vocab_size - num_special_tokens
        ranks = read_tiktoken_vocab(path, max_entries)
        if max_entries is not None and len(ranks) < max_entries:
            raise ValueError(
                f"--vocab-size {vocab_size} needs {max_entries} BPE tokens after {num_special_tokens} special "
                f"ones, but --tokenizer-model {path} has {len(ranks)}; lower --vocab-size or drop it"
            )
        specials = [
            *SPECIAL_TOKENS,
            *(f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)),
        ]
        self.special_ids = {token: i for i, token in enumerate(specials)}
        self.encoding = tiktoken.Encoding(
            name=f"megatron-tiktoken-{pattern}",
            pat_str=PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=self.special_ids,
        )
        self._vocab_size = num_special_tokens + len(ranks)
        self._vocab = self.special_ids | {
            token.decode("utf-8", errors="replace"): rank + num_special_tokens
            for token, rank in ranks.items()
        }
        self._eod = self.special_ids["</s>"]
        self._bos = self.special_ids["<s>"]
        self._mask = self.special_ids["<mask>"]
        self._pad = self.special_ids["<pad>"]
        self._cls = self.special_ids["<cls>"]
        self._sep = self.special_ids["<sep>"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: token for token, i in self._vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        """As Megatron-Core's `text_to_ids`: special-token text (e.g. "</s>") becomes its special id."""
        return self.encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    eod = stored_id("_eod")
    eos = stored_id("_eod")
    bos = stored_id("_bos")
    mask = stored_id("_mask")
    pad = stored_id("_pad")
    cls = stored_id("_cls")
    sep = stored_id("_sep")
