"""Our checkpoints against Megatron-Core's own model and `dist_checkpointing` (run by
tests/test_convert_torch_dist.py and tests/test_convert_megatron.py in a fresh process, where megatron-core is
installed).

    python -m tests.helpers.megatron_core_interop tied|untied            # torch_dist
    python -m tests.helpers.megatron_core_interop tied|untied legacy     # Megatron-LM's legacy `torch` files
    python -m tests.helpers.megatron_core_interop moe                    # an MoE model: both formats

torch_dist: Megatron-Core's GPTModel (local spec, GQA Llama shape) at TP1 loads what our saver wrote for
TP2 x PP2 with no missing key and the same tensors; its own save has exactly our saver's keys, and our loader
reads it back bitwise. legacy: Megatron-Core's GPTModel takes the state dict of our `megatron` save strictly
(as Megatron-LM's load_checkpoint does) and then computes our model's logits; a file Megatron-LM would write
from its model's state dict loads in our converter to a model with Megatron-Core's logits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

from megatron_train.convert import ModelWeights, torch_dist
from megatron_train.convert.weights import pad_vocab, trim_vocab
from megatron_train.families.gpt import GPT
from megatron_train.models import GPTModel
from tests.helpers.convert_models import VOCAB, ids, our_llama
from tests.helpers.distributed import free_port

# The MoE model both sides build: every layer MoE, 4 experts of top 2, a gated shared expert (Qwen2-MoE's).
MEGATRON_MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True, moe_token_dispatcher_type="allgather",
)  # fmt: skip


def _megatron_core_model(untied: bool, moe: bool = False) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        **(MEGATRON_MOE if moe else {}),
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, normalization="RMSNorm")
    return GPTModel(
        config, spec, vocab_size=128, max_sequence_length=32, position_embedding_type="rope",
        share_embeddings_and_output_weights=not untied,
    )  # fmt: skip


def megatron_lm_args(untied: bool, moe: bool = False) -> argparse.Namespace:
    """The model's flags as Megatron-LM's `args` names them (what its checkpoints carry)."""
    moe_args = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=1,
                    moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                    moe_token_dispatcher_type="allgather", expert_model_parallel_size=1)  # fmt: skip
    return argparse.Namespace(
        num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        ffn_hidden_size=64, swiglu=True, normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        seq_length=32, max_position_embeddings=32, norm_epsilon=1e-5, untie_embeddings_and_output_weights=untied,
        padded_vocab_size=128, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        **(moe_args if moe else {}),
    )  # fmt: skip


@torch.no_grad()
def megatron_core_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    # its attention forks a CUDA RNG stream for dropout (off here); this torch has no CUDA
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    masked = torch.ones(seq, seq).triu(diagonal=1).bool()[None, None]  # True: not attended (Megatron's sense)
    return model.eval()(tokens, positions, masked)[..., :VOCAB]


@torch.no_grad()
def our_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model.eval()(tokens)[..., :VOCAB]


def legacy(untied: bool, root: str, moe: bool = False) -> None:
    from megatron_train.convert import megatron

    config, ours = our_llama(untied, moe=moe)
    tokens = ids()
    expected = our_logits(ours, tokens)
    megatron.save(ModelWeights(config, trim_vocab(ours.state_dict(), VOCAB)), f"{root}/ours", 1, 1)
    (iteration,) = [name for name in os.listdir(f"{root}/ours") if name.startswith("iter_")]
    saved = torch.load(f"{root}/ours/{iteration}/mp_rank_00/model_optim_rng.pt", weights_only=False)
    model = _megatron_core_model(untied, moe)
    result = model.load_state_dict(saved["model"], strict=False)  # Megatron-LM: strict, but TE's extra state
    assert not result.unexpected_keys, result.unexpected_keys
    assert [key for key in result.missing_keys if "_extra_state" not in key] == [], result.missing_keys
    torch.testing.assert_close(megatron_core_logits(model, tokens), expected, rtol=1e-5, atol=1e-5)

    model = _megatron_core_model(
        untied, moe
    )  # new random weights, saved as Megatron-LM's save_checkpoint does
    os.makedirs(f"{root}/megatron/iter_0000007/mp_rank_00")
    state = {"args": megatron_lm_args(untied, moe), "checkpoint_version": 3.0, "iteration": 7,
             "model": model.state_dict_for_save_checkpoint()}  # fmt: skip
    torch.save(state, f"{root}/megatron/iter_0000007/mp_rank_00/model_optim_rng.pt")
    with open(f"{root}/megatron/latest_checkpointed_iteration.txt", "w") as handle:
        handle.write("7")
    weights = megatron.load(f"{root}/megatron", None, VOCAB, GPT)
    loaded = GPTModel(weights.config.model, 128).eval()
    loaded.load_state_dict(pad_vocab(weights.tensors, 128), strict=True)
    torch.testing.assert_close(
        our_logits(loaded, tokens), megatron_core_logits(model, tokens), rtol=1e-5, atol=1e-5
    )
    print(f"megatron-core interop ok: legacy, {len(weights.tensors)} tensors, equal logits both ways")


def torch_dist_interop(untied: bool, root: str, moe: bool = False) -> None:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    config, ours = our_llama(untied, moe=moe)
    tokens = ids()
    # saved as TP2 x PP2 ranks write it (fc1 in strided chunks), loaded by Megatron-Core at TP1
    torch_dist.save(ModelWeights(config, trim_vocab(ours.state_dict(), VOCAB)), f"{root}/ours", 2, 2)
    model = _megatron_core_model(untied, moe)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), f"{root}/ours/iter_0000001")
    result = model.load_state_dict(
        {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, strict=False
    )
    assert [key for key in result.missing_keys if "_extra_state" not in key] == [], result.missing_keys
    theirs = model.state_dict()
    for (
        name,
        tensor,
    ) in ours.state_dict().items():  # rows past the true vocabulary are padding; experts: logits
        assert name not in theirs or torch.equal(tensor[:VOCAB], theirs[name][:VOCAB]), name
    torch.testing.assert_close(
        megatron_core_logits(model, tokens), our_logits(ours, tokens), rtol=1e-5, atol=1e-5
    )

    model = _megatron_core_model(untied, moe)
    os.makedirs(f"{root}/megatron/iter_0000007")
    state = {"model": model.sharded_state_dict(), "args": megatron_lm_args(untied, moe), "iteration": 7,
             "checkpoint_version": 3.0}  # fmt: skip
    dist_checkpointing.save(state, f"{root}/megatron/iter_0000007")
    with open(f"{root}/megatron/latest_checkpointed_iteration.txt", "w") as handle:
        handle.write("7")
    keys = [FileSystemReader(f"{root}/{name}").read_metadata().state_dict_metadata for name in
            ("megatron/iter_0000007", "ours/iter_0000001")]  # fmt: skip
    assert sorted(keys[0]) == sorted(keys[1]), set(keys[0]) ^ set(keys[1])
    weights = torch_dist.load(f"{root}/megatron", None, 128, GPT)
    saved = model.state_dict()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in weights.tensors.items() if name in saved)
    loaded = GPTModel(weights.config.model, 128).eval()
    loaded.load_state_dict(weights.tensors, strict=True)
    torch.testing.assert_close(
        our_logits(loaded, tokens), megatron_core_logits(model, tokens), rtol=1e-5, atol=1e-5
    )
    print(f"megatron-core interop ok: {len(weights.tensors)} tensors{', MoE' if moe else ''}")


def routing_interop() -> None:
    """Our routing functions against Megatron-Core's moe_utils on the same logits: top k of softmax scores (and
    pre-softmax, scaled, group-limited), sigmoid with an expert bias, Sinkhorn, token dropping at capacity, the
    aux and z losses."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_train.models.moe.aux_losses import switch_load_balancing_loss, z_loss
    from megatron_train.models.moe.routing import drop_tokens, sinkhorn, topk_routing

    torch.manual_seed(5)
    logits, bias = torch.randn(32, 8), torch.randn(8) * 0.1
    for options in (
        {}, {"use_pre_softmax": True}, {"scaling_factor": 2.5}, {"num_groups": 4, "group_topk": 2},
        {"score_function": "sigmoid", "expert_bias": bias},
    ):  # fmt: skip
        theirs = moe_utils.topk_routing_with_score_function(logits, 4, **options)
        ours = topk_routing(
            logits, 4, options.get("score_function", "softmax"), options.get("use_pre_softmax", False),
            options.get("num_groups"), options.get("group_topk"), options.get("scaling_factor"),
            options.get("expert_bias"),
        )  # fmt: skip
        torch.testing.assert_close(ours, theirs, msg=str(options))
    torch.testing.assert_close(sinkhorn(logits), moe_utils.sinkhorn(logits))
    probs, routing_map = topk_routing(logits, 2)
    torch.testing.assert_close(
        drop_tokens(probs, routing_map, 2, 1.0),
        moe_utils.apply_router_token_dropping(probs, routing_map, 2, 1.0),
    )
    scores = torch.softmax(logits, -1)
    counts = routing_map.sum(0).float()
    torch.testing.assert_close(
        switch_load_balancing_loss(scores, counts, 32, 2, 8, 0.01),
        moe_utils.switch_load_balancing_loss_func(scores, counts, 32, 2, 8, 0.01),
    )
    torch.testing.assert_close(z_loss(logits, 0.001), moe_utils.z_loss_func(logits, 0.001))
    print("megatron-core interop ok: routing")


def main(embeddings: str, layout: str) -> None:
    """`embeddings`: tied, untied, or moe (untied, MoE layers: torch_dist, the legacy layout and the routing)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    # Megatron-Core synchronises CUDA around its writes; this torch is CPU-only
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # megatron-core 0.16's router reads it whether or not TE is installed
    parallel_state.initialize_model_parallel(1, 1)
    untied, moe = embeddings != "tied", embeddings == "moe"
    if layout == "torch_dist" or moe:
        torch_dist_interop(untied, tempfile.mkdtemp(), moe)
    if moe or layout == "legacy":
        legacy(untied, tempfile.mkdtemp(), moe)
    if moe:
        routing_interop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "torch_dist")
