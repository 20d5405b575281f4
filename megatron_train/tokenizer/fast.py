"""The common base of tokenizers that run on Hugging Face `tokenizers` (Rust): batches encode in parallel."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import tokenizers

from megatron_train.tokenizer.base import MegatronTokenizer, checked_ids


class FastTokenizer(MegatronTokenizer):
    """A MegatronTokenizer over a `tokenizers.Tokenizer`.

    `add_special_tokens` says whether encoding runs the tokenizer's post-processor (e.g. a BOS token in
    front): Megatron's Hugging Face wrapper does, its GPT-2 and BERT tokenizers have none.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, add_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying Rust tokenizer (for tools that want offsets or alignments)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        return {token_id: token for token, token_id in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._add_special_tokens).ids

    def tokenize_without_special_tokens(self, text: str) -> list[int]:
        if not self._add_special_tokens:
            return self.tokenize(text)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=self._add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(checked_ids(ids, self.vocab_size), skip_special_tokens=False)
