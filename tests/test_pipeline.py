"""Pipeline parallel: the 1F1B and interleaved schedules equal the unpipelined model (losses and grads).

A stand-in model (a tied input/output projection around a stack of Linear+tanh layers) has the GPT
model's pipeline interface, so the schedules are proven without depending on the real model; a tiny
GPT split into stages then checks the real thing.
The memory that freeing sent outputs saves is measured on a GPT stage driven in one process.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from torch import nn

from megatron_train.models.transformer import get_layer_range
from megatron_train.parallel import schedules, state
from megatron_train.parallel.p2p import P2PCommunicator, PendingExchange, p2p_counters
from megatron_train.parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    pipeline_tensor_shape,
)
from megatron_train.parallel.tied_embeddings import allreduce_embedding_grads, sync_embedding_weights
from tests.helpers.distributed import run_distributed

HIDDEN, SEQ, MICRO_BATCH, NUM_LAYERS = 8, 4, 2, 8
RTOL, ATOL = 1e-5, 1e-7


class StageStack(nn.Module):
    """Layers `layers` of the stand-in model; the first stage embeds (x @ W), the last projects back (h @ W^T)."""

    def __init__(self, layers: range, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=HIDDEN)
        self.layer_ids = list(layers)
        self.pre_process, self.post_process = pre_process, post_process
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in layers)
        for layer_id, layer in zip(layers, self.layers, strict=True):
            generator = torch.Generator().manual_seed(100 + layer_id)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5)
                layer.bias.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
        self.word_embeddings = None
        if pre_process or post_process:
            # The last stage starts from a different value: sync_embedding_weights must copy the first's.
            generator = torch.Generator().manual_seed(0 if pre_process else 1)
            self.word_embeddings = nn.Parameter(
                torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5
            )
            # Tied across stages when split (as GPTModel marks it): parallel.tied_embeddings finds it.
            self.word_embeddings.shared_embedding = not (pre_process and post_process)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        return self.word_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, h] (first stage only); returns [s, b, h] like the GPT model between stages."""
        hidden = (x @ self.word_embeddings).transpose(0, 1) if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden @ self.word_embeddings.t() if self.post_process else hidden

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        grads = {}
        for layer_id, layer in zip(self.layer_ids, self.layers, strict=True):
            grads[f"layer{layer_id}.weight"] = layer.weight.grad
            grads[f"layer{layer_id}.bias"] = layer.bias.grad
        if self.word_embeddings is not None:
            grads["word_embeddings"] = self.word_embeddings.grad
        return grads


def make_batches(num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        {
            "x": torch.randn(MICRO_BATCH, SEQ, HIDDEN, generator=generator),
            "target": torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator),
        }
        for _ in range(num_microbatches)
    ]


def mse_loss(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = ((output - target) ** 2).mean()
    return loss, {"loss": loss.detach()}


def forward_step(data_iterator: Iterator, model: nn.Module):
    batch = next(data_iterator)
    return model(batch["x"]), partial(mse_loss, batch["target"])


def reference(num_microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model in one process, the mean loss over all micro-batches back-propagated at once."""
    model = StageStack(range(NUM_LAYERS), pre_process=True, post_process=True)
    losses = [mse_loss(b["target"], model(b["x"]))[0] for b in make_batches(num_microbatches)]
    torch.stack(losses).mean().backward()
    return [loss.item() for loss in losses], model.named_grads()


class SyncRecorder(nn.Module):
    """A data-parallel-like wrapper: records, at each backward, whether grad reduction was allowed."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.syncing = True
        self.sync_at_backward: list[bool] = []
        first_param = next(module.parameters())
        first_param.register_hook(lambda grad: self.sync_at_backward.append(self.syncing))

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def forward(self, *args):
        return self.module(*args)


class Case(NamedTuple):
    pp: int
    vp: int | None  # None: 1F1B, else interleaved with vp chunks per rank
    num_microbatches: int
    forward_only: bool = False
    loss_scale: float | None = None  # fp16-style: the loss is multiplied before backward
    overlap: bool = True  # 1F1B's steady exchanges posted without waiting (--overlap-p2p-communication)
    deallocate: bool = True  # sent outputs freed (deallocate_output_tensor)


def run_case(case: Case) -> dict:
    """Build this rank's chunks, run one step with the schedule the state picks, return what the test checks."""
    pp, vp, num_microbatches, forward_only, loss_scale, overlap, deallocate = case
    state.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    try:
        pp_rank, num_chunks = state.get_pipeline_model_parallel_rank(), vp or 1
        stages = [
            StageStack(
                get_layer_range(NUM_LAYERS, pp_rank, pp, chunk, vp),
                pre_process=pp_rank == 0 and chunk == 0,
                post_process=pp_rank == pp - 1 and chunk == num_chunks - 1,
            )
            for chunk in range(num_chunks)
        ]
        sync_embedding_weights(stages)
        chunks = [SyncRecorder(stage) for stage in stages]
        iterators = [iter(make_batches(num_microbatches)) for _ in chunks]
        schedule = get_forward_backward_func()
        grad_scale_func = None if loss_scale is None else (lambda loss: loss * loss_scale)
        p2p_counters.reset()
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            losses = schedule(
                forward_step,
                iterators if vp else iterators[0],
                chunks if vp else chunks[0],
                num_microbatches,
                SEQ,
                MICRO_BATCH,
                forward_only=forward_only,
                grad_scale_func=grad_scale_func,
                overlap_p2p_comm=overlap,
                deallocate_pipeline_outputs=deallocate,
            )
        if not forward_only:
            allreduce_embedding_grads(chunks)
        grads = {}
        for stage in stages:
            grads.update(stage.named_grads())
        embeddings = [
            stage.word_embeddings.detach().numpy() for stage in stages if stage.word_embeddings is not None
        ]
        # numpy, not tensors: torch sends tensors between processes as shared memory that dies with the worker
        return {
            "schedule": schedule.__name__,
            "losses": [entry["loss"].item() for entry in losses],
            "grads": {name: None if grad is None else grad.numpy() for name, grad in grads.items()},
            "sync_at_backward": [chunk.sync_at_backward for chunk in chunks],
            "bytes_sent": p2p_counters.bytes_sent,
            "bytes_received": p2p_counters.bytes_received,
            "embedding": embeddings[0] if embeddings else None,
        }
    finally:
        state.destroy_model_parallel()


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    return [run_case(case) for case in cases]


def check_case(results: list[dict], case: Case) -> None:
    """Losses on the last stage, every layer's grad somewhere, tied embedding grads equal on both ends."""
    pp, vp, num_microbatches, forward_only, loss_scale = case[:5]
    loss_scale = loss_scale or 1.0
    ref_losses, ref_grads = reference(num_microbatches)
    schedule = "forward_backward_pipelining_" + ("without" if vp is None else "with") + "_interleaving"
    dp = len(results) // pp
    for rank, result in enumerate(results):
        pp_rank = rank // dp
        assert result["schedule"] == schedule
        if pp_rank == pp - 1:
            torch.testing.assert_close(result["losses"], ref_losses, rtol=RTOL, atol=ATOL)
        else:
            assert result["losses"] == []
        if pp_rank in (0, pp - 1):  # synced tied embedding: the last stage holds the first stage's value
            torch.testing.assert_close(
                torch.from_numpy(result["embedding"]), reference_embedding(), rtol=0, atol=0
            )
        for name, grad in result["grads"].items():
            if forward_only:
                assert grad is None, name
            else:
                grad = torch.from_numpy(grad) / loss_scale
                torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)
        if not forward_only:  # grads reduced over data parallel only in each chunk's last backward
            for recorded in result["sync_at_backward"]:
                assert recorded == [False] * (num_microbatches - 1) + [True]
    covered = set().union(*(result["grads"] for result in results))
    assert covered == set(ref_grads)


def reference_embedding() -> torch.Tensor:
    return StageStack(range(0), pre_process=True, post_process=False).word_embeddings.detach()


TWO_RANK_CASES = [
    Case(2, None, 4),  # 1F1B with a steady phase
    Case(2, None, 1),  # fewer micro-batches than stages: warm-up only
    Case(2, None, 3, loss_scale=8.0),
    Case(2, None, 4, overlap=False, deallocate=False),  # every exchange waited for, outputs kept
    Case(2, 2, 4, deallocate=False),
    Case(2, 2, 4),  # interleaved, 2 chunks per rank
    Case(2, 2, 2),  # interleaved with m == p: everything is warm-up
    Case(2, None, 3, forward_only=True),
    Case(2, 2, 4, forward_only=True),
]


def two_rank_worker(rank: int, world_size: int) -> tuple[list[dict], list[str]]:
    """The two-stage cases, then the misuses below, in one process group."""
    return run_cases(rank, world_size, TWO_RANK_CASES), constraint_errors(rank, world_size)


@pytest.fixture(scope="module")
def two_rank_results() -> list[tuple[list[dict], list[str]]]:
    return run_distributed(two_rank_worker, 2)


@pytest.mark.processes
def test_two_stage_schedules_equal_the_unpipelined_model(two_rank_results):
    all_results = [cases for cases, _ in two_rank_results]
    for i, case in enumerate(TWO_RANK_CASES):
        check_case([ranks[i] for ranks in all_results], case)
    # 1F1B, m = 4: each stage sends one [s, b, h] fp32 tensor per micro-batch (activations / grads), whether
    # the exchanges overlap the compute or are waited for.
    nbytes = SEQ * MICRO_BATCH * HIDDEN * 4
    for blocking in (0, 3):
        assert [ranks[blocking]["bytes_sent"] for ranks in all_results] == [4 * nbytes, 4 * nbytes]
        assert [ranks[blocking]["bytes_received"] for ranks in all_results] == [4 * nbytes, 4 * nbytes]
    # Interleaved, v = 2, m = 4: 3 chunk boundaries crossed both ways; rank 0 sends 2 forward and 1 backward.
    assert [ranks[5]["bytes_sent"] for ranks in all_results] == [12 * nbytes, 12 * nbytes]


FOUR_RANK_CASES = [
    Case(4, None, 6),
    Case(4, None, 2),
    Case(4, 2, 8),
    Case(4, 2, 4),
    Case(4, 2, 4, forward_only=True),
    Case(4, None, 6, overlap=False),
    Case(2, None, 3),  # PP=2 x DP=2: pipeline groups [0, 2] and [1, 3], not neighbours in rank order
    Case(2, 2, 4, loss_scale=4.0),
]


@pytest.mark.processes
def test_four_ranks_pipeline_and_data_parallel_layouts():
    all_results = run_distributed(run_cases, 4, FOUR_RANK_CASES)
    for i, case in enumerate(FOUR_RANK_CASES):
        check_case([ranks[i] for ranks in all_results], case)


def constraint_errors(rank: int, world_size: int) -> list[str]:
    """Each misuse raises before any exchange, on every rank, with a message naming what to change."""
    messages = []
    state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        stages = [StageStack(range(2), rank == 0 and c == 0, rank == 1 and c == 1) for c in range(2)]
        attempts = [
            dict(data_iterator=[iter([]), iter([])], model=stages, num_microbatches=3),
            dict(data_iterator=iter([]), model=stages, num_microbatches=4),
            dict(data_iterator=[iter([])] * 3, model=stages + stages[:1], num_microbatches=4),
        ]
        for attempt in attempts:
            with pytest.raises(ValueError) as error:
                forward_backward_pipelining_with_interleaving(
                    forward_step, seq_length=SEQ, micro_batch_size=1, **attempt
                )
            messages.append(str(error.value))
        if rank == 0:  # a stage output of the wrong shape is refused before it is sent
            comm = P2PCommunicator(pipeline_tensor_shape(SEQ, MICRO_BATCH, HIDDEN), torch.float32)
            with pytest.raises(ValueError) as error:
                comm.send_forward(torch.zeros(MICRO_BATCH, SEQ, HIDDEN))
            messages.append(str(error.value))
    finally:
        state.destroy_model_parallel()
    return messages


@pytest.mark.processes
def test_constraint_errors_name_the_flag_to_change(two_rank_results):
    messages = [errors for _, errors in two_rank_results]
    assert messages[0][:3] == messages[1]
    microbatches, iterators, chunks, shape = messages[0]
    assert "micro-batches (3)" in microbatches and "--pipeline-model-parallel-size (2)" in microbatches
    assert "list of 2 data iterators" in iterators
    assert "3 model chunks" in chunks and "virtual_pipeline_model_parallel_size=3" in chunks
    assert "shape (2, 4, 8)" in shape and "(4, 2, 8)" in shape and "--sequence-parallel" in shape


def test_layer_ranges_follow_megatrons_interleaved_assignment():
    """The model's partition that the schedules rely on: chunk c of rank r is virtual stage c * p + r."""
    chunk_layers = {
        (rank, chunk): list(get_layer_range(8, rank, 2, chunk, 2)) for rank in range(2) for chunk in range(2)
    }
    assert chunk_layers == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}


def test_no_pipelining_in_one_process_matches_reference_and_defers_grad_sync():
    assert not torch.distributed.is_initialized()
    assert get_forward_backward_func() is forward_backward_no_pipelining
    model = SyncRecorder(StageStack(range(NUM_LAYERS), pre_process=True, post_process=True))
    losses = forward_backward_no_pipelining(
        forward_step, iter(make_batches(3)), model, 3, SEQ, MICRO_BATCH, grad_scale_func=lambda loss: 4 * loss
    )
    ref_losses, ref_grads = reference(3)
    torch.testing.assert_close([entry["loss"].item() for entry in losses], ref_losses, rtol=RTOL, atol=ATOL)
    for name, grad in model.module.named_grads().items():
        torch.testing.assert_close(grad / 4, ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    assert model.sync_at_backward == [False, False, True]
    with pytest.raises(ValueError, match="one module, got 2 model chunks"):
        forward_backward_no_pipelining(forward_step, iter([]), [model, model], 1, SEQ, MICRO_BATCH)


# -- the real model: a tiny GPT split into pipeline stages equals the single-process GPT ----------------------

GPT_VOCAB, GPT_SEQ, GPT_MICRO_BATCH, GPT_MICROBATCHES = 128, 16, 2, 4


def gpt_config():
    from megatron_train.models.config import TransformerConfig
    from tests.helpers.tiny import TINY_MODEL

    return TransformerConfig.gpt2(**dict(TINY_MODEL, num_layers=4, seq_length=GPT_SEQ))


def gpt_batches(num_microbatches: int = GPT_MICROBATCHES) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    shape = (num_microbatches, GPT_MICRO_BATCH, GPT_SEQ)
    tokens = torch.randint(0, GPT_VOCAB, shape, generator=generator)
    labels = torch.randint(0, GPT_VOCAB, shape, generator=generator)
    return [{"tokens": t, "labels": lab} for t, lab in zip(tokens, labels, strict=True)]


def gpt_forward_step(data_iterator: Iterator, model: nn.Module):
    batch = next(data_iterator)
    per_token_loss = model(
        batch["tokens"], labels=batch["labels"]
    )  # hidden states [s, b, h] before the last stage
    return per_token_loss, lambda output: (output.mean(), {"lm loss": output.mean().detach()})


def gpt_global_name(stage: nn.Module, name: str) -> str:
    """The single-process model's name for a stage parameter (layers renumbered, tied output = embedding)."""
    if name.startswith("decoder.layers."):
        local, rest = name.removeprefix("decoder.layers.").split(".", 1)
        return f"decoder.layers.{stage.decoder.layer_range[int(local)]}.{rest}"
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" else name


def tp_split(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's shard of a full tensor, laid out as the model shards it (stride interleaved chunks)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    world, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    pieces = torch.split(
        full, full.shape[param.partition_dim] // (world * param.partition_stride), param.partition_dim
    )
    return torch.cat(pieces[rank::world], dim=param.partition_dim)


def tp_gather(shard: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The inverse of tp_split over the TP group."""
    if not getattr(param, "tensor_model_parallel", False):
        return shard
    world = state.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(shard) for _ in range(world)]
    torch.distributed.all_gather(shards, shard.contiguous(), group=state.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, param.partition_stride
    per_rank = [s.chunk(stride, dim) for s in shards]
    return torch.cat([per_rank[r][j] for j in range(stride) for r in range(world)], dim=dim)


def run_gpt_case(
    full_state: dict, ref_grads: dict, tp: int, pp: int, vp: int | None, sequence_parallel: bool, ddp: bool
) -> dict:
    """One step of this rank's stages; grads are checked here, so what travels back stays small."""
    from megatron_train.distributed import finalize_model_grads
    from megatron_train.distributed.ddp import DDPConfig, DistributedDataParallel
    from megatron_train.models.gpt import GPTModel
    from megatron_train.parallel.layers import allreduce_sequence_parallel_grads

    state.initialize_model_parallel(tp, pp, vp)
    try:
        pp_rank, num_chunks = state.get_pipeline_model_parallel_rank(), vp or 1
        stages = []
        for chunk in range(num_chunks):
            stage = GPTModel(
                gpt_config(),
                GPT_VOCAB,
                pre_process=pp_rank == 0 and chunk == 0,
                post_process=pp_rank == pp - 1 and chunk == num_chunks - 1,
                sequence_parallel=sequence_parallel,
                vp_stage=chunk,
            )
            with torch.no_grad():
                for name, param in stage.named_parameters():
                    if name != "output_layer.weight":  # the tied copy: sync_embedding_weights fills it
                        full = torch.from_numpy(full_state[gpt_global_name(stage, name)])
                        param.copy_(tp_split(full, param))
            stages.append(stage)
        sync_embedding_weights(stages)
        data_parallel = partial(
            DistributedDataParallel, config=DDPConfig(), data_parallel_group=state.get_data_parallel_group()
        )
        chunks = [data_parallel(stage) for stage in stages] if ddp else stages
        losses = get_forward_backward_func()(
            gpt_forward_step,
            [iter(gpt_batches()) for _ in chunks] if vp else iter(gpt_batches()),
            chunks if vp else chunks[0],
            GPT_MICROBATCHES,
            GPT_SEQ,
            GPT_MICRO_BATCH,
            sequence_parallel=sequence_parallel,
        )
        if ddp:  # grads in param.main_grad, averaged over the DP replicas
            finalize_model_grads(chunks)
        else:
            for stage in stages:
                allreduce_sequence_parallel_grads(stage)
            allreduce_embedding_grads(stages)
        checked = []
        for stage in stages:
            for name, param in stage.named_parameters():
                global_name = gpt_global_name(stage, name)
                torch.testing.assert_close(
                    tp_gather(param.main_grad if ddp else param.grad, param),
                    torch.from_numpy(ref_grads[global_name]),
                    rtol=RTOL,
                    atol=1e-6,
                    msg=lambda m, n=global_name: (
                        f"tp={tp} pp={pp} vp={vp} sp={sequence_parallel} ddp={ddp} {n}: {m}"
                    ),
                )
                checked.append(global_name)
        return {"losses": [entry["lm loss"].item() for entry in losses], "checked": checked}
    finally:
        state.destroy_model_parallel()


def run_gpt_cases(
    rank: int, world_size: int, full_state: dict, ref_grads: dict, cases: list[tuple]
) -> list[dict]:
    return [run_gpt_case(full_state, ref_grads, *case) for case in cases]


GPT_CASES = [  # (tp, pp, vp, sequence_parallel, ddp) on 4 ranks
    (1, 2, None, False, True),  # PP=2 x DP=2, grads reduced by our DDP wrapper (no_sync until the last)
    (1, 2, 2, False, True),  # PP=2 x v=2 x DP=2
    (2, 2, None, True, False),  # TP=2 with sequence parallel x PP=2: stages exchange [s / 2, b, h]
    (2, 2, 2, True, False),
]


@pytest.mark.processes
def test_tiny_gpt_split_into_stages_equals_the_single_process_gpt():
    from megatron_train.models.gpt import GPTModel

    torch.manual_seed(0)
    model = GPTModel(gpt_config(), GPT_VOCAB)
    losses = [model(b["tokens"], labels=b["labels"]).mean() for b in gpt_batches()]
    torch.stack(losses).mean().backward()
    full_state = {name: param.detach().numpy() for name, param in model.named_parameters()}
    ref_grads = {name: param.grad.numpy() for name, param in model.named_parameters()}

    all_results = run_distributed(run_gpt_cases, 4, full_state, ref_grads, GPT_CASES, timeout=150)
    for i, (_, pp, *_) in enumerate(GPT_CASES):
        results = [ranks[i] for ranks in all_results]
        ranks_per_stage = len(results) // pp
        for rank, result in enumerate(results):
            if rank // ranks_per_stage == pp - 1:
                torch.testing.assert_close(
                    result["losses"], [loss.item() for loss in losses], rtol=RTOL, atol=ATOL
                )
            else:
                assert result["losses"] == []
        # every grad was checked on some stage, the tied embedding's on the first and on the last
        checked = [name for result in results for name in result["checked"]]
        assert set(checked) == set(ref_grads)
        assert checked.count("embedding.word_embeddings.weight") == 2 * ranks_per_stage


# -- pipeline activation memory: what deallocate_output_tensor frees, measured ---------------------------------


class FirstOfFourStages(P2PCommunicator):
    """Stage 0 of 4 without processes: every exchange goes through `post`, which takes the output sent on and
    hands back a gradient for it. It records each sent output and, when that output's backward starts, the
    bytes the stage's outputs still hold (their original storages, and the current one of each output alive)."""

    def __init__(self, tensor_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.is_first_stage, self.is_last_stage = True, False
        self.sent: list[tuple[weakref.ref, weakref.ref]] = []  # (output tensor, its storage when sent)
        self.samples: list[tuple[int, int]] = []  # (outputs alive, bytes they hold) as each backward starts

    def post(self, tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=False):
        if tensor_send_next is not None:
            self.sent.append((weakref.ref(tensor_send_next), weakref.ref(tensor_send_next.untyped_storage())))
            tensor_send_next.grad_fn.register_prehook(lambda grad_outputs: self.sample())
        grad = torch.ones(self.tensor_shape, dtype=self.dtype) if recv_next else None
        return PendingExchange([], None, grad, [])

    def sample(self) -> None:
        outputs = [tensor for tensor_ref, _ in self.sent if (tensor := tensor_ref()) is not None]
        storages = [storage_ref() for _, storage_ref in self.sent] + [t.untyped_storage() for t in outputs]
        held = {storage.data_ptr(): storage.nbytes() for storage in storages if storage is not None}
        self.samples.append((len(outputs), sum(held.values())))


def test_deallocating_sent_outputs_frees_the_in_flight_activations_of_a_gpt_stage(monkeypatch):
    """1F1B on the first of 4 stages of the tiny GPT (one process, the p2p faked): with 6 micro-batches, 4 are in
    flight at the peak; keeping their outputs holds 4 x [s, b, h] x 4 bytes, deallocating holds one element each
    (Megatron's figure), and the grads are the same."""
    monkeypatch.setattr(state, "get_pipeline_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(state, "get_pipeline_model_parallel_rank", lambda: 0)
    stages = {}
    monkeypatch.setattr(schedules, "P2PCommunicator", lambda shape, dtype: stages.setdefault(
        "comm", FirstOfFourStages(shape, dtype)))  # fmt: skip
    from megatron_train.models.gpt import GPTModel

    shape = (GPT_SEQ, GPT_MICRO_BATCH, gpt_config().hidden_size)
    peaks, grads = {}, {}
    for deallocate in (False, True):
        torch.manual_seed(0)
        stage = GPTModel(gpt_config(), GPT_VOCAB, pre_process=True, post_process=False)
        stages.clear()
        forward_backward_pipelining_without_interleaving(
            gpt_forward_step, iter(gpt_batches(6)), stage, 6, GPT_SEQ, GPT_MICRO_BATCH,
            tensor_shape=shape, deallocate_pipeline_outputs=deallocate,
        )  # fmt: skip
        samples = stages["comm"].samples
        assert [alive for alive, _ in samples] == [4, 4, 4, 3, 2, 1]  # 3 warm-up forwards, then 1F1B
        peaks[deallocate] = samples[0][1]
        grads[deallocate] = {name: param.grad.clone() for name, param in stage.named_parameters()}
    in_flight, elements, itemsize = 4, GPT_SEQ * GPT_MICRO_BATCH * shape[2], torch.float32.itemsize
    assert peaks == {False: in_flight * elements * itemsize, True: in_flight * itemsize}
    assert peaks[False] - peaks[True] == in_flight * (elements - 1) * itemsize  # 16,368 of 16,384 bytes
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=0, atol=0, msg=name)
