"""Megatron's `--wandb-project` / `--wandb-exp-name` / `--wandb-save-dir`: the logged metrics also go to a
Weights & Biases run (set WANDB_MODE=offline to keep it local). Without the `wandb` package the flags are
accepted and one warning says what to install."""

from __future__ import annotations

import logging
import os
from typing import Any

from megatron_train.arguments import MegatronConfig, config_to_dict

logger = logging.getLogger(__name__)


class WandbWriter:
    """Numbers of each metrics record to `run.log`, at the record's iteration; evaluations as `<split>/<key>`."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def write(self, record: dict[str, Any]) -> None:
        prefix = f"{record['split']}/" if "split" in record else ""
        values = {
            prefix + key: value
            for key, value in record.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and key not in ("iteration", "time")
        }
        self.run.log(values, step=record["iteration"])

    def close(self) -> None:
        self.run.finish()


def build_wandb_writer(config: MegatronConfig) -> WandbWriter | None:
    """A writer to a new W&B run when --wandb-project is set and wandb is installed, else None."""
    settings = config.logging
    if not settings.wandb_project:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning(
            "--wandb-project %s needs the wandb package (pip install wandb); metrics go to the console, the "
            "metrics file and TensorBoard only",
            settings.wandb_project,
        )
        return None
    save_dir = settings.wandb_save_dir or os.path.join(config.checkpoint.save or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    run = wandb.init(
        project=settings.wandb_project,
        name=settings.wandb_exp_name,
        dir=save_dir,
        config=config_to_dict(config),
    )
    return WandbWriter(run)
