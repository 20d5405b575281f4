"""The tokenizer interface every model, dataset and tool codes against (Megatron's MegatronTokenizer).

Special-token properties follow Megatron: a tokenizer that has no such token raises NotImplementedError
(Megatron's abstract base does the same), except where Megatron's own class returns -1 or None.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence


def _absent(name: str) -> property:
    def getter(self: MegatronTokenizer) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no {name} token")

    return property(getter, doc=f"Id of the {name} token.")


def stored_id(attribute: str) -> property:
    """A special-token property returning `self.<attribute>`, which the tokenizer sets when it loads."""
    return property(lambda self: getattr(self, attribute), doc=f"Id of the token in `{attribute}`.")


NO_SUCH_TOKEN = property(lambda self: -1, doc="-1: the tokenizer has no such token (Megatron's convention).")


class MegatronTokenizer(abc.ABC):
    """Text <-> token ids, with the vocabulary and the special ids Megatron's models and datasets use."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, before padding (see `vocab_size_with_padding`)."""

    @property
    @abc.abstractmethod
    def vocab(self) -> dict[str, int]:
        """Token string -> id."""

    @property
    @abc.abstractmethod
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token string."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The ids of one text."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of many texts; where the backend can, the batch is encoded in parallel (Rust, C++)."""
        return [self.tokenize(text) for text in texts]

    def tokenize_without_special_tokens(self, text: str) -> list[int]:
        """The ids of a text without the tokens the tokenizer adds around it (Llama's BOS): a chat template
        writes its special tokens itself. Tokenizers that add none use `tokenize`."""
        return self.tokenize(text)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template the tokenizer's files carry, None when they carry none."""
        return None

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of a sequence of ids."""

    eod = _absent("end-of-document")
    cls = _absent("[CLS]")
    sep = _absent("[SEP]")
    mask = _absent("[MASK]")
    pad = _absent("padding")
    bos = _absent("beginning-of-sequence")
    eos = _absent("end-of-sequence")


def lookup_token(vocab: dict[str, int], token: str, source: str, fix: str) -> int:
    """The id of a token the tokenizer type requires, or an error naming the vocabulary file."""
    if token not in vocab:
        raise ValueError(f"{source}: the vocabulary has no {token!r} token; {fix}")
    return vocab[token]


def require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    """`path` if it is an existing file, else an error naming the flag, the path and the tokenizer type."""
    if path is None:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (needed by {tokenizer_type})")
    return path


def checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` as Python ints (from lists, NumPy arrays or tensors), or an error naming those outside the
    vocabulary, e.g. ids of the padded embedding rows a model should never sample."""
    ids = [int(i) for i in ids]
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"ids {outside[:5]} are outside the vocabulary (size {vocab_size})")
    return ids
