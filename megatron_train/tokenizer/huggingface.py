"""HuggingFaceTokenizer: a `tokenizer.json` file (Rust `tokenizers`) or a local Hugging Face tokenizer folder
(`transformers.AutoTokenizer`, local files only: training jobs never download).

As Megatron's wrapper does, `tokenize` adds the tokenizer's own special tokens (e.g. Llama's BOS), `eod` is
the end-of-sequence token and `vocab_size` counts added tokens. Absent special tokens are None, as there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import tokenizers

from megatron_train.tokenizer.base import MegatronTokenizer
from megatron_train.tokenizer.fast import FastTokenizer

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# End-of-sequence tokens of common tokenizers, tried in order when a tokenizer.json comes without a config.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _configured_special_tokens(directory: str) -> dict[str, str]:
    """{"eos_token": ..., "bos_token": ..., "pad_token": ...} from the config files beside a tokenizer.json."""
    found: dict[str, str] = {}
    for name in CONFIG_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        for role in ("eos_token", "bos_token", "pad_token"):
            token = _token_content(config.get(role))
            if token is not None:
                found.setdefault(role, token)
    return found


class HuggingFaceTokenizerFile(FastTokenizer):
    """A `tokenizer.json`; special tokens from a tokenizer_config.json beside it, or known EOS names."""

    def __init__(self, tokenizer_file: str):
        try:
            tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
        except Exception as err:  # the Rust binding raises a bare Exception describing the parse error
            raise ValueError(
                f"--tokenizer-model {tokenizer_file}: not a Hugging Face tokenizer.json ({err})"
            ) from err
        # A saved tokenizer.json may carry truncation or padding settings; transformers ignores them unless
        # asked, and so do we: documents are never cut.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        super().__init__(tokenizer, add_special_tokens=True)
        special = _configured_special_tokens(os.path.dirname(os.path.abspath(tokenizer_file)))
        if "eos_token" not in special:
            added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
            eos = next((token for token in KNOWN_EOS_TOKENS if token in added), None)
            if eos is not None:
                special["eos_token"] = eos
        self._special_ids = {role: tokenizer.token_to_id(token) for role, token in special.items()}

    @property
    def eod(self) -> int | None:
        return self._special_ids.get("eos_token")

    @property
    def eos(self) -> int | None:
        return self.eod

    @property
    def bos(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def pad(self) -> int | None:
        return self._special_ids.get("pad_token")


class HuggingFaceAutoTokenizer(MegatronTokenizer):
    """A local tokenizer folder loaded with `transformers.AutoTokenizer` (fast ones encode batches in Rust)."""

    def __init__(self, directory: str):
        try:
            import transformers
        except ImportError as err:
            raise ImportError(
                f"--tokenizer-model {directory} is a folder, which needs the transformers package: "
                "pip install transformers (or pass the folder's tokenizer.json file instead)"
            ) from err
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"--tokenizer-model {directory}: not a loadable tokenizer folder ({err})"
            ) from err

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab()

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        return {token_id: token for token, token_id in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer(text).input_ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tokenizer(list(texts)).input_ids

    def tokenize_without_special_tokens(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False).input_ids

    @property
    def chat_template(self) -> str | None:
        template = self._tokenizer.chat_template
        return template if isinstance(template, str) else None

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

    @property
    def eod(self) -> int | None:
        return self._tokenizer.eos_token_id

    @property
    def eos(self) -> int | None:
        return self._tokenizer.eos_token_id

    @property
    def bos(self) -> int | None:
        return self._tokenizer.bos_token_id

    @property
    def pad(self) -> int | None:
        return self._tokenizer.pad_token_id


def load_huggingface_tokenizer(path: str) -> MegatronTokenizer:
    """`--tokenizer-model` for HuggingFaceTokenizer: a tokenizer.json file or a local tokenizer folder."""
    if os.path.isdir(path):
        return HuggingFaceAutoTokenizer(path)
    if os.path.isfile(path):
        return HuggingFaceTokenizerFile(path)
    raise FileNotFoundError(
        f"--tokenizer-model {path}: no such file or folder; HuggingFaceTokenizer needs a tokenizer.json file or "
        "a local tokenizer folder (models are never downloaded at run time: fetch it first, e.g. with "
        "`huggingface-cli download <name> --local-dir <folder>`)"
    )
