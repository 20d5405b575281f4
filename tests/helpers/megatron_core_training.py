"""Megatron-Core trains the tiny GPT on CPU with its own DDP, optimizer and LR scheduler, saves it as Megatron-LM's
training loop does, then keeps training and records its losses (run by tests/test_megatron_checkpoints.py in a
fresh process, where megatron-core is installed).

    python -m tests.helpers.megatron_core_training ROOT      ROOT/argv.json: our pretrain_gpt flags (--mock-data)

Two runs from the same initial weights, on the micro-batches our pretrain_gpt reads for those flags, each saving at
iteration SAVE_AT in Megatron-LM's legacy files (model_optim_rng.pt: args, model, optimizer and scheduler state) and
in torch_dist (dist_checkpointing's save of the model's and the optimizer's sharded state dicts; args, iteration,
scheduler in the common state):
- Adam without the distributed optimizer: ROOT/torch, ROOT/torch_dist;
- with --use-distributed-optimizer: ROOT/torch_distributed_optimizer (plus distrib_optim.pt),
  ROOT/torch_dist_distributed_optimizer (its fully_reshardable format).
ROOT/reference.json holds each run's losses for iterations SAVE_AT + 1 ... --train-iters.
Megatron-Core's optimizer and DDP allocate on CUDA; `cpu_megatron_core` points them at the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from megatron_train.arguments import parse_args
from megatron_train.checkpointing import TrainingProgress
from megatron_train.families.gpt import datasets_provider
from megatron_train.tokenizer import tokenizer_from_config
from megatron_train.training.entry import padded_vocab_size_for
from megatron_train.training.loop import get_batch
from megatron_train.training.lr_scheduler import build_opt_param_scheduler
from megatron_train.training.setup import build_data_iterators
from tests.helpers.distributed import free_port

SAVE_AT = 2
# How Megatron-LM saves the distributed optimizer into torch_dist with --dist-ckpt-optim-fully-reshardable.
DIST_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class _CudaToCpu(TorchFunctionMode):
    """Tensors Megatron-Core asks for on device='cuda' are made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cpu_megatron_core() -> None:
    """A one-rank gloo group and Megatron-Core's CUDA-only calls made harmless on this CPU-only torch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):  # its optimizer checks params are torch.cuda.*Tensor
        name = tensor_type(self, *args, **kwargs)
        return name if args or kwargs or ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name
    _CudaToCpu().__enter__()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # megatron-core 0.16's router reads it whether or not TE is installed

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def megatron_core_gpt(config, padded_vocab_size: int) -> torch.nn.Module:
    """Megatron-Core's GPTModel (local spec) of our config's shape: GPT-2 style, tied embedding; with
    --num-experts, MoE layers of SequentialMLP experts whose params are marked expert-parallel, as Megatron-Core
    marks them at --expert-model-parallel-size > 1, so its optimizer is a ChainedOptimizer of a dense and an
    expert optimizer (what an EP rank saves; at EP 1 it would chain one)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    model = config.model
    moe = {}
    if model.num_experts:
        moe = dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
                   moe_ffn_hidden_size=model.moe_ffn_hidden_size, moe_token_dispatcher_type="allgather",
                   moe_router_load_balancing_type=model.moe_router_load_balancing_type[0])  # fmt: skip
    torch.manual_seed(1)
    core_config = TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        layernorm_epsilon=model.norm_epsilon, init_method_std=0.2, add_bias_linear=model.add_bias_linear, **moe,
    )  # fmt: skip
    gpt = GPTModel(
        core_config, get_gpt_layer_local_spec(num_experts=model.num_experts), vocab_size=padded_vocab_size,
        max_sequence_length=model.max_position_embeddings, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    )  # fmt: skip
    for name, param in gpt.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False  # ColumnParallelLinear's mark of an expert param at EP > 1
    return gpt


def megatron_lm_args(config, padded_vocab_size: int, distributed_optimizer: bool) -> argparse.Namespace:
    """The args Megatron-LM's pretrain_gpt pickles: the model's and tokenizer's flags, layout, progress."""
    return argparse.Namespace(
        **dataclasses.asdict(config.model), **dataclasses.asdict(config.tokenizer), tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, data_parallel_size=1, padded_vocab_size=padded_vocab_size,
        consumed_train_samples=SAVE_AT * config.training.global_batch_size, consumed_valid_samples=0,
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=False, iteration=SAVE_AT,
        ckpt_format="torch",
    )  # fmt: skip


def adam_moments(model: torch.nn.Module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each param's Adam moments by Megatron-Core's name, read from its own optimizers (the test checks where our
    loader puts them)."""
    moments = {}
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for name, param in model.named_parameters():
            if hasattr(
                chained, "model_param_group_index_map"
            ):  # the distributed optimizer (DP 1: whole params)
                if param in chained.model_param_group_index_map:
                    state = chained._get_main_param_and_optimizer_states(param)
                    moments[name] = {
                        key: state[key].view(param.shape).clone() for key in ("exp_avg", "exp_avg_sq")
                    }
            elif param in chained.optimizer.state:
                moments[name] = {
                    key: chained.optimizer.state[param][key].clone() for key in ("exp_avg", "exp_avg_sq")
                }
    return moments


def train(root: str, argv: list[str], distributed_optimizer: bool) -> list[float]:
    """Train to --train-iters, saving at SAVE_AT; the losses after the save."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = parse_args(argv)
    tokenizer = tokenizer_from_config(config.tokenizer)
    padded = padded_vocab_size_for(config, tokenizer)
    model = megatron_core_gpt(config, padded)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer), model
    )
    opt = config.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )  # fmt: skip
    ours = build_opt_param_scheduler(
        torch.optim.SGD([torch.zeros(1)]),
        opt,
        config.training.train_iters,
        None,
        config.training.global_batch_size,
    ).state_dict()  # what our run computes from the flags, which a loaded scheduler must match
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=opt.lr_warmup_init, max_lr=ours["max_lr"], min_lr=ours["min_lr"],
        lr_warmup_steps=ours["lr_warmup_steps"], lr_decay_steps=ours["lr_decay_steps"],
        lr_decay_style=ours["lr_decay_style"], start_wd=ours["start_wd"], end_wd=ours["end_wd"],
        wd_incr_steps=ours["wd_incr_steps"], wd_incr_style=ours["wd_incr_style"],
    )  # fmt: skip
    train_iterators, _, _ = build_data_iterators(
        config, lambda samples: datasets_provider(config, tokenizer, samples), config.training.train_iters,
        TrainingProgress(),
    )  # fmt: skip
    micro_batches = config.training.global_batch_size // config.training.micro_batch_size
    seq = config.model.seq_length
    causal = torch.ones(seq, seq).triu(diagonal=1).bool()[None, None]  # True: not attended (Megatron's sense)
    losses = []
    for iteration in range(1, config.training.train_iters + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        total = 0.0
        for _ in range(micro_batches):
            batch = get_batch(train_iterators[0], torch.device("cpu"))
            per_token = ddp(batch["tokens"], batch["position_ids"], causal, labels=batch["labels"])
            loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(increment=config.training.global_batch_size)
        if iteration > SAVE_AT:
            losses.append(total)
        if iteration == SAVE_AT:
            args = megatron_lm_args(config, padded, distributed_optimizer)
            legacy = os.path.join(root, "torch_distributed_optimizer" if distributed_optimizer else "torch")
            rank_dir = os.path.join(legacy, f"iter_{SAVE_AT:07d}", "mp_rank_00")
            os.makedirs(rank_dir)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": SAVE_AT,
                        "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                        "opt_param_scheduler": scheduler.state_dict()},
                       os.path.join(rank_dir, "model_optim_rng.pt"))  # fmt: skip
            if distributed_optimizer:
                optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
            dist_root = os.path.join(
                root, "torch_dist_distributed_optimizer" if distributed_optimizer else "torch_dist"
            )
            model_state = model.sharded_state_dict()
            state = {"model": model_state, "args": args, "iteration": SAVE_AT, "checkpoint_version": 3.0,
                     "opt_param_scheduler": scheduler.state_dict(),
                     "optimizer": optimizer.sharded_state_dict(model_state, metadata=DIST_OPTIMIZER_FORMAT)}  # fmt: skip
            os.makedirs(os.path.join(dist_root, f"iter_{SAVE_AT:07d}"))
            dist_checkpointing.save(state, os.path.join(dist_root, f"iter_{SAVE_AT:07d}"))
            torch.save(adam_moments(model, optimizer), os.path.join(legacy, "moments.pt"))
            for folder in (legacy, dist_root):
                with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
                    handle.write(str(SAVE_AT))
    return losses


def main(root: str) -> None:
    cpu_megatron_core()
    with open(os.path.join(root, "argv.json")) as handle:
        argv = json.load(handle)
    adam, distributed = train(root, argv, False), train(root, argv, True)
    reference = {
        "torch": adam,
        "torch_dist": adam,
        "torch_distributed_optimizer": distributed,
        "torch_dist_distributed_optimizer": distributed,
    }
    with open(os.path.join(root, "reference.json"), "w") as handle:
        json.dump(reference, handle)
    print(f"megatron-core training ok: {reference}")


if __name__ == "__main__":
    main(sys.argv[1])
