"""NullTokenizer: the text already is token ids, written as whitespace-separated integers.

For benchmarks and synthetic data without a vocabulary. As in Megatron, `--vocab-size V` gives ids 0..V-1
for text and `eod` = V, so `vocab_size` (which includes eod) is V + 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_train.tokenizer.base import NO_SUCH_TOKEN, MegatronTokenizer, stored_id


class NullTokenizer(MegatronTokenizer):
    """Megatron's `--tokenizer-type NullTokenizer`."""

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError("NullTokenizer has no vocabulary: its text is the ids themselves")

    @property
    def inv_vocab(self) -> dict[int, str]:
        raise NotImplementedError("NullTokenizer has no vocabulary: its text is the ids themselves")

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(word) for word in text.split()]
        except ValueError as err:
            raise ValueError(
                f"NullTokenizer expects whitespace-separated integers, got {text[:80]!r}"
            ) from err

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)

    cls = sep = mask = NO_SUCH_TOKEN

    eod = stored_id("_eod")
    eos = stored_id("_eod")
