"""Point-to-point exchange between adjacent pipeline stages (Megatron-Core's `p2p_communication`).

Activations travel forward (to the next stage) and their gradients backward (to the previous stage)
as tensors of one fixed shape, [seq, micro_batch, hidden] (seq / TP under sequence parallel). Every
exchange is one batch of isend/irecv ops on the pipeline group (Megatron's batched p2p): `exchange` waits for
it before returning; `post` returns it in flight (`PendingExchange`), so a schedule overlaps the transfer with
the next compute and waits only when it needs what it receives.

Neighbours wrap around the ring (the last stage's "next" is the first stage), which is what the
interleaved schedule needs: chunk c on the last stage feeds chunk c + 1 on the first stage.

Two messages can travel between the same pair of ranks in one exchange (with 2 stages, "next" and
"prev" are the same rank), so forward and backward messages carry different tags (gloo matches on
them) and every rank issues its ops in the same order, forward direction first (NCCL ignores tags
and matches in issue order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.parallel import state

_FORWARD_TAG = 0  # activations, stage i -> stage i + 1
_BACKWARD_TAG = 1  # activation gradients, stage i + 1 -> stage i


@dataclass
class PendingExchange:
    """Sends and receives posted together and not yet waited for. `wait()` returns (tensor_recv_prev,
    tensor_recv_next); the tensors being sent stay referenced until then, so a schedule may free the outputs they
    came from at once (`schedules.deallocate_output_tensor`)."""

    requests: list
    recv_prev: torch.Tensor | None
    recv_next: torch.Tensor | None
    sending: list[torch.Tensor]

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for request in self.requests:
            request.wait()
        self.requests, self.sending = [], []
        return self.recv_prev, self.recv_next


@dataclass
class P2PCounters:
    """Bytes this process sent and received over pipeline p2p since the last `reset()` (benchmarks read it)."""

    bytes_sent: int = 0
    bytes_received: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


p2p_counters = P2PCounters()


class P2PCommunicator:
    """Megatron's named exchanges between this rank and its pipeline neighbours, for one tensor shape.

    The 1F1B ops (`recv_forward`, `send_forward`, ...) skip what the first or last stage has no peer for
    (they return None there); the interleaved ops take explicit `recv_prev` / `recv_next` flags because
    whether a chunk receives depends on the schedule, not only on the rank.
    """

    def __init__(self, tensor_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None):
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device or get_device()
        self.group = state.get_pipeline_model_parallel_group()
        ranks = state.get_pipeline_model_parallel_ranks()
        me = state.get_pipeline_model_parallel_rank()
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        self.is_first_stage = me == 0
        self.is_last_stage = me == len(ranks) - 1

    # -- non-interleaved (1F1B) ops: the pipeline ends have no peer on one side --------------------------

    def recv_forward(self) -> torch.Tensor | None:
        """This stage's input activation from the previous stage (None on the first stage)."""
        if self.is_first_stage:
            return None
        return self.exchange(recv_prev=True)[0]

    def recv_backward(self) -> torch.Tensor | None:
        """The gradient of this stage's output from the next stage (None on the last stage)."""
        if self.is_last_stage:
            return None
        return self.exchange(recv_next=True)[1]

    def send_forward(self, output_tensor: torch.Tensor | None) -> None:
        """This stage's output activation to the next stage (nothing on the last stage)."""
        if not self.is_last_stage:
            self.exchange(tensor_send_next=output_tensor)

    def send_backward(self, input_tensor_grad: torch.Tensor | None) -> None:
        """The gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if not self.is_first_stage:
            self.exchange(tensor_send_prev=input_tensor_grad)

    def send_forward_recv_backward(self, output_tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Send this output forward and receive its gradient, in one exchange (None on the last stage)."""
        if self.is_last_stage:
            return None
        return self.exchange(tensor_send_next=output_tensor, recv_next=True)[1]

    def send_backward_recv_forward(self, input_tensor_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Send an input gradient back and receive the next input activation (None on the first stage)."""
        if self.is_first_stage:
            return None
        return self.exchange(tensor_send_prev=input_tensor_grad, recv_prev=True)[0]

    # -- interleaved ops: the caller says which directions carry data ------------------------------------

    def send_forward_recv_forward(
        self, output_tensor: torch.Tensor | None, recv_prev: bool
    ) -> torch.Tensor | None:
        """Send an output forward; receive the next chunk's input from the previous rank if `recv_prev`."""
        return self.exchange(tensor_send_next=output_tensor, recv_prev=recv_prev)[0]

    def send_backward_recv_backward(
        self, input_tensor_grad: torch.Tensor | None, recv_next: bool
    ) -> torch.Tensor | None:
        """Send an input gradient back; receive an output gradient from the next rank if `recv_next`."""
        return self.exchange(tensor_send_prev=input_tensor_grad, recv_next=recv_next)[1]

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor | None,
        input_tensor_grad: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both directions at once (the steady 1F1B phase): returns (next input, next output gradient)."""
        return self.exchange(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
        )

    # -- the one primitive ---------------------------------------------------------------------------------

    def exchange(
        self,
        tensor_send_next: torch.Tensor | None = None,
        tensor_send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send to / receive from both neighbours at once and wait; returns (tensor_recv_prev, tensor_recv_next).

        A received activation requires grad: it is the next chunk's input, whose gradient goes back.
        """
        return self.post(tensor_send_next, tensor_send_prev, recv_prev, recv_next).wait()

    def post(
        self,
        tensor_send_next: torch.Tensor | None = None,
        tensor_send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> PendingExchange:
        """`exchange` without the wait: the batch in flight, to `wait()` for when its tensors are needed."""
        if tensor_send_next is not None:
            tensor_send_next = self._outgoing("output activation", tensor_send_next)
        if tensor_send_prev is not None:
            tensor_send_prev = self._outgoing("input gradient", tensor_send_prev)
        tensor_recv_prev = self._empty(requires_grad=True) if recv_prev else None
        tensor_recv_next = self._empty(requires_grad=False) if recv_next else None
        # Forward direction first, then backward: the same order on every rank (see the module docstring).
        ops = [
            (dist.isend, tensor_send_next, self.next_rank, _FORWARD_TAG),
            (dist.irecv, tensor_recv_prev, self.prev_rank, _FORWARD_TAG),
            (dist.isend, tensor_send_prev, self.prev_rank, _BACKWARD_TAG),
            (dist.irecv, tensor_recv_next, self.next_rank, _BACKWARD_TAG),
        ]
        p2p_ops = [
            dist.P2POp(op, tensor, peer, self.group, tag)
            for op, tensor, peer, tag in ops
            if tensor is not None
        ]
        requests = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
        for op, tensor, _, _ in ops:
            if tensor is not None:
                nbytes = tensor.numel() * tensor.element_size()
                if op is dist.isend:
                    p2p_counters.bytes_sent += nbytes
                else:
                    p2p_counters.bytes_received += nbytes
        sending = [t for t in (tensor_send_next, tensor_send_prev) if t is not None]
        return PendingExchange(requests, tensor_recv_prev, tensor_recv_next, sending)

    def _empty(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(
            self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad
        )

    def _outgoing(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The bytes to send; a shape or dtype mismatch would make the peer hang or read garbage, so fail here."""
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline stage {state.get_pipeline_model_parallel_rank()} tried to send an {name} of shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype}, but the schedule exchanges "
                f"{self.tensor_shape} {self.dtype} ([seq, micro_batch, hidden], seq divided by the TP size "
                "under sequence parallel); check --seq-length, --micro-batch-size, --hidden-size, "
                "--sequence-parallel and that every stage returns activations in [s, b, h] layout"
            )
        return tensor.detach().contiguous()
