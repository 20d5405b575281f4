"""How many micro-batches make one global batch, with Megatron's optional batch-size ramp-up or step-wise
batch-size schedule."""

from __future__ import annotations

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _schedule_number(text: str, entry: str, schedule: str) -> int:
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if multiplier > 1 else text) * multiplier)
    except ValueError:
        raise ValueError(
            f"--step-batch-size-schedule {schedule!r}: {entry!r} is not THRESHOLD:BATCH_SIZE with numbers "
            "(suffixes K, M, B, T allowed)"
        ) from None


def parse_step_batch_size_schedule(words: list[str], seq_length: int | None) -> list[tuple[int, int]]:
    """Megatron's `StepBatchsizeNumMicroBatchesCalculator._parse_schedule`: ["0:16 2.4B:320", ...] (one string
    or one entry per word) as sorted (threshold in samples, batch size) pairs; thresholds are tokens, divided
    by `seq_length` (samples when None)."""
    schedule = " ".join(words)
    pairs = []
    for entry in schedule.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(
                f"--step-batch-size-schedule {schedule!r}: entry {entry!r} is not THRESHOLD:BATCH_SIZE"
            )
        threshold_text, batch_text = entry.split(":", 1)
        threshold = _schedule_number(threshold_text, entry, schedule)
        batch_size = _schedule_number(batch_text, entry, schedule)
        pairs.append((threshold // seq_length if seq_length else threshold, batch_size))
    pairs.sort()
    if not pairs or pairs[0][0] != 0:
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: the first threshold must be 0")
    for (previous, _), (threshold, _) in zip(pairs, pairs[1:], strict=False):
        if threshold <= previous:
            raise ValueError(
                f"--step-batch-size-schedule {schedule!r}: thresholds must increase (in samples: {previous} "
                f"then {threshold})"
            )
    if any(batch_size <= 0 for _, batch_size in pairs):
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: batch sizes must be positive")
    return pairs


class MicroBatchCalculator:
    """Global batch = micro_batch_size * data_parallel_size * num_micro_batches (gradient accumulation).

    With `rampup_batch_size = (start, increment, rampup_samples)` the global batch grows from `start` by
    `increment` in equal sample intervals until `rampup_samples` samples are consumed (Megatron's
    RampupBatchsizeNumMicroBatches); call `update(consumed_samples)` before each step.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: list[int] | tuple[int, int, int] | None = None,
        step_schedule: list[tuple[int, int]] | None = None,
    ) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_dp = micro_batch_size * data_parallel_size
        _check_divisible(global_batch_size, self.micro_batch_times_dp, "--global-batch-size")
        self.rampup = None
        if rampup_batch_size is not None:
            start, increment, rampup_samples = (int(v) for v in rampup_batch_size)
            if not 0 < start <= global_batch_size or increment <= 0 or rampup_samples < 0:
                raise ValueError(
                    f"--rampup-batch-size {start} {increment} {rampup_samples}: need 0 < start <= global batch "
                    f"size ({global_batch_size}), increment > 0 and ramp-up samples >= 0"
                )
            diff = global_batch_size - start
            if diff % increment:
                raise ValueError(
                    f"--rampup-batch-size: global batch size ({global_batch_size}) minus start ({start}) must be "
                    f"a multiple of the increment ({increment})"
                )
            num_increments = diff // increment
            self.rampup = (start, increment, rampup_samples, rampup_samples / max(num_increments, 1))
        self.step_schedule = step_schedule
        self.current_global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // self.micro_batch_times_dp
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Set the batch size for the step that starts after `consumed_samples` samples."""
        if self.step_schedule is not None:
            current = [size for threshold, size in self.step_schedule if consumed_samples >= threshold][-1]
        elif self.rampup is not None:
            start, increment, rampup_samples, samples_per_increment = self.rampup
            if consumed_samples > rampup_samples:
                current = self.global_batch_size
            else:
                current = start + int(consumed_samples / samples_per_increment) * increment
                current = min(current, self.global_batch_size)
        else:
            return
        if consistency_check:
            _check_divisible(current, self.micro_batch_times_dp, "the ramped-up global batch size")
        self.current_global_batch_size = current
        self.num_micro_batches = max(1, current // self.micro_batch_times_dp)

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Steps needed to consume `train_samples` samples (Megatron's `update_train_iters`)."""
        if self.rampup is None and self.step_schedule is None:
            return train_samples // self.global_batch_size
        saved = (self.current_global_batch_size, self.num_micro_batches)
        iterations, consumed = 0, 0
        varying_until = self.rampup[2] if self.rampup is not None else self.step_schedule[-1][0] - 1
        while consumed <= varying_until and consumed <= train_samples:
            self.update(consumed, consistency_check=False)
            consumed += self.current_global_batch_size
            iterations += 1
        self.current_global_batch_size, self.num_micro_batches = saved
        return iterations + max(0, train_samples - consumed) // self.global_batch_size


def _check_divisible(batch_size: int, micro_batch_times_dp: int, what: str) -> None:
    if batch_size % micro_batch_times_dp:
        raise ValueError(
            f"{what} ({batch_size}) must be a multiple of --micro-batch-size x data-parallel size "
            f"({micro_batch_times_dp}); change --global-batch-size, --micro-batch-size or the number of ranks"
        )
