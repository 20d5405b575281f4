"""The Retro pretrain stage: `torchrun -m megatron_train.pretrain_retro --retro-project-dir DIR` on the Retro
project of a `retro_query` artifact; the artifact is the run directory, as the pretrain stage's.

`retriever` True trains the Retro model (`--retro-add-retriever`), False the GPT baseline on the same samples
(same decoder flags, same steps): the Retro flow runs both. Sequence length, data, split, seed, tokenizer and
sample counts come from the project (`pretrain_retro`), so `flags` hold only the model, optimizer and Retro
flags. The run lives in the writer's scratch space until its last iteration, so a rerun after a kill resumes
from its latest checkpoint (`stages.pretrain.train_and_commit`). See docs/architecture.md (Retro flow).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.families.registry import family_module
from retro.family import RETRO, with_project_settings
from stages.base import Inputs, Stage, expect_inputs
from stages.launch import LaunchParams, torchrun_command
from stages.pretrain import train_and_commit
from stages.retro_params import local_dir
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter


@dataclass(frozen=True)
class RetroPretrainParams:
    """Megatron flags of the decoder, optimizer and Retro encoder (not the project's settings), whether the run
    retrieves (Retro) or not (GPT baseline), and how many processes run it."""

    flags: tuple[str, ...] = (
        "--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--global-batch-size", "8",
        "--micro-batch-size", "8", "--train-iters", "120", "--eval-interval", "40", "--eval-iters", "5",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.05",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "10",
    )  # fmt: skip
    retriever: bool = True
    nproc_per_node: int = 1
    save_interval: int = 1000


def retro_argv(params: RetroPretrainParams, project_dir: str, run_dir: str) -> list[str]:
    """pretrain_retro's command line: the params' flags, the project, the run directory's checkpoints and logs."""
    return [
        *params.flags,
        "--retro-project-dir", project_dir,
        *(["--retro-add-retriever"] if params.retriever else []),
        "--save", run_dir, "--load", run_dir, "--save-interval", str(params.save_interval),
        "--tensorboard-dir", os.path.join(run_dir, "tensorboard"),
        "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
        "--data-cache-path", os.path.join(os.path.dirname(run_dir), "data_cache"),
    ]  # fmt: skip


def run_config(params: RetroPretrainParams, project_dir: str, run_dir: str) -> MegatronConfig:
    """The run's whole config as pretrain_retro parses it (a bad flag or project mismatch raises here)."""
    return parse_args(with_project_settings(retro_argv(params, project_dir, run_dir)), params.nproc_per_node)


class RetroPretrainStage(Stage):
    name = "retro_pretrain"
    version = "1"
    libraries = ("torch",)
    Params = RetroPretrainParams

    def code_modules(self, params: RetroPretrainParams) -> tuple[str, ...]:
        """The stage, the `torchrun` entry point it launches and the Retro family it trains."""
        return (*super().code_modules(params), RETRO.entry_module, family_module(RETRO.name))

    def run(
        self,
        params: RetroPretrainParams,
        inputs: Inputs,
        store: ArtifactStore,
        *,
        on_line: Callable[[str], None] | None = None,
    ) -> ArtifactRef:
        """Train on the Retro project of `inputs` ([retro_query artifact]) with torchrun."""
        (query,) = expect_inputs(self, inputs, 1, "[retro_query artifact]")
        project_dir = local_dir(query)
        run_config(params, project_dir, "run")  # fail on a bad flag before anything launches

        def build(writer: ArtifactWriter) -> dict:
            run_dir = os.path.join(writer.local_dir, "run")
            config = run_config(params, project_dir, run_dir)
            argv = retro_argv(params, project_dir, run_dir)
            command = torchrun_command(params.nproc_per_node, LaunchParams(), RETRO.entry_module, argv)
            return train_and_commit(writer, run_dir, command, config.training.train_iters, on_line)

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroPretrainStage()
run = STAGE.run
key = STAGE.key
