"""The Retro pretrain stage: `torchrun -m megatron_train.pretrain_retro --retro-project-dir DIR` on the Retro
project of a `retro_query` artifact; the artifact is the run directory, as the pretrain stage's.

`retriever` True trains the Retro model (`--retro-add-retriever`, then `retro_flags` too), False the GPT
baseline on the same samples (the same `flags`): the Retro flow runs both. Given a second input, a GPT run of
this stage, the run starts from its checkpoint with `fit_flags` added: a Retro run is retro-fitted (Megatron's
`--load <GPT checkpoint> --finetune`: the GPT's weights, the encoder and chunked cross-attention new;
`retro_flags` may add `--retro-fit-freeze-decoder`), a GPT run continues the GPT as long, the baseline that has
trained as many steps as the retro-fitted Retro.
Sequence length, data, split, seed, tokenizer and sample counts come from the project (`pretrain_retro`), so
the flags hold only the model, optimizer and Retro settings. The run lives in the writer's scratch space until
its last iteration, so a rerun after a kill resumes from its latest checkpoint
(`stages.pretrain.train_and_commit`; a retro-fitted run then loads its own checkpoint, not the GPT's). See
docs/architecture.md (Retro flow).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.checkpointing import read_latest_iteration
from megatron_train.families.registry import family_module
from megatron_train.training.setup import planned_sample_counts
from retro.family import RETRO, check_queried_samples, with_project_settings
from retro.project import RetroProject
from stages.base import Inputs, Stage, expect_inputs
from stages.launch import LaunchParams, torchrun_command
from stages.pretrain import run_directory, train_and_commit
from stages.retro_params import local_dir
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter


@dataclass(frozen=True)
class RetroPretrainParams:
    """Megatron flags of the decoder and optimizer (not the project's settings), the flags of a run started from
    a GPT run's checkpoint (`fit_flags`: its steps), the flags only the Retro run adds (neighbours, encoder),
    whether the run retrieves (Retro) or not (GPT baseline), and how many processes run it."""

    # Megatron's defaults are for wide models: at width 64 an init std of 0.1 (about 1/sqrt(width)) rather than
    # 0.02 is what lets chunked cross-attention learn to look up and copy the neighbour's continuation within a
    # thousand steps; dropout off for so few steps; rotary positions, with which the encoder's attention to the
    # neighbour token beside it is one learned rotation (README, Retro flow).
    flags: tuple[str, ...] = (
        "--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--global-batch-size", "8",
        "--micro-batch-size", "8", "--train-iters", "120", "--eval-interval", "100", "--eval-iters", "5",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.05",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "10", "--position-embedding-type", "rope",
        "--init-method-std", "0.1", "--hidden-dropout", "0", "--attention-dropout", "0",
    )  # fmt: skip
    fit_flags: tuple[str, ...] = ()
    retro_flags: tuple[str, ...] = ()
    retriever: bool = True
    nproc_per_node: int = 1
    save_interval: int = 1000
    # torch threads of each training process (OMP_NUM_THREADS), for runs that share the machine (the Retro flow
    # trains Retro and its baseline at once); None: torch's default. Not in the stage's key: it changes the speed,
    # and at most the order of float sums.
    threads: int | None = None


def retro_argv(
    params: RetroPretrainParams, project_dir: str, run_dir: str, retro_fit_from: str | None = None
) -> list[str]:
    """pretrain_retro's command line: the params' flags, the project, the run directory's checkpoints and logs;
    `retro_fit_from` (a GPT run directory) is loaded with --finetune until the run has a checkpoint of its own,
    and adds the `fit_flags`."""
    fit = list(params.fit_flags) if retro_fit_from is not None else []
    retro = [*params.retro_flags, "--retro-add-retriever"] if params.retriever else []
    own_checkpoint = os.path.isdir(run_dir) and read_latest_iteration(run_dir) is not None
    load = run_dir if retro_fit_from is None or own_checkpoint else retro_fit_from
    return [
        *params.flags, *fit, *retro,
        "--retro-project-dir", project_dir,
        "--save", run_dir, "--load", load, *(["--finetune"] if load != run_dir else []),
        "--save-interval", str(params.save_interval),
        "--tensorboard-dir", os.path.join(run_dir, "tensorboard"),
        "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
        "--data-cache-path", os.path.join(os.path.dirname(run_dir), "data_cache"),
    ]  # fmt: skip


def run_config(
    params: RetroPretrainParams, project_dir: str, run_dir: str, retro_fit_from: str | None = None
) -> MegatronConfig:
    """The run's whole config as pretrain_retro parses it: a bad flag, a project mismatch, or more samples of a
    split than the project queried neighbours for (--eval-interval/--eval-iters over many steps) raises here."""
    argv = retro_argv(params, project_dir, run_dir, retro_fit_from)
    config = parse_args(with_project_settings(argv), params.nproc_per_node)
    samples = planned_sample_counts(config, params.nproc_per_node)
    check_queried_samples(RetroProject.load(project_dir), project_dir, samples)
    return config


class RetroPretrainStage(Stage):
    name = "retro_pretrain"
    version = "3"
    libraries = ("torch",)
    Params = RetroPretrainParams

    def key_params(self, params: RetroPretrainParams) -> dict:
        """Every param but `threads`, which changes how fast the run goes, not what it trains."""
        return {name: value for name, value in asdict(params).items() if name != "threads"}

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
        """Train on the Retro project of `inputs` ([retro_query artifact], or [retro_query artifact, GPT run] to
        retro-fit or continue) with torchrun."""
        if len(inputs) == 2:
            query, gpt_run = expect_inputs(
                self, inputs, 2, "[retro_query artifact, GPT retro_pretrain artifact]"
            )
            if gpt_run.manifest().get("retriever", False):
                raise ValueError(
                    f"{gpt_run.url}: the second input must be a GPT run (retriever False) to start from, not a "
                    "Retro run"
                )
            retro_fit_from = run_directory(gpt_run)
        else:
            (query,) = expect_inputs(
                self, inputs, 1, "[retro_query artifact] (and a GPT run to retro-fit from)"
            )
            gpt_run = retro_fit_from = None
        project_dir = local_dir(query)
        run_config(params, project_dir, "run", retro_fit_from)  # fail on a bad flag before anything launches

        def build(writer: ArtifactWriter) -> dict:
            run_dir = os.path.join(writer.local_dir, "run")
            config = run_config(params, project_dir, run_dir, retro_fit_from)
            argv = retro_argv(params, project_dir, run_dir, retro_fit_from)
            command = torchrun_command(params.nproc_per_node, LaunchParams(), RETRO.entry_module, argv)
            if params.threads is not None:
                command = ["env", f"OMP_NUM_THREADS={params.threads}", *command]
            fields = train_and_commit(writer, run_dir, command, config.training.train_iters, on_line)
            started_from = None if gpt_run is None else gpt_run.url
            return {
                **fields,
                "retriever": params.retriever,
                "retro_fitted_from": started_from if params.retriever else None,
                "continued_from": None if params.retriever else started_from,
            }

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroPretrainStage()
run = STAGE.run
key = STAGE.key
