"""Models and readers shared by the converter tests (tests/test_convert_*.py)."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from megatron_train.arguments import MegatronConfig
from megatron_train.data.config import DataConfig
from megatron_train.models import GPTModel, TransformerConfig

VOCAB = 100  # padded to 128 (TP1) or 256 (TP2) in our checkpoints, cut back to 100 rows in HF folders


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def our_llama(untied: bool) -> tuple[MegatronConfig, GPTModel]:
    model_config = TransformerConfig.llama(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, ffn_hidden_size=64,
        group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=untied,
        true_vocab_size=VOCAB,
    )  # fmt: skip
    torch.manual_seed(7)
    return MegatronConfig(model=model_config, data=DataConfig()), GPTModel(model_config, 128).eval()


def shard_tensors(iteration_dir: str) -> dict[tuple[str, str], torch.Tensor]:
    tensors = {}
    for shard in sorted(os.listdir(iteration_dir)):
        if shard.startswith("mp_rank_"):
            with safe_open(f"{iteration_dir}/{shard}/model.safetensors", framework="pt") as handle:
                tensors |= {(shard, key): handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
                tensors[(shard, "metadata")] = handle.metadata()
    return tensors
