"""Training metrics out: Megatron-shaped console lines, TensorBoard scalars and a metrics JSON Lines file.

The console line keeps Megatron's field order and formats (scripts parse them); the JSONL file holds one
object per logged iteration (`{"iteration": 10, "lm loss": ..., "learning rate": ...}`) and per evaluation
(`{"iteration": 10, "split": "valid", "lm loss": ..., "lm loss PPL": ...}`) for eval reports to plot.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from storage.atomic import atomic_write_text

if TYPE_CHECKING:
    from megatron_train.training.wandb_writer import WandbWriter


def peak_memory_mb() -> float:
    """Peak memory of this process: allocated CUDA memory on GPU, resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def format_training_line(
    stats: dict[str, Any], train_iters: int, loss_keys: Sequence[str] = ("lm loss",)
) -> str:
    """One Megatron `training_log` line from the interval's averaged stats; `loss_keys` are the entries of the
    model's loss dict (`lm loss`, `sop loss`, ...), printed in order after the global batch size."""
    mfu = stats.get("MFU")
    parts = [
        f" iteration {stats['iteration']:8d}/{train_iters:8d} |",
        f" consumed samples: {stats['consumed samples']:12d} |",
        f" elapsed time per iteration (ms): {stats['elapsed time per iteration (ms)']:.1f} |",
        f" throughput per GPU (TFLOP/s/GPU): {stats['throughput per GPU (TFLOP/s/GPU)']:.3f} |",
        f" learning rate: {stats['learning rate']:.6E} |",
        f" global batch size: {stats['global batch size']:5d} |",
    ]
    parts += [f" {key}: {stats[key]:.6E} |" for key in loss_keys if stats.get(key) is not None]
    parts.append(f" loss scale: {stats['loss scale']:.1f} |")
    if stats.get("grad norm") is not None:
        parts.append(f" grad norm: {stats['grad norm']:.3f} |")
    if stats.get("num zeros") is not None:
        parts.append(f" num zeros: {stats['num zeros']:.1f} |")
    if stats.get("params norm") is not None:
        parts.append(f" params norm: {stats['params norm']:.3f} |")
    parts += [
        f" number of skipped iterations: {stats['number of skipped iterations']:3d} |",
        f" number of nan iterations: {stats['number of nan iterations']:3d} |",
        f" tokens per second: {stats['tokens per second']:.1f} |",
        f" MFU: {'n/a' if mfu is None else f'{100 * mfu:.2f}%'} |",
        f" peak memory (MB): {stats['peak memory (MB)']:.1f} |",
    ]
    return "".join(parts)


def format_evaluation_line(prefix: str, losses: dict[str, float]) -> str:
    """Megatron's evaluation box line, e.g. ` validation loss at iteration 100 | lm loss value: ... | lm loss PPL:
    ... |`, a value and a PPL per loss; `prefix` is `iteration N` during training, `the end of training for val
    data` / `... test data` at the end."""
    values = "".join(
        f" {key} value: {loss:.6E} | {key} PPL: {math.exp(min(20.0, loss)):.6E} |"
        for key, loss in losses.items()
    )
    return f" validation loss at {prefix} |{values}"


class MetricsWriter:
    """TensorBoard (when `tensorboard_dir`), JSONL (when `metrics_file`) and W&B (when `wandb`) sinks; used on one
    rank only.

    On a resumed run, records after `start_iteration` (written by the killed run past its last checkpoint)
    are dropped so the file describes exactly one history.
    """

    def __init__(
        self,
        tensorboard_dir: str | None,
        metrics_file: str | None,
        start_iteration: int = 0,
        wandb: WandbWriter | None = None,
    ) -> None:
        self.wandb = wandb
        self.tensorboard = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        self.metrics = None
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            _truncate_after(metrics_file, start_iteration)
            self.metrics = open(metrics_file, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any], tensorboard: bool = True) -> None:
        if self.metrics is not None:
            record = {"time": time.time(), **record}
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard is not None and tensorboard:
            prefix = f"{record['split']}/" if "split" in record else ""
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("iteration", "time") and value is not None:
                    self.tensorboard.add_scalar(prefix + key, value, record["iteration"])
        if self.wandb is not None:
            self.wandb.write(record)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


def _truncate_after(path: str, start_iteration: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as handle:
        kept = [
            line
            for line in handle
            if line.strip() and json.loads(line).get("iteration", 0) <= start_iteration
        ]
    atomic_write_text(path, "".join(kept))
