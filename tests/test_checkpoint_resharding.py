"""Checkpoints across layouts: a checkpoint saved under one (TP, PP, DP) layout loads under another with the same
logits and continues training with the same losses; the offline converter reshards exactly; impossible
targets and broken files are refused with messages that name the setting or the file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import zlib

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_train.arguments import MegatronConfig, config_from_dict
from megatron_train.checkpointing import (
    CheckpointError,
    TrainingProgress,
    load_checkpoint,
    load_model_for_inference,
    read_latest_iteration,
    read_metadata,
    resolve_iteration_dir,
    save_checkpoint,
)
from megatron_train.checkpointing.layout import (
    TensorSharding,
    check_layout,
    global_param_name,
    merge_tp_shards,
    padded_vocab_sizes_agree,
    renumber_layer,
    resize_vocab,
    split_tp_shard,
    stage_tensor_names,
    true_vocab_range,
)
from megatron_train.data.config import DataConfig
from megatron_train.families.bert import BERT
from megatron_train.families.gpt import DECODER_PIPELINE, GPT
from megatron_train.models.gpt import GPTModel
from megatron_train.models.transformer import pack_qkv
from megatron_train.optimizer import get_megatron_optimizer
from megatron_train.parallel import model_parallel_seed, state
from megatron_train.tools.checkpoint_util import convert_checkpoint, main
from megatron_train.training.config import CheckpointConfig, OptimizerConfig, TokenizerConfig, TrainingConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import tiny_config, tiny_llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_PADDED_VOCAB = 128  # NullTokenizer --vocab-size 127 (+ eod) pads to 128 at TP 1, 2 and 4 with divisor 32
LLAMA_TRUE_VOCAB = 100  # divisor 24: pads to 120 at TP1, 144 at TP2, 192 at TP4
LLAMA_DIVISOR = 24
LLAMA_PADDED = {1: 120, 2: 144, 4: 192}


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(5))


def _train_argv(save: str, tp: int, *extra: str) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
        "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.2", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--num-workers", "0", "--mock-data", "--seed", "7", "--save", save,
        "--tensor-model-parallel-size", str(tp), *extra,
    ]  # fmt: skip


def _llama_config(save_dir: str) -> MegatronConfig:
    """GQA (8 heads, 4 groups), SwiGLU, RoPE, RMSNorm, untied output layer, biases."""
    model = tiny_llama_config(add_bias_linear=True)
    return MegatronConfig(
        model=model,
        data=DataConfig(mock_data=True),
        training=TrainingConfig(train_iters=1),
        optimizer=OptimizerConfig(lr=1e-2),
        checkpoint=CheckpointConfig(save=save_dir, load=save_dir, no_load_optim=True, no_load_rng=True),
        tokenizer=TokenizerConfig(make_vocab_size_divisible_by=LLAMA_DIVISOR),
    )


def _noise(name: str, shape: torch.Size, split: bool) -> torch.Tensor:
    """Deterministic values per param name (and TP rank for split params, so replicas stay equal)."""
    seed = zlib.crc32(name.encode()) + (1000 * state.get_tensor_model_parallel_rank() if split else 0)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1


def _pipelined_logits(model: GPTModel, tokens: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Run the stages in turn (hidden states broadcast over the pipeline group); every rank gets the logits."""
    pp_size, pp_rank = (
        state.get_pipeline_model_parallel_world_size(),
        state.get_pipeline_model_parallel_rank(),
    )
    ranks = state.get_pipeline_model_parallel_ranks()
    batch, seq = tokens.shape
    hidden = None
    with torch.no_grad():
        for stage in range(pp_size):
            last = stage == pp_size - 1
            if stage == pp_rank:
                model.set_input_tensor(hidden)
                out = model(tokens).contiguous()
            else:
                out = torch.empty((batch, seq, model.vocab_size) if last else (seq, batch, hidden_size))
            if pp_size > 1:
                dist.broadcast(out, src=ranks[stage], group=state.get_pipeline_model_parallel_group())
            hidden = out
    return out


def _logits_after_load(load_dir: str, tp: int, pp: int, padded: int, tokens: torch.Tensor) -> torch.Tensor:
    """Build this rank's stage under (tp, pp), load `load_dir` into it, return the whole model's logits."""
    config = config_from_dict(read_metadata(resolve_iteration_dir(load_dir, None))["args"])
    config.checkpoint = CheckpointConfig(load=load_dir, no_load_optim=True, no_load_rng=True)
    state.initialize_model_parallel(tp, pp)
    try:
        pp_rank = state.get_pipeline_model_parallel_rank()
        model = GPTModel(config.model, padded, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
        load_checkpoint(model, None, None, config, padded)
        return _pipelined_logits(model.eval(), tokens, config.model.hidden_size)
    finally:
        state.destroy_model_parallel()


def _save_llama_tp2_pp2(save_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Save a TP2 x PP2 model built stage by stage (with Adam state from one step on made-up grads)."""
    config = _llama_config(save_dir)
    config.parallel.tensor_model_parallel_size = config.parallel.pipeline_model_parallel_size = 2
    state.initialize_model_parallel(2, 2)
    try:
        model_parallel_seed(11)
        pp_rank = state.get_pipeline_model_parallel_rank()
        model = GPTModel(config.model, LLAMA_PADDED[2], pre_process=pp_rank == 0, post_process=pp_rank == 1)
        optimizer = get_megatron_optimizer(config.optimizer, model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                split = getattr(param, "tensor_model_parallel", False)
                param.add_(_noise(name, param.shape, split))  # biases and norms away from 0 and 1
                param.grad = _noise(name + ".grad", param.shape, split)
        optimizer.step()
        logits = _pipelined_logits(model.eval(), tokens, config.model.hidden_size)
        save_checkpoint(1, model, optimizer, None, TrainingProgress(1, 4, 0), config, LLAMA_PADDED[2])
        return logits
    finally:
        state.destroy_model_parallel()


def _read_losses(save_dir: str) -> list[float]:
    with open(os.path.join(save_dir, "metrics.jsonl")) as handle:
        return [r["lm loss"] for r in map(json.loads, handle) if "split" not in r]


def _layouts_worker(rank: int, world_size: int, root: str) -> dict:
    """Four ranks: train under TP2 x DP2 (distributed optimizer) and resume its iteration-2 checkpoint under
    TP4 (plain optimizer) and TP1 x DP4 (distributed optimizer);
    load the TP2 checkpoint under TP4 and TP2 x PP2; save a TP2 x PP2 Llama and load it under TP4."""
    from megatron_train.pretrain_gpt import main as pretrain_main

    ref, resume = f"{root}/gpt_tp2", ["--load", f"{root}/gpt_tp2", "--ckpt-step", "2", "--no-load-rng"]
    distributed_optimizer = "--use-distributed-optimizer"  # Adam state sharded over DP, saved per param
    pretrain_main(_train_argv(ref, 2, "--save-interval", "2", distributed_optimizer))  # TP2 x DP2
    pretrain_main(_train_argv(f"{root}/resumed_tp4", 4, *resume))  # TP4 x DP1, plain optimizer
    pretrain_main(_train_argv(f"{root}/resumed_tp1", 1, *resume, distributed_optimizer))  # TP1 x DP4
    gpt_tokens, llama_tokens = _tokens(127), _tokens(LLAMA_TRUE_VOCAB)
    results = {
        "losses": {n: _read_losses(f"{root}/{n}") for n in ("gpt_tp2", "resumed_tp4", "resumed_tp1")},
        "gpt": {
            layout: _logits_after_load(ref, *layout, GPT_PADDED_VOCAB, gpt_tokens)
            for layout in ((2, 1), (4, 1), (2, 2), (1, 2))
        },
        "llama_saved": _save_llama_tp2_pp2(f"{root}/llama_tp2_pp2", llama_tokens),
        "llama_tp4": _logits_after_load(f"{root}/llama_tp2_pp2", 4, 1, LLAMA_PADDED[4], llama_tokens),
    }
    return results if rank == world_size - 1 else {}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("layouts"))
    return {**run_distributed(_layouts_worker, 4, root, timeout=300)[-1], "root": root}


def _load_single_process(load_dir: str, padded: int) -> GPTModel:
    """Load under TP1 x PP1 in this process (no process group: every parallel size is 1)."""
    config = config_from_dict(read_metadata(resolve_iteration_dir(load_dir, None))["args"])
    config.checkpoint = CheckpointConfig(load=load_dir, no_load_optim=True, no_load_rng=True)
    model = GPTModel(config.model, padded)
    load_checkpoint(model, None, None, config, padded)
    return model.eval()


@pytest.mark.processes
def test_training_continues_after_a_tp_change_with_the_same_losses(layouts) -> None:
    losses = layouts["losses"]
    reference = losses["gpt_tp2"]
    assert len(reference) == 4 and len(set(reference)) == 4
    # resumed from iteration 2 with Adam moments and the scheduler resharded: iterations 3 and 4
    for resumed in ("resumed_tp4", "resumed_tp1"):
        assert len(losses[resumed]) == 2
        torch.testing.assert_close(losses[resumed], reference[2:], rtol=1e-5, atol=0)


@pytest.mark.processes
def test_tp2_checkpoint_gives_the_same_logits_under_tp1_tp4_and_pipeline_stages(layouts) -> None:
    saved = layouts["gpt"][(2, 1)]  # the saved layout: shards read as they are
    for layout in (
        (4, 1),
        (2, 2),
        (1, 2),
    ):  # (2, 2) and (1, 2): the last stage's tied output from the embedding
        torch.testing.assert_close(layouts["gpt"][layout], saved, rtol=1e-5, atol=1e-5)
    model = _load_single_process(f"{layouts['root']}/gpt_tp2", GPT_PADDED_VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(127)), saved, rtol=1e-5, atol=1e-5)


@pytest.mark.processes
def test_gqa_swiglu_rope_tp2_pp2_checkpoint_under_tp4_and_tp1_with_repadded_vocab(layouts) -> None:
    saved, true_vocab = layouts["llama_saved"], LLAMA_TRUE_VOCAB
    assert saved.shape[-1] == LLAMA_PADDED[2] and layouts["llama_tp4"].shape[-1] == LLAMA_PADDED[4]
    torch.testing.assert_close(
        layouts["llama_tp4"][..., :true_vocab], saved[..., :true_vocab], rtol=1e-5, atol=1e-5
    )
    model = _load_single_process(f"{layouts['root']}/llama_tp2_pp2", LLAMA_PADDED[1])
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(true_vocab))[..., :true_vocab], saved[..., :true_vocab])


@pytest.mark.processes
def test_layer_names_are_global_and_stages_record_their_layers(layouts) -> None:
    iteration_dir = f"{layouts['root']}/llama_tp2_pp2/iter_0000001"
    with safe_open(f"{iteration_dir}/mp_rank_01_001/model.safetensors", framework="pt") as handle:
        names, sharding = list(handle.keys()), json.loads(handle.metadata()["sharding"])
    assert all(
        n.startswith(("decoder.layers.1.", "decoder.final_layernorm.", "output_layer.")) for n in names
    )
    qkv = sharding["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert (qkv["layer"], qkv["pp_rank"], qkv["tp_rank"], qkv["global_shape"]) == (1, 1, 1, [64, 32])
    fc1 = sharding["decoder.layers.1.mlp.linear_fc1.weight"]
    assert (fc1["partition_dim"], fc1["partition_stride"]) == (0, 2)


@pytest.mark.processes
def test_converter_round_trip_is_bitwise(layouts, tmp_path) -> None:
    """TP2 x PP2 -> TP1 x PP1 -> TP2 x PP2 gives back every file's tensors and records, optimizer included."""
    source = f"{layouts['root']}/llama_tp2_pp2"
    convert_checkpoint(source, str(tmp_path / "tp1"), 1, 1)
    merged = read_metadata(f"{tmp_path}/tp1/iter_0000001")
    assert (merged["tensor_model_parallel_size"], merged["pipeline_model_parallel_size"]) == (1, 1)
    assert merged["padded_vocab_size"] == LLAMA_PADDED[2]  # 144 divides TP1's multiple: kept
    convert_checkpoint(str(tmp_path / "tp1"), str(tmp_path / "back"), 2, 2)
    for tp_rank in range(2):
        for pp_rank in range(2):
            for kind in ("model", "optimizer"):
                shard = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}/{kind}.safetensors"
                with (
                    safe_open(f"{source}/iter_0000001/{shard}", framework="pt") as original,
                    safe_open(f"{tmp_path}/back/iter_0000001/{shard}", framework="pt") as converted,
                ):
                    assert sorted(original.keys()) == sorted(converted.keys()) and original.keys()
                    assert original.metadata() == converted.metadata()
                    for name in original.keys():  # noqa: SIM118 - a safetensors handle is no dict
                        assert torch.equal(original.get_tensor(name), converted.get_tensor(name)), (
                            shard,
                            name,
                        )
            meta = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}/optimizer.json"
            with (
                open(f"{source}/iter_0000001/{meta}") as a,
                open(f"{tmp_path}/back/iter_0000001/{meta}") as b,
            ):
                assert json.load(a) == json.load(b)


@pytest.mark.processes
def test_converter_tp2_to_tp1_and_tp4_keeps_logits_and_adam_state(layouts, tmp_path) -> None:
    source = f"{layouts['root']}/gpt_tp2"
    saved = layouts["gpt"][(2, 1)]
    for tp in (1, 4):
        target = str(tmp_path / f"tp{tp}")
        main(["--model-type", "GPT", "--load-dir", source, "--save-dir", target,
              "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", "1"])  # fmt: skip
        assert read_latest_iteration(target) == 4
        metadata = read_metadata(f"{target}/iter_0000004")
        assert metadata["args"]["parallel"]["tensor_model_parallel_size"] == tp
        assert (metadata["iteration"], metadata["consumed_train_samples"]) == (4, 16)
        assert (
            metadata["opt_param_scheduler"] == read_metadata(f"{source}/iter_0000004")["opt_param_scheduler"]
        )
        model, _ = load_model_for_inference(target, device="cpu")
        with torch.no_grad():
            torch.testing.assert_close(model(_tokens(127)), saved, rtol=1e-5, atol=1e-5)
    # the TP4 shards of an Adam moment are the TP2 shards' merge cut in four (strided SwiGLU-free GPT: stride 1)
    name = "decoder.layers.1.self_attention.linear_qkv.weight.exp_avg"
    merged = torch.cat(
        [_tensor(f"{source}/iter_0000004/mp_rank_{r:02d}/optimizer.safetensors", name) for r in range(2)]
    )
    resharded = torch.cat(
        [
            _tensor(f"{tmp_path}/tp4/iter_0000004/mp_rank_{r:02d}/optimizer.safetensors", name)
            for r in range(4)
        ]
    )
    assert torch.equal(merged, resharded) and merged.abs().sum() > 0


def _tensor(path: str, name: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as handle:
        return handle.get_tensor(name)


@pytest.mark.processes
def test_converter_command_line_splits_pipeline_stages(layouts, tmp_path) -> None:
    target = str(tmp_path / "tp2_pp2")
    command = [sys.executable, "-m", "megatron_train.tools.checkpoint_util", "--model-type", "GPT",
               "--load-dir", f"{layouts['root']}/gpt_tp2", "--save-dir", target,
               "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--no-load-rng" in done.stdout and "resharded" in done.stderr
    assert sorted(os.listdir(f"{target}/iter_0000004")) == [
        "metadata.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
    ]  # fmt: skip
    model, _ = load_model_for_inference(target, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(127)), layouts["gpt"][(2, 1)], rtol=1e-5, atol=1e-5)


@pytest.mark.processes
@pytest.mark.parametrize(
    ("source", "tp", "pp", "message"),
    [
        ("gpt_tp2", 3, 1, r"--num-attention-heads \(4\) is not divisible by the target tensor model parallel size \(3\)"),
        ("llama_tp2_pp2", 8, 1, r"number of query groups \(--num-query-groups\) \(4\) is not divisible .* \(8\)"),
        ("gpt_tp2", 1, 3, r"target pipeline model parallel size \(3\) does not cut this model: --num-layers 2 is not divisible"),
    ],
    ids=["heads_over_tp3", "query_groups_over_tp8", "layers_over_pp3"],
)  # fmt: skip
def test_impossible_targets_are_refused_naming_the_setting(
    layouts, tmp_path, source, tp, pp, message
) -> None:
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(f"{layouts['root']}/{source}", str(tmp_path / "out"), tp, pp)
    assert not os.path.exists(tmp_path / "out")  # nothing written for a refused target


@pytest.mark.processes
def test_impossible_conversions_are_refused(layouts, tmp_path, capsys) -> None:
    gpt, llama = f"{layouts['root']}/gpt_tp2", f"{layouts['root']}/llama_tp2_pp2"
    with pytest.raises(ValueError, match="--true-vocab-size 200 exceeds"):
        convert_checkpoint(llama, str(tmp_path / "out"), 1, 1, true_vocab_size=200)
    with pytest.raises(ValueError, match="is --load-dir"):
        convert_checkpoint(gpt, gpt, 1, 1)
    convert_checkpoint(gpt, str(tmp_path / "done"), 1, 1)
    with pytest.raises(ValueError, match=r"done already holds a run's checkpoints \(iter_0000004, latest_"):
        convert_checkpoint(gpt, str(tmp_path / "done"), 4, 1)
    with pytest.raises(SystemExit):
        main(["--load-dir", gpt, "--save-dir", str(tmp_path / "out"), "--target-tensor-parallel-size", "3"])
    assert "--num-attention-heads (4) is not divisible" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")  # nothing written for a refused target


@pytest.mark.processes
def test_true_vocab_size_repads_exactly(layouts, tmp_path) -> None:
    source = f"{layouts['root']}/llama_tp2_pp2"
    convert_checkpoint(source, str(tmp_path / "tp4"), 4, 1, true_vocab_size=LLAMA_TRUE_VOCAB)
    assert read_metadata(f"{tmp_path}/tp4/iter_0000001")["padded_vocab_size"] == LLAMA_PADDED[4]
    model, _ = load_model_for_inference(str(tmp_path / "tp4"), device="cpu")
    with torch.no_grad():
        logits = model(_tokens(LLAMA_TRUE_VOCAB))
    torch.testing.assert_close(logits[..., :LLAMA_TRUE_VOCAB], layouts["llama_saved"][..., :LLAMA_TRUE_VOCAB])


@pytest.mark.processes
def test_converted_down_to_tp1_without_true_vocab_size_loads_in_a_tp1_run(layouts, tmp_path) -> None:
    """TP2 (padded 144) -> TP1 keeps 144 rows; a TP1 run of the same tokenizer pads to 120 and must still load."""
    convert_checkpoint(f"{layouts['root']}/llama_tp2_pp2", str(tmp_path / "tp1"), 1, 1)
    metadata = read_metadata(f"{tmp_path}/tp1/iter_0000001")
    assert metadata["padded_vocab_size"] == LLAMA_PADDED[2]
    assert metadata["true_vocab_size_range"] == [LLAMA_PADDED[2] - 2 * LLAMA_DIVISOR, LLAMA_PADDED[2]]
    model = _load_single_process(str(tmp_path / "tp1"), LLAMA_PADDED[1])
    with torch.no_grad():
        logits = model(_tokens(LLAMA_TRUE_VOCAB))[..., :LLAMA_TRUE_VOCAB]
    torch.testing.assert_close(logits, layouts["llama_saved"][..., :LLAMA_TRUE_VOCAB])


@pytest.mark.processes
def test_missing_shard_file_is_named(layouts, tmp_path) -> None:
    broken = str(tmp_path / "broken")
    shutil.copytree(f"{layouts['root']}/gpt_tp2", broken)
    missing = f"{broken}/iter_0000004/mp_rank_01/model.safetensors"
    os.remove(missing)
    with pytest.raises(CheckpointError, match=f"{missing} is missing"):
        load_model_for_inference(broken, device="cpu")
    with pytest.raises(CheckpointError, match=f"{missing} is missing"):
        _load_single_process(broken, GPT_PADDED_VOCAB)
    with pytest.raises(CheckpointError, match=f"{missing} is missing"):
        convert_checkpoint(broken, str(tmp_path / "out"), 1, 1)
    assert read_latest_iteration(str(tmp_path / "out")) is None  # no marker for an unfinished conversion


@pytest.mark.processes
def test_rng_states_are_skipped_with_a_log_line_on_a_layout_change(layouts, caplog) -> None:
    load_dir = f"{layouts['root']}/gpt_tp2"
    config = config_from_dict(read_metadata(resolve_iteration_dir(load_dir, None))["args"])
    config.checkpoint = CheckpointConfig(load=load_dir, no_load_optim=True)  # RNG asked for
    model = GPTModel(config.model, GPT_PADDED_VOCAB)
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="megatron_train.checkpointing"):
        assert load_checkpoint(model, None, None, config, GPT_PADDED_VOCAB).iteration == 4
    assert (
        "(TP, PP, CP) changed from (2, 1, 1) to (1, 1, 1)" in caplog.text and "--no-load-rng" in caplog.text
    )
    assert torch.equal(torch.rand(2), expected)  # RNG untouched
    with pytest.raises(CheckpointError, match="padded_vocab_size=128 but this run has padded_vocab_size=256"):
        load_checkpoint(GPTModel(config.model, 256), None, None, config, 256)


# Pure resharding rules


@pytest.mark.parametrize("stride", [1, 2])
def test_merge_then_split_to_another_tp_size_is_exact(stride: int) -> None:
    sharding = TensorSharding(partition_dim=0, partition_stride=stride)
    full = torch.arange(48.0).reshape(24, 2)
    tp2 = [split_tp_shard(full, sharding, 2, r) for r in range(2)]
    assert torch.equal(merge_tp_shards(tp2, sharding), full)
    tp4 = [split_tp_shard(merge_tp_shards(tp2, sharding), sharding, 4, r) for r in range(4)]
    assert all(torch.equal(shard, split_tp_shard(full, sharding, 4, r)) for r, shard in enumerate(tp4))
    if stride == 2:  # [gate; up]: rank r of 4 holds gate rows 3r..3r+2 and up rows 12+3r..12+3r+2
        gate, up = full.chunk(2)
        assert torch.equal(tp4[1], torch.cat((gate[3:6], up[3:6])))
    columns = TensorSharding(partition_dim=1)
    wide = torch.arange(24.0).reshape(2, 12)
    assert torch.equal(split_tp_shard(wide, columns, 4, 3), wide[:, 9:])


def test_qkv_with_gqa_reshards_whole_query_groups() -> None:
    """4 groups of 2 query heads: any TP rank holds exactly the fused rows of its own groups."""
    groups, heads, head_dim, hidden = 4, 8, 3, 5
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(groups * head_dim, hidden), torch.randn(groups * head_dim, hidden)
    sharding = TensorSharding(partition_dim=0)
    fused = pack_qkv(q, k, v, groups)
    tp2 = [split_tp_shard(fused, sharding, 2, r) for r in range(2)]
    for tp in (1, 4):
        for rank in range(tp):
            per_rank, head_rows = groups // tp, heads // tp * head_dim
            expected = pack_qkv(
                q[rank * head_rows : (rank + 1) * head_rows],
                k[rank * per_rank * head_dim : (rank + 1) * per_rank * head_dim],
                v[rank * per_rank * head_dim : (rank + 1) * per_rank * head_dim],
                per_rank,
            )
            assert torch.equal(split_tp_shard(merge_tp_shards(tp2, sharding), sharding, tp, rank), expected)


def test_vocab_repadding_and_when_it_is_allowed() -> None:
    table = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(resize_vocab(table, 4, replicate_last_row=True), table[:4])
    grown = resize_vocab(table, 8, replicate_last_row=True)
    assert torch.equal(grown[6:], table[5:].expand(2, 2)) and torch.equal(grown[:6], table)
    assert torch.equal(resize_vocab(table, 8, replicate_last_row=False)[6:], torch.zeros(2, 2))

    # true vocab 100, divisor 24: 120 (TP1), 144 (TP2), 192 (TP4) are one vocabulary; 128 vs 256 at TP1 are not
    def agree(saved: int, saved_multiple: int, ours: int, our_multiple: int) -> bool:
        return padded_vocab_sizes_agree(
            true_vocab_range(saved, saved_multiple), true_vocab_range(ours, our_multiple)
        )

    assert agree(144, 48, 192, 96) and agree(144, 48, 120, 24)
    assert not agree(128, 128, 256, 128)
    assert not agree(96, 24, 192, 96)  # (72, 96] and (96, 192]: no common true size


def test_layer_renumbering_and_stage_ownership() -> None:
    assert (
        renumber_layer("decoder.layers.1.mlp.linear_fc1.weight", 2)
        == "decoder.layers.3.mlp.linear_fc1.weight"
    )
    assert (
        renumber_layer("decoder.layers.3.mlp.linear_fc1.weight", -2)
        == "decoder.layers.1.mlp.linear_fc1.weight"
    )
    assert renumber_layer("embedding.word_embeddings.weight", 2) == "embedding.word_embeddings.weight"
    assert global_param_name("output_layer.weight", 2, True) == "embedding.word_embeddings.weight"
    assert global_param_name("output_layer.weight", 2, False) == "output_layer.weight"
    names = ["embedding.word_embeddings.weight", *(f"decoder.layers.{i}.input_layernorm.weight" for i in range(4)),
             "decoder.final_layernorm.weight", "output_layer.weight"]  # fmt: skip
    assert stage_tensor_names(GPT.pipeline, names, range(0, 2), True, False) == names[:3]
    assert stage_tensor_names(GPT.pipeline, names, range(2, 4), False, True) == names[3:]
    with pytest.raises(
        ValueError, match="'mystery.weight' belongs to no pipeline stage of this model family"
    ):
        stage_tensor_names(GPT.pipeline, [*names, "mystery.weight"], range(0, 4), True, True)
    assert (
        renumber_layer("encoder.layers.1.mlp.linear_fc1.weight", 2)
        == "encoder.layers.3.mlp.linear_fc1.weight"
    )
    bert = ["embedding.tokentype_embeddings.weight", *(f"encoder.layers.{i}.mlp.linear_fc1.weight" for i in range(2)),
            "lm_head.dense.weight", "output_layer.bias", "pooler.dense.weight", "binary_head.weight"]  # fmt: skip
    assert stage_tensor_names(BERT.pipeline, bert, range(0, 1), True, False) == bert[:2]
    assert stage_tensor_names(BERT.pipeline, bert, range(1, 2), False, True) == bert[2:]
    llama = _llama_config("unused").model
    check_layout(llama, DECODER_PIPELINE, 192, 4, 2)
    with pytest.raises(ValueError, match=r"padded vocabulary size \(100\) is not divisible .* \(8\)"):
        check_layout(tiny_config(num_attention_heads=8), DECODER_PIPELINE, 100, 8, 1)


def test_bf16_main_params_and_adam_moments_follow_their_weights_through_repadding(tmp_path) -> None:
    """A bf16 model's fp32 main params and Adam moments reshard like the weights: TP1 (vocab 120) -> TP2 (144,
    new rows copy the last one, moments start at zero) -> loaded back under TP1 exactly as saved."""
    config = _llama_config(str(tmp_path / "tp1"))
    config.model.bf16 = True
    model_parallel_seed(3)
    model = GPTModel(config.model, LLAMA_PADDED[1])
    optimizer = get_megatron_optimizer(config.optimizer, model, torch.bfloat16)
    for name, param in model.named_parameters():
        param.grad = _noise(name, param.shape, split=False).to(torch.bfloat16)
    optimizer.step()
    save_checkpoint(1, model, optimizer, None, TrainingProgress(1, 4, 0), config, LLAMA_PADDED[1])
    saved_tensors, saved_meta = optimizer.state_dict()

    convert_checkpoint(str(tmp_path / "tp1"), str(tmp_path / "tp2"), 2, 1)
    shards = [f"{tmp_path}/tp2/iter_0000001/mp_rank_{r:02d}/optimizer.safetensors" for r in range(2)]
    for state_name in ("main_param", "exp_avg"):
        name = f"embedding.word_embeddings.weight.{state_name}"
        merged = torch.cat([_tensor(path, name) for path in shards])
        original = saved_tensors[name]
        assert merged.shape[0] == LLAMA_PADDED[2] and merged.dtype == torch.float32
        assert torch.equal(merged[: LLAMA_PADDED[1]], original)
        padding = original[-1:].expand(24, -1) if state_name == "main_param" else torch.zeros(24, 32)
        assert torch.equal(merged[LLAMA_PADDED[1] :], padding)

    config.checkpoint = CheckpointConfig(load=str(tmp_path / "tp2"), no_load_rng=True)
    model_parallel_seed(4)
    loaded = GPTModel(config.model, LLAMA_PADDED[1])
    loaded_optimizer = get_megatron_optimizer(config.optimizer, loaded, torch.bfloat16)
    assert load_checkpoint(loaded, loaded_optimizer, None, config, LLAMA_PADDED[1]).iteration == 1
    tensors, meta = loaded_optimizer.state_dict()
    assert meta == saved_meta and tensors.keys() == saved_tensors.keys()
    assert all(torch.equal(tensors[k], saved_tensors[k]) for k in tensors)
    original_weights = model.state_dict()
    assert all(torch.equal(tensor, original_weights[name]) for name, tensor in loaded.state_dict().items())


def test_version_1_checkpoints_load_and_unknown_versions_are_refused(tmp_path) -> None:
    """Version 1 saved only PP = 1 layouts, whose names and records version 2 reads unchanged."""
    config = _llama_config(str(tmp_path))
    model_parallel_seed(0)
    model = GPTModel(config.model, LLAMA_PADDED[1])
    save_checkpoint(1, model, None, None, TrainingProgress(1, 4, 0), config, LLAMA_PADDED[1])
    metadata_path = tmp_path / "iter_0000001" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata_path.write_text(json.dumps({**metadata, "format_version": 1}))
    loaded, _ = load_model_for_inference(str(tmp_path), device="cpu")
    original = model.state_dict()
    assert all(torch.equal(tensor, original[name]) for name, tensor in loaded.state_dict().items())
    metadata_path.write_text(json.dumps({**metadata, "format_version": 3}))
    with pytest.raises(CheckpointError, match=r"metadata.json: format version 3 is not one this code reads"):
        load_model_for_inference(str(tmp_path), device="cpu")


@pytest.mark.processes
def test_trained_checkpoint_converts_to_hf_and_through_megatron_with_its_logits(layouts, tmp_path) -> None:
    """A training run's TP2 checkpoint (optimizer state, distributed optimizer) through the other formats."""
    transformers = pytest.importorskip("transformers")
    source, saved = f"{layouts['root']}/gpt_tp2", layouts["gpt"][(2, 1)]
    main(["--saver", "hf", "--load-dir", source, "--save-dir", str(tmp_path / "hf")])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    # the run's GELU: Megatron's bias-GELU fusion computes the tanh approximation (HF's gelu_new)
    assert hf_model.config.activation_function == "gelu_new"
    with torch.no_grad():
        torch.testing.assert_close(hf_model(_tokens(127)).logits, saved, rtol=1e-5, atol=1e-5)
    main(["--saver", "megatron", "--load-dir", source, "--save-dir", str(tmp_path / "mg"),
          "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"])  # fmt: skip
    main(["--loader", "megatron", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "back")])
    model, _ = load_model_for_inference(str(tmp_path / "back"), device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(127)), saved, rtol=1e-5, atol=1e-5)
