"""Sharded initialization, measured: building rank 0 of a TP=4 layout raises the process's peak memory by about a
quarter of what one process's build does, for a GPT whose weights dominate it (each rank draws only its shards on
the meta device's materialisation); a hybrid Mamba model builds on the meta device too, every parameter drawn; an
MoE model's EP ranks each draw only their own experts, from streams of their own."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hybrid import MambaModel
from megatron_train.parallel.param_init import materialize
from tests.helpers.training import ROOT

# rank 0 of a TP-way job (torch's fake process group, as the planner builds ranks): its build's growth of the peak
# resident memory (Linux's VmHWM, reset before the build) and the bytes its parameters hold, in KiB
BUILD = """
import sys, torch
from megatron_train.arguments import parse_args
from megatron_train.families.gpt import GPT
from megatron_train.tools.report_theoretical_memory import padded_vocab
from megatron_train.training.memory_plan import planned_rank
from megatron_train.training.setup import build_model_chunks
tp = int(sys.argv[1])
config = parse_args(sys.argv[2:] + ["--tensor-model-parallel-size", str(tp)], tp)
def status_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as clear:  # the peak so far (imports) forgotten: VmHWM = VmRSS
    clear.write("5")
before = status_kib("VmRSS")
with planned_rank(config, tp, 0):
    chunks = build_model_chunks(config, GPT.model_provider, padded_vocab(config), torch.device("cpu"))
    held = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
print(status_kib("VmHWM") - before, held // 1024)
"""
# about 115 M parameters (460 MB in fp32), nearly all of them split over TP
MODEL = [
    "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "4096",
    "--seq-length", "128", "--max-position-embeddings", "128", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "65535", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
    "--lr", "1e-4",
]  # fmt: skip


def _build_peak_kib(tp: int) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(tp), *MODEL], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grown, held = map(int, done.stdout.split()[-2:])
    return grown, held


@pytest.mark.processes
def test_a_tp4_rank_builds_in_about_a_quarter_of_one_processs_peak_memory() -> None:
    one_grown, one_held = _build_peak_kib(1)
    tp4_grown, tp4_held = _build_peak_kib(4)
    assert one_grown > 0.9 * one_held  # the measure sees the weights
    assert 0.24 < tp4_held / one_held < 0.27  # a quarter, plus the replicated norms and biases
    assert tp4_grown < 0.35 * one_grown, (tp4_grown, one_grown)


def test_a_hybrid_model_built_on_the_meta_device_draws_every_parameter() -> None:
    config = TransformerConfig(
        hidden_size=32, num_attention_heads=4, seq_length=64, hybrid_layer_pattern="M*M-", mamba_state_dim=8,
        mamba_head_dim=8, mamba_num_groups=2, position_embedding_type="none", normalization="RMSNorm",
    )  # fmt: skip
    with torch.device("meta"):
        model = MambaModel(config, 64)
    model = materialize(model, torch.device("cpu"))
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    assert all(torch.isfinite(p).all() for p in params.values())
    a_log = params["decoder.layers.0.mixer.A_log"]
    assert math.log(1.0) <= a_log.min() and a_log.max() <= math.log(16.0)
    assert torch.equal(params["decoder.layers.0.mixer.D"], torch.ones_like(a_log))
    assert params["decoder.layers.0.mixer.conv1d.weight"].std() > 0


def _moe_rank(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of an EP 2 job (torch's fake process group) built on the meta device and materialised."""
    from megatron_train.arguments import parse_args
    from megatron_train.families.gpt import GPT
    from megatron_train.parallel import model_parallel_seed
    from megatron_train.tools.report_theoretical_memory import padded_vocab
    from megatron_train.training.memory_plan import planned_rank
    from megatron_train.training.setup import build_model_chunks

    flags = [*MODEL[MODEL.index("--seq-length") :], "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--vocab-size", "128", "--num-experts", "4", "--moe-ffn-hidden-size",
             "16", "--expert-model-parallel-size", "2", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--global-batch-size", "2"]  # fmt: skip
    config = parse_args(flags, 2)
    with planned_rank(config, 2, rank):
        model_parallel_seed(7)
        (chunk,) = build_model_chunks(config, GPT.model_provider, padded_vocab(config), torch.device("cpu"))
    return {**dict(chunk.named_parameters()), **dict(chunk.named_buffers())}


def test_each_ep_rank_draws_only_its_own_experts_on_the_meta_device() -> None:
    first, second = _moe_rank(0), _moe_rank(1)
    weight1 = "decoder.layers.0.mlp.experts.weight1"
    assert first[weight1].shape == (2, 32, 16)  # 2 of the 4 experts
    assert all(not t.is_meta and torch.isfinite(t).all() for t in first.values())
    assert first[weight1].std() > 0 and not torch.equal(first[weight1], second[weight1])
    # replicated parameters from the default generator: the same on both ranks
    assert torch.equal(
        first["decoder.layers.0.mlp.router.weight"], second["decoder.layers.0.mlp.router.weight"]
    )
    assert torch.equal(first["decoder.layers.0.mlp.router.expert_bias"], torch.zeros(4))
