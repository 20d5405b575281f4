"""A character tokenizer and a tiny GPT (with a checkpoint of it) for the generation, server and evaluation tests;
`one_torch_thread` is a module-scoped autouse fixture a test module takes in by importing it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TrainingProgress, save_checkpoint
from megatron_train.data.config import DataConfig
from megatron_train.models.gpt import GPTModel
from megatron_train.tokenizer.base import MegatronTokenizer
from megatron_train.training.config import CheckpointConfig, TokenizerConfig
from tests.helpers.tiny import tiny_config


class CharTokenizer(MegatronTokenizer):
    """One id per character, plus "\\n\\n" as one token (as GPT-2 has) and eod = 0."""

    SYMBOLS = ["<eod>", "\n\n", "\n", " ", ":", ".", ",", "!", "?", "'"] + [chr(c) for c in range(97, 123)]
    SYMBOLS += [chr(c) for c in range(65, 91)] + [str(d) for d in range(10)] + list('=-()";@')

    @property
    def vocab_size(self) -> int:
        return len(self.SYMBOLS)

    @property
    def vocab(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self.SYMBOLS)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return dict(enumerate(self.SYMBOLS))

    @property
    def eod(self) -> int:
        return 0

    def tokenize(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            step = 2 if text.startswith("\n\n", i) else 1
            ids.append(self.vocab[text[i : i + step]])
            i += step
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(self.SYMBOLS[i] for i in ids)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread; on a shared 2-core machine more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_tiny_gpt(seed: int = 0, max_position_embeddings: int = 64) -> GPTModel:
    """A 2-layer GPTModel with a padded vocabulary (128 > the tokenizer's 79), in eval mode."""
    torch.manual_seed(seed)
    config = tiny_config(
        seq_length=max_position_embeddings,
        max_position_embeddings=max_position_embeddings,
        init_method_std=0.2,
    )
    return GPTModel(config, vocab_size=128).eval()


def save_tiny_checkpoint(directory: str, model: torch.nn.Module | None = None) -> str:
    """A real checkpoint of `model` (default build_tiny_gpt(); padded vocabulary 128) whose recorded tokenizer
    is NullTokenizer(vocab_size=100)."""
    model = build_tiny_gpt() if model is None else model
    config = MegatronConfig(
        model=model.config,
        data=DataConfig(),
        checkpoint=CheckpointConfig(save=directory),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100),
    )
    save_checkpoint(1, model, None, None, TrainingProgress(), config, padded_vocab_size=128)
    return directory
