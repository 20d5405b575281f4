"""Pipeline-parallel training runs from one set of initial weights: a 4-layer GPT's argv, a model provider that
loads this rank's stage and TP shard of the single-process model, and the merge of every rank's final weights
(tests/test_training_pipeline.py, tests/test_distrib_optimizer_pipeline.py)."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.checkpointing.layout import (
    WORD_EMBEDDING,
    TensorSharding,
    global_param_name,
    merge_tp_shards,
    split_tp_shard,
)
from megatron_train.families.gpt import GPT, datasets_provider, forward_step, gpt_terms
from megatron_train.models.gpt import GPTModel
from megatron_train.parallel import state
from megatron_train.parallel.param_init import initialized
from megatron_train.tokenizer import tokenizer_from_config
from megatron_train.training.entry import padded_vocab_size_for
from megatron_train.training.loop import pretrain
from tests.helpers.training import read_metrics

VOCAB = 127  # NullTokenizer: ids 0..126 and eod 127 (the corpus' eod), padded to 128 under TP 1 and 2
PADDED_VOCAB = 128
RTOL = 1e-5
PP2 = ["--pipeline-model-parallel-size", "2"]
VIRTUAL = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 4 layers, PP 2: 2 chunks of 1 layer per rank


def argv(run_dir: str, data_prefix: str, *extra: str) -> list[str]:
    """A 4-layer GPT, 3 steps of global batch 8 in micro-batches of 2, no dropout; metrics in run_dir."""
    return [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3",
        "--lr-warmup-iters", "1", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--data-path", data_prefix, "--split", "90,10,0", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--num-workers", "0", "--seed", "7",
        "--metrics-file", os.path.join(run_dir, "metrics.jsonl"), *extra,
    ]  # fmt: skip


def _sharding(param: torch.nn.Parameter) -> TensorSharding:
    if not getattr(param, "tensor_model_parallel", False):
        return TensorSharding()
    return TensorSharding(int(param.partition_dim), int(param.partition_stride))


def _global_names(stage: GPTModel) -> dict[str, str]:
    """Stage param name -> the single-process model's name (global layer numbers, tied output = embedding)."""
    tied_copy = stage.post_process and not stage.pre_process and stage.share_embeddings_and_output_weights
    start = stage.decoder.layer_range.start
    return {name: global_param_name(name, start, tied_copy) for name, _ in stage.named_parameters()}


def model_from_weights(
    initial: dict[str, np.ndarray],
    built: list[tuple[GPTModel, int]],
    config: MegatronConfig,
    padded_vocab_size: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: int,
) -> GPTModel:
    """A model provider: this stage of the single-process model `initial` (its TP shard of its layers; the
    tied output copy is left for the pipeline to sync); records (stage, TP rank) in `built`. Each shard is the
    parameter's initializer, so it holds also when the run builds the model on the meta device."""
    stage = GPT.model_provider(config, padded_vocab_size, pre_process, post_process, vp_stage)
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    global_names = _global_names(stage)
    for name, param in stage.named_parameters():
        global_name = global_names[name]
        if global_name == WORD_EMBEDDING and not pre_process:
            continue
        full = torch.from_numpy(initial[global_name])
        shard = split_tp_shard(full, _sharding(param), tp_size, tp_rank, global_name)
        initialized(param, lambda tensor, shard=shard: tensor.copy_(shard))
    built.append((stage, tp_rank))
    return stage


def pretrain_from_weights(
    rank: int, world_size: int, initial: dict[str, dict[str, np.ndarray]], runs: list[tuple[list[str], str]]
):
    """`pretrain` once per (argv, model), every layout starting from the single-process model `initial[model]`.
    Returns per run the last rank's metrics and this rank's final weights as (global name, TP rank, sharding,
    values)."""
    results = []
    for run, model in runs:
        config = parse_args(run, world_size)
        tokenizer = tokenizer_from_config(config.tokenizer)
        padded_vocab_size = padded_vocab_size_for(config, tokenizer)
        built: list[tuple[GPTModel, int]] = []
        pretrain(
            config,
            functools.partial(model_from_weights, initial[model], built),
            functools.partial(datasets_provider, config, tokenizer),
            forward_step,
            padded_vocab_size,
            gpt_terms(config, padded_vocab_size),
        )
        weights = [
            (_global_names(stage)[name], tp_rank, _sharding(param), param.detach().clone())
            for stage, tp_rank in built
            for name, param in stage.named_parameters()
        ]
        metrics_dir = os.path.dirname(run[run.index("--metrics-file") + 1])
        results.append(
            {"metrics": read_metrics(metrics_dir) if rank == world_size - 1 else [], "weights": weights}
        )
    return results


def merge_weights(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The full model from every rank's shards; copies of one shard (DP replicas, the tied output layer) must
    be equal."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    shardings: dict[str, TensorSharding] = {}
    for result in per_rank:
        for name, tp_rank, sharding, values in result["weights"]:
            held = shards.setdefault(name, {})
            if tp_rank in held:
                assert torch.equal(values, held[tp_rank]), f"copies of {name} differ"
            held[tp_rank] = values
            shardings[name] = sharding
    return {
        name: merge_tp_shards([held[r] for r in sorted(held)], shardings[name])
        for name, held in shards.items()
    }


def assert_series_close(actual: list, expected: list, rtol: float, what: str) -> None:
    """Equal lengths, None (a skipped step's loss and grad norm) in the same places, the rest close."""
    assert [a is None for a in actual] == [e is None for e in expected], what
    np.testing.assert_allclose(
        [a for a in actual if a is not None], [e for e in expected if e is not None], rtol=rtol, err_msg=what
    )
