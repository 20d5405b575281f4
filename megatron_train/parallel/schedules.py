"""Forward and backward over the micro-batches of one step (Megatron-Core's `pipeline_parallel/schedules.py`).

`get_forward_backward_func()` picks one of three schedules from the parallel state:
- `forward_backward_no_pipelining`: each micro-batch forward then backward; grads accumulate.
- `forward_backward_pipelining_without_interleaving` (1F1B): warm-up forwards, then one forward and one
  backward in turn, then cool-down backwards. A stage keeps at most p micro-batches' activations alive;
  the idle "bubble" costs (p - 1) / m of the ideal step time (p stages, m micro-batches).
- `forward_backward_pipelining_with_interleaving`: each rank holds v model chunks (virtual stages),
  chunk c of rank r being virtual stage c * p + r; the bubble shrinks to (p - 1) / (v * m) for v times the
  p2p traffic.

The pipelined schedules free each output once it is sent (Megatron's `deallocate_output_tensor`: only its
grad_fn is needed for the backward, which `_backward_step` then runs without comparing shapes), and 1F1B posts
its steady-state exchanges without waiting (`overlap_p2p_comm`, Megatron's --overlap-p2p-communication): the
next micro-batch's input is received while the backward runs and the input gradient is sent while the next
forward runs. The interleaved schedule's exchanges stay blocking.

All share Megatron's signature and contract. `forward_step_func(data_iterator, model)` returns
`(output_tensor, loss_func)`; on the last stage `loss_func(output_tensor)` returns `(loss, reduced)`, where
`reduced` is a dict of detached values for logging. The loss is divided by `num_microbatches` before backward,
so the accumulated grads are the mean over micro-batches. Each schedule returns the `reduced` dicts (one per
micro-batch) on the last pipeline stage and `[]` elsewhere. Stages exchange activations of shape
[seq, micro_batch, hidden] (seq / TP under sequence parallel) in the model's parameter dtype.

Data-parallel wrappers (anything with `no_sync()`) reduce grads only during each chunk's last backward. The
pipelined schedules release `no_sync()` just before that backward, which suits our DDP (it decides per backward)
but not torch's (it decides at forward time; arguments.py refuses it with pipelining); without pipelining the
last micro-batch's forward and backward both run outside `no_sync()`, so torch's DDP works there too.

One module, over 400 lines, on purpose: the three schedules share their step helpers and are read side by side
(as Megatron-Core keeps them in one file); splitting them would scatter one algorithm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from megatron_train.parallel import state
from megatron_train.parallel.p2p import P2PCommunicator, PendingExchange

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]
ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, LossFunc]]
GradScaleFunc = Callable[[torch.Tensor], torch.Tensor]


def get_forward_backward_func() -> Callable[..., list[dict[str, Any]]]:
    """The schedule matching the parallel state: no pipelining, 1F1B, or interleaved 1F1B."""
    if state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    if state.get_virtual_pipeline_model_parallel_world_size() is not None:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def pipeline_tensor_shape(
    seq_length: int, micro_batch_size: int, hidden_size: int, sequence_parallel: bool = False
) -> tuple[int, int, int]:
    """[seq, micro_batch, hidden] exchanged between stages; context parallelism leaves seq / CP on each rank,
    sequence parallel a further 1 / TP of that."""
    seq_length //= state.get_context_parallel_world_size()
    if sequence_parallel:
        tp_size = state.get_tensor_model_parallel_world_size()
        if seq_length % tp_size:
            raise ValueError(
                f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size {tp_size}, "
                "which --sequence-parallel requires"
            )
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


def forward_backward_no_pipelining(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator],
    model: nn.Module | list[nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    *,
    tensor_shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    grad_scale_func: GradScaleFunc | None = None,
    overlap_p2p_comm: bool = True,
    deallocate_pipeline_outputs: bool = True,
) -> list[dict[str, Any]]:
    """Run every micro-batch forward then backward on the whole model (the shape arguments are unused).

    As Megatron-Core: all micro-batches but the last run inside `no_sync()`, the last one's forward and
    backward outside it, since torch's DDP decides at forward time whether the backward reduces grads.
    """
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"without pipelining the model is one module, got {len(chunks)} model chunks")
    (chunk,) = chunks
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    losses: list[dict[str, Any]] = []

    def forward_backward() -> None:
        output_tensor = _forward_step(
            forward_step_func, iterator, chunk, None, num_microbatches, True, losses
        )
        if not forward_only:
            _backward_step(None, output_tensor, None, grad_scale_func)

    no_sync = getattr(chunk, "no_sync", None)
    with no_sync() if no_sync is not None and not forward_only else contextlib.nullcontext():
        for _ in range(num_microbatches - 1):
            forward_backward()
    forward_backward()
    return losses


def forward_backward_pipelining_without_interleaving(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator],
    model: nn.Module | list[nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    *,
    tensor_shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    grad_scale_func: GradScaleFunc | None = None,
    overlap_p2p_comm: bool = True,
    deallocate_pipeline_outputs: bool = True,
) -> list[dict[str, Any]]:
    """1F1B: stage r runs p - r - 1 warm-up forwards, alternates forward and backward, then drains backwards."""
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"the 1F1B schedule runs one model chunk per stage, got {len(chunks)}; for several chunks "
            "initialise the parallel state with virtual_pipeline_model_parallel_size (interleaved schedule)"
        )
    (chunk,) = chunks
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    comm = _communicator(chunk, seq_length, micro_batch_size, tensor_shape, dtype, sequence_parallel)
    pp_size, pp_rank = (
        state.get_pipeline_model_parallel_world_size(),
        state.get_pipeline_model_parallel_rank(),
    )
    num_warmup = num_microbatches if forward_only else min(pp_size - pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup

    losses: list[dict[str, Any]] = []
    input_tensors: list[torch.Tensor | None] = []  # activations alive for backward, oldest first
    output_tensors: list[torch.Tensor] = []

    def forward(input_tensor: torch.Tensor | None) -> torch.Tensor:
        return _forward_step(
            forward_step_func, iterator, chunk, input_tensor, num_microbatches, comm.is_last_stage, losses
        )

    def backward(output_tensor_grad: torch.Tensor | None) -> torch.Tensor | None:
        grad_sync.before_backward(0)
        return _backward_step(
            input_tensors.pop(0), output_tensors.pop(0), output_tensor_grad, grad_scale_func
        )

    def sent(output_tensor: torch.Tensor) -> None:
        if deallocate_pipeline_outputs and not comm.is_last_stage:
            deallocate_output_tensor(output_tensor)

    sends_in_flight: list[PendingExchange] = []
    with _DeferredGradSync(chunks, num_microbatches, enabled=not forward_only) as grad_sync:
        for _ in range(num_warmup):
            input_tensor = comm.recv_forward()
            output_tensor = forward(input_tensor)
            comm.send_forward(output_tensor)
            if not forward_only:
                input_tensors.append(input_tensor)
                output_tensors.append(output_tensor)
                sent(output_tensor)

        input_tensor = comm.recv_forward() if num_steady else None
        for i in range(num_steady):
            last_iteration = i == num_steady - 1
            output_tensor = forward(input_tensor)
            if forward_only:
                comm.send_forward(output_tensor)
                input_tensor = None if last_iteration else comm.recv_forward()
                continue
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            if overlap_p2p_comm:
                # post the output, its gradient's receive and the next input's receive at once; the next input
                # arrives while the backward runs, the input gradient leaves while the next forward runs
                to_next = comm.post(tensor_send_next=None if comm.is_last_stage else output_tensor,
                                    recv_next=not comm.is_last_stage)  # fmt: skip
                from_prev = comm.post(recv_prev=not (last_iteration or comm.is_first_stage))
                output_tensor_grad = to_next.wait()[1]
                sent(output_tensor)
                input_tensor_grad = backward(output_tensor_grad)
                if not comm.is_first_stage:
                    sends_in_flight.append(comm.post(tensor_send_prev=input_tensor_grad))
                input_tensor = from_prev.wait()[0]
                continue
            output_tensor_grad = comm.send_forward_recv_backward(output_tensor)
            sent(output_tensor)
            input_tensor_grad = backward(output_tensor_grad)
            if last_iteration:
                comm.send_backward(input_tensor_grad)
            else:
                input_tensor = comm.send_backward_recv_forward(input_tensor_grad)

        if not forward_only:
            for _ in range(num_warmup):
                output_tensor_grad = comm.recv_backward()
                comm.send_backward(backward(output_tensor_grad))
        for pending in sends_in_flight:
            pending.wait()
    return losses


def forward_backward_pipelining_with_interleaving(
    forward_step_func: ForwardStepFunc,
    data_iterator: list[Iterator],
    model: list[nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    *,
    tensor_shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    grad_scale_func: GradScaleFunc | None = None,
    overlap_p2p_comm: bool = True,
    deallocate_pipeline_outputs: bool = True,
) -> list[dict[str, Any]]:
    """Interleaved 1F1B over v model chunks per rank, in Megatron's order.

    Micro-batches run in groups of p: forward k goes through chunk (k mod p*v) // p, backward k through the
    same sequence reversed. `data_iterator` and `model` are lists with one entry per chunk.
    """
    chunks = _as_chunks(model)
    num_chunks = len(chunks)
    pp_size, pp_rank = (
        state.get_pipeline_model_parallel_world_size(),
        state.get_pipeline_model_parallel_rank(),
    )
    _check_interleaving(num_chunks, data_iterator, num_microbatches, pp_size)
    comm = _communicator(chunks[0], seq_length, micro_batch_size, tensor_shape, dtype, sequence_parallel)

    total = num_microbatches * num_chunks
    all_warmup = not forward_only and num_microbatches == pp_size
    if forward_only or all_warmup:
        num_warmup = total
    else:
        num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    num_steady = total - num_warmup

    losses: list[dict[str, Any]] = []
    input_tensors: list[list[torch.Tensor | None]] = [[] for _ in chunks]
    output_tensors: list[list[torch.Tensor]] = [[] for _ in chunks]
    output_tensor_grads: list[list[torch.Tensor | None]] = [[] for _ in chunks]

    def chunk_id(k: int, forward: bool) -> int:
        chunk = (k % (pp_size * num_chunks)) // pp_size
        return chunk if forward else num_chunks - 1 - chunk

    def is_first_chunk(chunk: int) -> bool:  # virtual stage 0: reads the data
        return pp_rank == 0 and chunk == 0

    def is_last_chunk(chunk: int) -> bool:  # virtual stage p * v - 1: computes the loss
        return pp_rank == pp_size - 1 and chunk == num_chunks - 1

    def forward(k: int) -> torch.Tensor:
        chunk = chunk_id(k, forward=True)
        if is_first_chunk(chunk) and len(input_tensors[chunk]) == len(output_tensors[chunk]):
            input_tensors[chunk].append(None)
        output_tensor = _forward_step(
            forward_step_func,
            data_iterator[chunk],
            chunks[chunk],
            input_tensors[chunk][-1],
            num_microbatches,
            is_last_chunk(chunk),
            losses,
        )
        output_tensors[chunk].append(output_tensor)
        if forward_only:
            input_tensors[chunk].pop()
            output_tensors[chunk].pop()
        return output_tensor

    def backward(k: int) -> torch.Tensor | None:
        chunk = chunk_id(k, forward=False)
        if is_last_chunk(chunk) and not output_tensor_grads[chunk]:
            output_tensor_grads[chunk].append(None)
        grad_sync.before_backward(chunk)
        return _backward_step(
            input_tensors[chunk].pop(0),
            output_tensors[chunk].pop(0),
            output_tensor_grads[chunk].pop(0),
            grad_scale_func,
        )

    with _DeferredGradSync(chunks, num_microbatches, enabled=not forward_only) as grad_sync:
        input_tensors[0].append(comm.recv_forward())
        for k in range(num_warmup):
            output_tensor = forward(k)
            next_chunk = chunk_id(k + 1, forward=True)
            recv_prev = not (pp_rank == 0 and next_chunk == 0) and k != total - 1
            if is_last_chunk(chunk_id(k, forward=True)):
                output_tensor = None
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                # The last warm-up forward also fetches the first steady backward's gradient.
                recv_next = pp_rank != pp_size - 1
                input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
                    output_tensor, None, recv_prev=recv_prev, recv_next=recv_next
                )
                output_tensor_grads[num_chunks - 1].append(output_tensor_grad)
            else:
                input_tensor = comm.send_forward_recv_forward(output_tensor, recv_prev=recv_prev)
            input_tensors[next_chunk].append(input_tensor)
            if deallocate_pipeline_outputs and not forward_only:
                deallocate_output_tensor(output_tensor)

        for i in range(num_steady):
            forward_k, backward_k = i + num_warmup, i
            output_tensor = forward(forward_k)
            input_tensor_grad = backward(backward_k)
            if is_last_chunk(chunk_id(forward_k, forward=True)):
                output_tensor = None  # the loss stays here

            # Where the tensors received now belong: the first rank runs p - 1 micro-batches ahead of
            # the last, so what it receives from the last rank is for a later chunk, and vice versa.
            if pp_rank == 0:
                next_forward_chunk = chunk_id(forward_k - (pp_size - 1), forward=True)
                recv_prev = next_forward_chunk != num_chunks - 1
                next_forward_chunk += 1
            else:
                next_forward_chunk = chunk_id(forward_k + 1, forward=True)
                recv_prev = True
            if pp_rank == pp_size - 1:
                next_backward_chunk = chunk_id(backward_k - (pp_size - 1), forward=False)
                recv_next = next_backward_chunk != 0
                next_backward_chunk -= 1
            else:
                next_backward_chunk = chunk_id(backward_k + 1, forward=False)
                recv_next = True
            if i == num_steady - 1:
                recv_prev = False  # the last forward's input was already received

            input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
                output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next
            )
            if deallocate_pipeline_outputs:
                deallocate_output_tensor(output_tensor)
            if recv_prev:
                input_tensors[next_forward_chunk].append(input_tensor)
            if recv_next:
                output_tensor_grads[next_backward_chunk].append(output_tensor_grad)

        if not forward_only:
            if all_warmup:
                output_tensor_grads[num_chunks - 1].append(comm.recv_backward())
            for k in range(num_steady, total):
                input_tensor_grad = backward(k)
                next_backward_chunk = chunk_id(k + 1, forward=False)
                recv_next = not (pp_rank == pp_size - 1 and next_backward_chunk == num_chunks - 1)
                recv_next = recv_next and k != total - 1
                output_tensor_grads[next_backward_chunk].append(
                    comm.send_backward_recv_backward(input_tensor_grad, recv_next=recv_next)
                )
    return losses


# -- helpers -------------------------------------------------------------------------------------------------


class _DeferredGradSync:
    """Hold each chunk's data-parallel grad reduction (`no_sync()`) until its last micro-batch's backward,
    as Megatron does, so grads are reduced once per step and not once per micro-batch."""

    def __init__(self, chunks: list[nn.Module], num_microbatches: int, enabled: bool) -> None:
        self.num_microbatches = num_microbatches
        self.backwards_done = [0] * len(chunks)
        self.open: dict[int, contextlib.AbstractContextManager] = {}
        if enabled:
            for i, chunk in enumerate(chunks):
                no_sync = getattr(chunk, "no_sync", None)
                if no_sync is not None:
                    self.open[i] = no_sync()

    def __enter__(self) -> _DeferredGradSync:
        for context in self.open.values():
            context.__enter__()
        return self

    def before_backward(self, chunk: int) -> None:
        self.backwards_done[chunk] += 1
        if self.backwards_done[chunk] == self.num_microbatches and chunk in self.open:
            self.open.pop(chunk).__exit__(None, None, None)

    def __exit__(self, *exc_info: object) -> None:
        for context in self.open.values():
            context.__exit__(*exc_info)
        self.open.clear()


def _as_chunks(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, list | tuple) else [model]


def _unwrapped_attr(model: nn.Module, name: str) -> Any:
    """`name` on `model` or on the module a wrapper (DDP, fp16) holds as `.module`."""
    while not hasattr(model, name):
        if not hasattr(model, "module"):
            raise AttributeError(
                f"{type(model).__name__} (and any module it wraps) has no attribute {name!r}"
            )
        model = model.module
    return getattr(model, name)


def _hidden_size(model: nn.Module) -> int:
    """`config.hidden_size` of the model, looking through wrappers (whose own `config` may be another kind)."""
    while getattr(getattr(model, "config", None), "hidden_size", None) is None:
        if not hasattr(model, "module"):
            raise ValueError(
                "cannot tell the pipeline activation shape: pass tensor_shape=(seq, micro_batch, hidden) "
                "or give the model chunk a `config` with `hidden_size`"
            )
        model = model.module
    return model.config.hidden_size


def _communicator(
    chunk: nn.Module,
    seq_length: int,
    micro_batch_size: int,
    tensor_shape: tuple[int, ...] | None,
    dtype: torch.dtype | None,
    sequence_parallel: bool,
) -> P2PCommunicator:
    """The exchange for this step: shape from the model's hidden size unless given, dtype the parameters'."""
    if tensor_shape is None:
        tensor_shape = pipeline_tensor_shape(
            seq_length, micro_batch_size, _hidden_size(chunk), sequence_parallel
        )
    if dtype is None:
        dtype = next(chunk.parameters()).dtype
    return P2PCommunicator(tensor_shape, dtype)


def _check_interleaving(
    num_chunks: int, data_iterator: Iterator | list[Iterator], num_microbatches: int, pp_size: int
) -> None:
    """Megatron's preconditions for the interleaved schedule, as errors that say what to change."""
    virtual_size = state.get_virtual_pipeline_model_parallel_world_size()
    if virtual_size != num_chunks:
        raise ValueError(
            f"the interleaved schedule got {num_chunks} model chunks but the parallel state has virtual "
            f"pipeline size {virtual_size}; pass virtual_pipeline_model_parallel_size={num_chunks} to "
            "initialize_model_parallel and build one chunk per virtual stage"
        )
    if not isinstance(data_iterator, list | tuple) or len(data_iterator) != num_chunks:
        raise ValueError(
            f"the interleaved schedule needs a list of {num_chunks} data iterators, one per model chunk "
            "(chunks read data independently on the first and last stage)"
        )
    if num_microbatches % pp_size:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a "
            f"multiple of --pipeline-model-parallel-size ({pp_size}); change --global-batch-size or "
            "--micro-batch-size"
        )


def _forward_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: nn.Module,
    input_tensor: torch.Tensor | None,
    num_microbatches: int,
    is_last_stage: bool,
    losses: list[dict[str, Any]],
) -> torch.Tensor:
    """One chunk forward: the stage output, or on the last stage the loss / num_microbatches."""
    _unwrapped_attr(model, "set_input_tensor")(input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output_tensor
    outputs = loss_func(output_tensor)
    if not (isinstance(outputs, tuple) and len(outputs) == 2):
        raise TypeError(f"loss_func must return (loss, reduced_dict), got {type(outputs).__name__}")
    loss, reduced = outputs
    losses.append(reduced)
    return loss / num_microbatches


def deallocate_output_tensor(output_tensor: torch.Tensor | None) -> None:
    """Megatron's `deallocate_output_tensor`: once a stage's output is sent on, the backward needs only its
    grad_fn, so its data becomes one element (a view keeps its base alive anyway: left as it is)."""
    if output_tensor is None or output_tensor._base is not None:
        return
    output_tensor.data = torch.empty((1,), device=output_tensor.device, dtype=output_tensor.dtype)


def _backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    grad_scale_func: GradScaleFunc | None,
) -> torch.Tensor | None:
    """One chunk backward; returns the gradient of its input (None on the first stage). The autograd engine is
    called directly (Megatron's `custom_backward`): a deallocated output no longer has its gradient's shape."""
    if output_tensor_grad is None and grad_scale_func is not None:  # the loss: scale it (fp16)
        output_tensor = grad_scale_func(output_tensor)
    if output_tensor_grad is None:
        torch.autograd.backward(output_tensor)
    else:
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=(output_tensor,), grad_tensors=(output_tensor_grad,), keep_graph=False, create_graph=False,
            inputs=(), allow_unreachable=True, accumulate_grad=True,
        )  # fmt: skip
    if input_tensor is None:
        return None
    if input_tensor.grad is None:
        raise RuntimeError(
            f"pipeline stage {state.get_pipeline_model_parallel_rank()}: the received input activation got "
            "no gradient; the model chunk must use the tensor given to set_input_tensor() when pre_process "
            "is False"
        )
    return input_tensor.grad
