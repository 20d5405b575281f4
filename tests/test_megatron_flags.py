"""Behaviour of the Megatron flags the example scripts and README use: decoupled lr, layernorm-1p, per-token loss,
grads reduced in bf16, overlapped param all-gather, step batch-size schedule, profiler window, manual GC, emptying
the CUDA cache, embedding weights in fp32, the bias-GELU fusion, num zeros and params norm in the log line, no
position embedding, --use-checkpoint-args, and the refusals."""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_train.arguments import config_from_dict, config_to_dict, parse_args
from megatron_train.distributed.ddp import DDPConfig, DistributedDataParallel
from megatron_train.models.config import TransformerConfig
from megatron_train.models.gpt import GPTModel
from megatron_train.models.norms import LayerNorm1P, RMSNorm, build_norm
from megatron_train.models.transformer import MLP
from megatron_train.optimizer import get_param_groups
from megatron_train.parallel import state
from megatron_train.parallel.layers import VocabParallelEmbedding
from megatron_train.training.config import OptimizerConfig
from megatron_train.training.logging import MetricsWriter, format_training_line
from megatron_train.training.loop import average_losses
from megatron_train.training.lr_scheduler import build_opt_param_scheduler
from megatron_train.training.microbatches import MicroBatchCalculator, parse_step_batch_size_schedule
from megatron_train.training.per_token_loss import NUM_TOKENS_KEY, scale_grads_to_per_token_loss
from megatron_train.training.step_hooks import StepHooks
from megatron_train.training.wandb_writer import build_wandb_writer
from tests.helpers.distributed import run_distributed
from tests.helpers.generation import save_tiny_checkpoint
from tests.helpers.tiny import tiny_config
from tests.helpers.training import pretrain_worker, tiny_args, train_losses


def test_decoupled_lr_schedules_only_the_embedding_and_output_layer() -> None:
    config = TransformerConfig.llama(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8)
    model = GPTModel(config, 64)
    groups = get_param_groups(list(model.named_parameters()), decoupled_lr=5e-4, decoupled_min_lr=4.5e-5)
    names = {id(p): n for n, p in model.named_parameters()}
    own = sorted(names[id(p)] for g in groups if "max_lr" in g for p in g["params"])
    assert own == ["embedding.word_embeddings.weight", "output_layer.weight"]
    optimizer = torch.optim.AdamW(groups, lr=0.0)
    opt = OptimizerConfig(
        lr=1.5e-4, min_lr=1e-5, decoupled_lr=5e-4, decoupled_min_lr=4.5e-5, lr_decay_style="cosine",
        lr_warmup_iters=2,
    )  # fmt: skip
    scheduler = build_opt_param_scheduler(
        optimizer, opt, train_iters=10, train_samples=None, global_batch_size=1
    )

    def rates() -> list[float]:
        """[lr of the embedding/output groups, lr of the others] (each side's groups must agree)."""
        own = {g["lr"] for g in optimizer.param_groups if "max_lr" in g}
        other = {g["lr"] for g in optimizer.param_groups if "max_lr" not in g}
        assert len(own) == len(other) == 1
        return [*own, *other]

    assert rates() == pytest.approx([0.0, 0.0])
    scheduler.step(1)  # halfway through warmup
    assert rates() == pytest.approx([2.5e-4, 0.75e-4])
    scheduler.step(1)  # warmup done: the peaks
    assert rates() == pytest.approx([5e-4, 1.5e-4])
    scheduler.step(20)  # past the decay: the floors
    assert rates() == pytest.approx([4.5e-5, 1e-5])
    plain = get_param_groups(list(model.named_parameters()))
    assert [len(g["params"]) for g in plain] == [6, 3] and not any("max_lr" in g for g in plain)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_stores_gamma_minus_one_and_computes_the_same(normalization) -> None:
    config = TransformerConfig.gpt2(
        num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, normalization=normalization,
        apply_layernorm_1p=True,
    )  # fmt: skip
    norm = build_norm(config, sequence_parallel=False)
    assert isinstance(norm, LayerNorm1P if normalization == "LayerNorm" else RMSNorm)
    assert torch.equal(norm.weight, torch.zeros(16))  # gamma = 1 stored as 0
    gamma = torch.randn(16)
    plain = nn.LayerNorm(16) if normalization == "LayerNorm" else RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(gamma - 1)
        plain.weight.copy_(gamma)
        if normalization == "LayerNorm":
            bias = torch.randn(16)
            norm.bias.copy_(bias)
            plain.bias.copy_(bias)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(norm(x), plain(x))


def _per_token_worker(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Two micro-batches per rank with different unmasked token counts, through our DDP and the scaling."""
    state.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1, bias=False)
        reference = nn.Linear(4, 1, bias=False)
        reference.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(model, DDPConfig(), state.get_data_parallel_group())
        inputs = torch.randn(world_size, 2, 5, 4, generator=torch.Generator().manual_seed(1))
        masks = torch.tensor([[[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]]).float()
        reduced = []
        for micro in range(2):
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                loss_sum = (ddp(inputs[rank, micro]).squeeze(-1) * masks[rank, micro]).sum()
                (loss_sum / 2).backward()  # the schedule divides by the number of micro-batches
            reduced.append({"lm loss": loss_sum.detach(), NUM_TOKENS_KEY: masks[rank, micro].sum()})
        ddp.finish_grad_sync()
        scale_grads_to_per_token_loss([ddp], reduced, num_micro_batches=2)
        logged = average_losses(reduced)["lm loss"]
        everything = (reference(inputs).squeeze(-1) * masks).sum() / masks.sum()  # Megatron's definition
        everything.backward()
        return model.weight.main_grad.clone(), reference.weight.grad.clone(), logged, everything.item()
    finally:
        state.destroy_model_parallel()


@pytest.mark.processes
def test_per_token_loss_is_the_sum_over_all_tokens_of_all_micro_batches_and_ranks() -> None:
    for grad, expected, logged, loss in run_distributed(_per_token_worker, 2):
        torch.testing.assert_close(grad, expected)
        assert logged == pytest.approx(loss, rel=1e-6)


def test_grad_reduce_in_bf16_keeps_the_grad_buffer_in_bf16(tmp_path) -> None:
    args = tiny_args(str(tmp_path), "--train-iters", "2", "--bf16")
    assert parse_args(args).training.accumulate_allreduce_grads_in_fp32
    config = parse_args([*args, "--grad-reduce-in-bf16"])
    assert not config.training.accumulate_allreduce_grads_in_fp32
    for in_fp32, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        model = nn.Linear(4, 4, dtype=torch.bfloat16)
        ddp = DistributedDataParallel(model, DDPConfig(grad_reduce_in_fp32=in_fp32))
        assert {buffer.dtype for buffer in ddp.buffers} == {dtype}
        ddp(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
        assert model.weight.main_grad.dtype == dtype
    with pytest.raises(SystemExit):
        parse_args(tiny_args(str(tmp_path), "--train-iters", "2", "--grad-reduce-in-bf16"))


def _param_gather_worker(rank: int, world_size: int) -> list[bool]:
    """Which buckets' all-gathers are in flight after the step, and after the next forward."""
    state.initialize_model_parallel(1, 1)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        config = DDPConfig(use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=64)
        ddp = DistributedDataParallel(model, config, state.get_data_parallel_group())
        ddp.all_gather_params()
        in_flight = [bucket.param_gather is not None for bucket in ddp.buckets]
        ddp(torch.randn(2, 8))
        return [*in_flight, *(bucket.param_gather is not None for bucket in ddp.buckets)]
    finally:
        state.destroy_model_parallel()


def _param_gather_then_pretrain_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[bool]:
    """The buckets' gathers in flight (as _param_gather_worker), then `runs`, in one process group."""
    in_flight = _param_gather_worker(rank, world_size)
    pretrain_worker(rank, world_size, runs)
    return in_flight


@pytest.mark.processes
def test_overlap_param_gather_defers_the_gather_to_the_forward_and_keeps_the_losses(tmp_path) -> None:
    common = ["--mock-data", "--train-iters", "4", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    runs = [
        tiny_args(str(tmp_path / "plain"), *common),
        tiny_args(str(tmp_path / "overlap"), *common, "--overlap-param-gather"),
    ]
    for flags in run_distributed(_param_gather_then_pretrain_worker, 2, runs):
        assert flags == [True, True, False, False]
    losses = train_losses(str(tmp_path / "plain"))
    assert len(losses) == 4 and losses == train_losses(str(tmp_path / "overlap"))
    with pytest.raises(SystemExit):  # Megatron's rule: only with the distributed optimizer
        parse_args(tiny_args(str(tmp_path), "--train-iters", "2", "--overlap-param-gather"))


def test_step_batch_size_schedule_follows_megatrons_format(tmp_path) -> None:
    schedule = parse_step_batch_size_schedule(["0:16 2.4B:320", "4.8B:624"], seq_length=2048)
    assert schedule == [(0, 16), (1171875, 320), (2343750, 624)]  # token thresholds in samples
    assert parse_step_batch_size_schedule(["0:2,8:4"], None) == [(0, 2), (8, 4)]
    calculator = MicroBatchCalculator(8, 2, 1, step_schedule=[(0, 2), (6, 4), (12, 8)])
    sizes = []
    for consumed in (0, 2, 4, 6, 10, 14):
        calculator.update(consumed)
        sizes.append((calculator.current_global_batch_size, calculator.num_micro_batches))
    assert sizes == [(2, 1), (2, 1), (2, 1), (4, 2), (4, 2), (8, 4)]
    assert calculator.train_iters_for_samples(30) == 7  # batches 2, 2, 2, 4, 4, 8, 8
    for bad, message in ((["16:4"], "first threshold must be 0"), (["0:4 x:8"], "is not THRESHOLD"),
                         (["0:4 64:8 64:16"], "must increase")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_step_batch_size_schedule(bad, 16)
    args = tiny_args(str(tmp_path), "--train-iters", "2")
    with pytest.raises(SystemExit):
        parse_args(
            [*args, "--step-batch-size-schedule", "0:2", "64:8"]
        )  # ends at 8, not --global-batch-size 4
    config = parse_args([*args, "--step-batch-size-schedule", "0:2", "64:4"])
    assert config.training.global_batch_size == 4
    interleaved = [
        *args,
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ]
    parse_args(interleaved, world_size=2)  # 2 micro-batches of 2: a multiple of the 2 stages
    with pytest.raises(SystemExit):  # the first batch of 2 is 1 micro-batch
        parse_args([*interleaved, "--step-batch-size-schedule", "0:2", "64:4"], world_size=2)


def test_refusals_name_the_flag(tmp_path, capsys) -> None:
    args = tiny_args(str(tmp_path), "--train-iters", "2")
    for extra, message in (
        (
            ["--context-parallel-size", "2"],  # on one process
            "--context-parallel-size 2 x --pipeline-model-parallel-size 1 = 2; change the sizes or the process count",
        ),
        (
            ["--profile", "--profile-step-start", "3", "--profile-step-end", "3"],
            "--profile-step-end 3 must be",
        ),
        (
            ["--seq-length", "64", "--max-position-embeddings", "32"],
            "--seq-length 64 exceeds --max-position-embeddings 32",
        ),
    ):
        with pytest.raises(SystemExit):
            parse_args([*args, *extra])
        assert message in capsys.readouterr().err


def _hooks(tmp_path, *extra: str) -> StepHooks:
    return StepHooks(parse_args(tiny_args(str(tmp_path), "--train-iters", "9", *extra)))


def test_profile_records_the_chosen_steps_into_a_trace_file(tmp_path) -> None:
    hooks = _hooks(tmp_path, "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                   "--profile-dir", str(tmp_path / "traces"))  # fmt: skip
    recording = []
    for iteration in range(6):
        hooks.before_step(iteration)
        recording.append(hooks.profiler is not None)
        with torch.profiler.record_function(f"step {iteration + 1}"):
            torch.ones(4).sum()
        hooks.after_step(iteration + 1)
    hooks.end_training()
    assert recording == [False, False, True, True, False, False]  # steps 3 and 4
    (trace,) = glob.glob(str(tmp_path / "traces" / "rank0.*.pt.trace.json"))
    with open(trace) as handle:
        text = handle.read()
    assert '"step 3"' in text and '"step 4"' in text and '"step 5"' not in text and '"step 2"' not in text


def test_manual_gc_collects_every_interval_only(tmp_path, monkeypatch) -> None:
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    hooks = _hooks(tmp_path, "--manual-gc", "--manual-gc-interval", "3")
    assert gc.isenabled()
    hooks.start_training()
    try:
        assert not gc.isenabled() and len(collected) == 1
        for iteration in range(1, 8):
            hooks.after_step(iteration)
        assert len(collected) == 1 + 2  # steps 3 and 6
        hooks.around_evaluation()
        assert len(collected) == 4
    finally:
        hooks.end_training()
    assert gc.isenabled()


@pytest.mark.parametrize("level, expected", [(0, 0), (1, 2), (2, 3)])
def test_empty_unused_memory_level_empties_the_cuda_cache(tmp_path, monkeypatch, level, expected) -> None:
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    hooks = _hooks(tmp_path, "--empty-unused-memory-level", str(level))
    hooks.after_forward_backward()  # level >= 1
    hooks.after_step(1)  # level >= 2
    hooks.around_evaluation()  # level >= 1
    assert len(emptied) == expected


def test_empty_unused_memory_level_is_a_logged_no_op_on_cpu(tmp_path, caplog) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    caplog.set_level("INFO", logger="megatron_train.training.step_hooks")
    hooks = _hooks(tmp_path, "--empty-unused-memory-level", "2")
    hooks.after_forward_backward()
    assert not hooks.empties_cache and "no CUDA device" in caplog.text


class _FakeRun:
    def __init__(self, **kwargs) -> None:
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, values))

    def finish(self) -> None:
        self.finished = True


def test_wandb_project_logs_every_record_to_a_run(tmp_path, monkeypatch, caplog) -> None:
    args = tiny_args(
        str(tmp_path), "--train-iters", "2", "--wandb-project", "proj", "--wandb-exp-name", "run1"
    )
    config = parse_args(args)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: the flag is accepted and says so
    assert build_wandb_writer(config) is None and "needs the wandb package" in caplog.text
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=_FakeRun))
    writer = MetricsWriter(None, None, wandb=build_wandb_writer(config))
    run = writer.wandb.run
    assert (run.init["project"], run.init["name"], run.init["dir"]) == (
        "proj",
        "run1",
        str(tmp_path / "wandb"),
    )
    assert run.init["config"]["training"]["train_iters"] == 2
    writer.write({"iteration": 1, "lm loss": 4.5, "learning rate": 1e-3, "grad norm": None})
    writer.write({"iteration": 1, "split": "valid", "end_of_training": False, "lm loss": 4.4})
    writer.close()
    assert run.logged == [(1, {"lm loss": 4.5, "learning rate": 1e-3}), (1, {"valid/lm loss": 4.4})]
    assert run.finished


def test_embedding_weights_in_fp32_sums_a_tokens_gradient_in_fp32_before_one_rounding(tmp_path) -> None:
    """bf16 accumulates the 4096 repeats of one token's gradient in bf16; the flag sums them in fp32 first."""
    assert parse_args(
        tiny_args(str(tmp_path), "--train-iters", "1", "--embedding-weights-in-fp32")
    ).model.embedding_weights_in_fp32
    ids = torch.zeros(4096, dtype=torch.long)
    upstream = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    grads = {}
    for in_fp32 in (False, True):
        torch.manual_seed(0)
        embedding = VocabParallelEmbedding(
            8, 32, init_method=nn.init.normal_, params_dtype=torch.bfloat16, weights_in_fp32=in_fp32
        )
        out = embedding(ids)
        assert out.dtype == torch.bfloat16 and torch.equal(out[0], embedding.weight[0])
        out.backward(upstream)
        grads[in_fp32] = embedding.weight.grad[0]
    exact = upstream.float().sum(0).bfloat16()
    assert torch.equal(grads[True], exact) and not torch.equal(grads[False], exact)


@pytest.mark.parametrize(
    ("overrides", "approximate"),
    [
        ({}, "tanh"),  # Megatron's default: the fused bias + GELU kernel computes the tanh approximation
        ({"bias_gelu_fusion": False}, "none"),  # --no-bias-gelu-fusion
        (
            {"add_bias_linear": False},
            "none",
        ),  # --disable-bias-linear: no bias to fuse (Megatron turns it off)
        ({"bias_gelu_fusion": False, "openai_gelu": True}, "tanh"),
    ],
)
def test_bias_gelu_fusion_is_megatrons_tanh_gelu_and_no_bias_gelu_fusion_the_exact_one(
    overrides, approximate
) -> None:
    torch.manual_seed(0)
    mlp = MLP(tiny_config(**overrides), sequence_parallel=False)
    x = torch.randn(4, 2, 32)
    with torch.no_grad():
        out = mlp(x)
        torch.testing.assert_close(
            out, mlp.linear_fc2(F.gelu(mlp.linear_fc1(x), approximate=approximate)), rtol=0, atol=0
        )
        other = "none" if approximate == "tanh" else "tanh"
        assert not torch.equal(out, mlp.linear_fc2(F.gelu(mlp.linear_fc1(x), approximate=other)))


def test_no_bias_gelu_fusion_flag(tmp_path) -> None:
    config = parse_args(tiny_args(str(tmp_path), "--train-iters", "1"))
    assert config.model.bias_gelu_fusion
    assert not parse_args(
        tiny_args(str(tmp_path), "--train-iters", "1", "--no-bias-gelu-fusion")
    ).model.bias_gelu_fusion
    saved = config_to_dict(config)
    assert config_from_dict(saved).model.bias_gelu_fusion
    del saved["model"]["bias_gelu_fusion"]  # a checkpoint saved before the flag: its MLP ran the exact GELU
    assert config_from_dict(saved).model.gelu_approximate == "none"


def test_num_zeros_and_params_norm_follow_the_grad_norm_in_megatrons_line() -> None:
    stats = {
        "iteration": 3, "consumed samples": 12, "elapsed time per iteration (ms)": 5.0,
        "throughput per GPU (TFLOP/s/GPU)": 0.1, "learning rate": 1e-3, "global batch size": 4, "lm loss": 4.0,
        "loss scale": 1.0, "grad norm": 1.5, "num zeros": 512.0, "params norm": 12.25,
        "number of skipped iterations": 0, "number of nan iterations": 0, "tokens per second": 10.0, "MFU": None,
        "peak memory (MB)": 1.0,
    }  # fmt: skip
    line = format_training_line(stats, 10)
    assert (
        " grad norm: 1.500 | num zeros: 512.0 | params norm: 12.250 | number of skipped iterations:" in line
    )
    quiet = format_training_line({**stats, "num zeros": None, "params norm": None}, 10)
    assert "num zeros" not in quiet and "params norm" not in quiet


def test_position_embedding_type_none_gives_the_model_no_position_signal() -> None:
    """With no position embedding a run of one token is the same at every position (causal attention over equal
    values); learned positions tell them apart."""
    ids = torch.full((1, 8), 5)
    logits, tables = {}, {}
    for kind in ("none", "learned_absolute"):
        torch.manual_seed(0)
        model = GPTModel(tiny_config(position_embedding_type=kind), 64).eval()
        tables[kind] = model.embedding.position_embeddings is not None
        with torch.no_grad():
            logits[kind] = model(ids)[0]
    assert tables == {"none": False, "learned_absolute": True}
    torch.testing.assert_close(logits["none"], logits["none"][:1].expand(8, -1))
    assert not torch.allclose(logits["learned_absolute"][0], logits["learned_absolute"][-1])


def test_use_checkpoint_args_takes_the_architecture_and_tokenizer_from_the_checkpoint(
    tmp_path, caplog, capsys
) -> None:
    saved = save_tiny_checkpoint(
        str(tmp_path / "ckpt")
    )  # 2 layers, hidden 32, 4 heads, seq 64; NullTokenizer(100)
    run = ["--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--load", saved]
    caplog.set_level("INFO", logger="megatron_train.arguments")
    config = parse_args([*run, "--use-checkpoint-args", "--num-layers", "2"], world_size=1)
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length) == (
        2,
        32,
        4,
        64,
    )
    assert (config.tokenizer.tokenizer_type, config.tokenizer.vocab_size) == ("NullTokenizer", 100)
    assert "Setting hidden_size to 32 from checkpoint" in caplog.text
    assert "Setting num_layers" not in caplog.text  # given on the command line: kept
    with pytest.raises(SystemExit):  # without it the model flags are required, as in Megatron
        parse_args(run, world_size=1)
    assert (
        "the following arguments are required: --hidden-size, --num-attention-heads"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # nothing saved there: Megatron uses the command line's arguments
        parse_args([*run[:-1], str(tmp_path / "empty"), "--use-checkpoint-args"], world_size=1)
    assert "no checkpoint in --load" in caplog.text
    (metadata_path,) = Path(saved).glob("iter_*/metadata.json")
    metadata = json.loads(metadata_path.read_text())
    metadata["args"]["model"]["hidden_size"] = "32"  # a lying file: a string where the flag takes an int
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(SystemExit):
        parse_args([*run, "--use-checkpoint-args"], world_size=1)
    assert f"{metadata_path} records hidden_size='32', not a --hidden-size value" in capsys.readouterr().err
