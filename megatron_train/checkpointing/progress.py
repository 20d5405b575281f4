"""How far training got: what a checkpoint stores and a resumed run starts from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingProgress:
    """Iteration and consumed samples; `loaded_from` is the iteration folder this run resumed from (None for a
    fresh start or --finetune), which decides what it may overwrite when it saves (`save.save_checkpoint`)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    loaded_from: str | None = None
