"""Pretrain stage: run `torchrun -m megatron_train.pretrain_gpt` (or the entry point of the model family the
params' `model` names: `pretrain_bert`, `pretrain_t5`, a family from outside the project through
`megatron_train.pretrain --model-family pkg.module:ATTR`) on a tokenized corpus; the artifact is the run directory
(checkpoints, metrics.jsonl, TensorBoard events).

Inputs: the tokenize artifact (its manifest's `outputs[json_key]` names `<prefix>_text_document.bin/.idx`)
and, optionally, a train_tokenizer artifact whose files become `--tokenizer-type/--vocab-file/...`; without
one, the tokenizer flags of `params.config.tokenizer` are used. The run directory lives in the writer's
scratch space until training finishes, so a rerun or retry after a crash resumes from its latest checkpoint
(`--load` = `--save`); the files move into the artifact only when the last iteration is done, after a journal
that lets a rerun finish an interrupted move without training again.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_train.arguments import (
    MegatronConfig,
    config_from_dict,
    config_to_argv,
    parse_args,
    validate_config,
)
from megatron_train.checkpointing import (
    METADATA_FILENAME,
    checkpoint_dir,
    read_latest_iteration,
    read_metadata,
)
from megatron_train.data.config import DataConfig
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import builtin_families, family_module, get_family, is_builtin
from megatron_train.models.config import TransformerConfig
from megatron_train.training.config import OptimizerConfig, TrainingConfig
from stages.base import Inputs, Stage
from stages.launch import LaunchParams, slurm_script
from stages.launch import torchrun_command as launch_command
from storage.artifacts import (
    ArtifactRef,
    ArtifactStore,
    ArtifactWriter,
)
from storage.atomic import atomic_write_text, is_temporary
from storage.verify import content_hash

log = logging.getLogger("megatron_flow.stage.pretrain")  # every line of the training job; flows forward it
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_ITERATION_FOLDER = re.compile(r"iter_(\d+)$")  # the name checkpoint_dir gives a saved iteration


def default_config() -> MegatronConfig:
    """GPT-2 small (124M) with Megatron's usual recipe; the stage fills data, tokenizer and directories."""
    return MegatronConfig(
        model=TransformerConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024),
        data=DataConfig(mock_data=True),
        training=TrainingConfig(micro_batch_size=4, global_batch_size=32, train_iters=20000, eval_interval=1000,
                                eval_iters=10),
        optimizer=OptimizerConfig(lr=6e-4, min_lr=6e-5, lr_decay_style="cosine", lr_warmup_fraction=0.01,
                                  weight_decay=0.1, adam_beta2=0.95),
    )  # fmt: skip


def pretrain_family(name: str) -> ModelFamily:
    """The model family `name` (a family of the project, or `pkg.module:ATTR`) if it pretrains on a tokenized
    corpus, else a ValueError naming those that do."""
    family = get_family(name)
    if family.corpus is None:
        raise ValueError(
            f"model {name!r} does not pretrain on a tokenized corpus; the families that do: "
            f"{', '.join(corpus_families())} (or pkg.module:ATTR naming one)"
        )
    return family


def corpus_families() -> list[str]:
    """The project's families that the pretrain stage and flow train on a tokenized corpus."""
    return [family.name for family in builtin_families() if family.corpus is not None]


@dataclass(frozen=True)
class PretrainParams:
    """The training run (Megatron's flags as a typed config), the model family and how many processes run it."""

    config: MegatronConfig = field(default_factory=default_config)
    nproc_per_node: int = 1
    json_key: str = "text"
    save_interval: int = 1000  # checkpoints in the run directory, what a retry resumes from
    model: str = "gpt"  # the model family: a name of `corpus_families()`, or `pkg.module:ATTR`
    launch: LaunchParams = field(default_factory=LaunchParams)  # nodes, rendezvous, torchrun or Slurm

    def __post_init__(self) -> None:
        pretrain_family(self.model)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.launch.nnodes


def params_from_argv(
    argv: Sequence[str],
    nproc_per_node: int = 1,
    save_interval: int = 1000,
    model: str = "gpt",
    launch: LaunchParams | None = None,
) -> PretrainParams:
    """Params from Megatron flags; the data path, tokenizer and directories are the stage's to fill."""
    launch = launch or LaunchParams()
    config = parse_args([*argv, "--mock-data"], world_size=nproc_per_node * launch.nnodes)
    return PretrainParams(
        config=config, nproc_per_node=nproc_per_node, save_interval=save_interval, model=model, launch=launch
    )


def _tokenizer_flags(params: PretrainParams, tokenizer: ArtifactRef | None) -> tuple[dict, list[str]]:
    """(tokenizer config fields, fingerprints of their files) from a train_tokenizer artifact or the params."""
    if tokenizer is not None:
        files = tokenizer.manifest()["tokenizer"]
        fields = {"tokenizer_type": files["tokenizer_type"]}
        for role, flag in (("vocab_file", "vocab_file"), ("merge_file", "merge_file"),
                           ("tokenizer_json", "tokenizer_model")):  # fmt: skip
            if files.get(role):
                fields[flag] = tokenizer.local_path(files[role])
        return fields, [tokenizer.fingerprint]
    given = params.config.tokenizer
    paths = [p for p in (given.vocab_file, given.merge_file, given.tokenizer_model) if p]
    return {}, [content_hash(p) for p in paths]


def _data_prefix(tokenized: ArtifactRef, json_key: str) -> str:
    outputs = tokenized.manifest().get("outputs", {})
    if json_key not in outputs:
        raise ValueError(
            f"{tokenized.url}: tokenize artifact has no output for json key {json_key!r} ({outputs})"
        )
    name = outputs[json_key]
    tokenized.local_path(name + ".idx")
    return tokenized.local_path(name + ".bin")[: -len(".bin")]


def run_config(
    params: PretrainParams, data_prefix: str, tokenizer_fields: dict, run_dir: str
) -> MegatronConfig:
    """A copy of the params' config pointed at this stage's data, tokenizer and run directory."""
    config = copy.deepcopy(params.config)
    return dataclasses.replace(
        config,
        data=dataclasses.replace(
            config.data, data_path=[data_prefix], mock_data=False,
            # the sample-index cache goes to scratch, never into the (immutable) tokenize artifact
            data_cache_path=config.data.data_cache_path or os.path.join(os.path.dirname(run_dir), "data_cache"),
        ),
        tokenizer=dataclasses.replace(config.tokenizer, **tokenizer_fields),
        checkpoint=dataclasses.replace(
            config.checkpoint, save=run_dir, load=run_dir, save_interval=params.save_interval
        ),
        logging=dataclasses.replace(
            config.logging, tensorboard_dir=os.path.join(run_dir, "tensorboard"),
            metrics_file=os.path.join(run_dir, "metrics.jsonl"),
        ),
    )  # fmt: skip


def entry_and_argv(config: MegatronConfig, model: str) -> tuple[str, list[str]]:
    """(the `-m` module, its flags) that train `config` as the family `model`: the family's entry point, told
    which family with --model-family when it is one from outside the project."""
    argv = config_to_argv(config)
    if not is_builtin(model) and config.model.model_family is None:
        argv = ["--model-family", model, *argv]
    return pretrain_family(model).entry_module, argv


def torchrun_command(
    config: MegatronConfig, nproc_per_node: int, model: str = "gpt", launch: LaunchParams | None = None
) -> list[str]:
    """This node's `torchrun` command line for the training job (`stages.launch`: one node or many)."""
    return launch_command(nproc_per_node, launch or LaunchParams(), *entry_and_argv(config, model))


def job_command(config: MegatronConfig, params: PretrainParams, job_dir: str) -> list[str]:
    """What the stage runs: this node's torchrun agent, or `sbatch --wait` of a batch script written to
    `job_dir` that starts one agent per node (`--launcher slurm`)."""
    launch = params.launch
    if launch.launcher == "slurm":
        script = os.path.join(job_dir, "pretrain.sbatch")
        module, argv = entry_and_argv(config, params.model)
        log_file = os.path.join(job_dir, "slurm-%j.out")
        atomic_write_text(script, slurm_script(params.nproc_per_node, launch, module, argv, log_file))
        log.info("submitting %s (training log: %s)", script, log_file)
        return ["sbatch", "--wait", script]
    for rank in range(1, launch.nnodes):  # the other nodes' agents are started by the user on those nodes
        other = dataclasses.replace(launch, node_rank=rank)
        command = torchrun_command(config, params.nproc_per_node, params.model, other)
        log.info("node %d of %d: run %s", rank, launch.nnodes, shlex.join(command))
    return torchrun_command(config, params.nproc_per_node, params.model, launch)


def stop(proc: subprocess.Popen, grace_seconds: float = 30.0) -> None:
    """Stop an interrupted training job and its workers. torchrun starts each worker in a session of its own,
    so killing torchrun's group would orphan them (still training, still writing checkpoints): SIGTERM first,
    which torchrun forwards to its workers and waits for, then SIGKILL whatever is left of its group."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _terminate_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent dies (PR_SET_PDEATHSIG; elsewhere a
    no-op). It fires when the thread that started the child ends, which `launch` outlives: it reads the child's
    output until the child exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(command: list[str], on_line: Callable[[str], None] | None = None) -> None:
    """Run the training job, streaming each output line to the `stages.pretrain` logger (and `on_line`)."""
    tail: deque[str] = deque(maxlen=40)
    # THP_MEM_ALLOC_ENABLE: PyTorch's CPU allocator on huge pages; large fresh buffers (logits, grads) then cost
    # ~10x fewer page faults (benchmarks/train_step.py). Ignored on GPUs.
    env = {"THP_MEM_ALLOC_ENABLE": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    # A session of its own: on an interruption the whole job (torchrun and its workers) is killed together.
    # And SIGTERM when this process dies (even by SIGKILL): torchrun then stops its workers, so no training job
    # outlives the flow that started it.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_terminate_with_parent,
    )
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log.info("%s", line)
            if on_line is not None:
                on_line(line)
        proc.wait()
    finally:
        if proc.poll() is None:
            stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(
            f"training exited with status {proc.returncode}; rerun the stage to resume from the last checkpoint.\n"
            f"command: {shlex.join(command)}\nlast lines:\n" + "\n".join(tail)
        )


def committable_files(run_dir: str) -> list[str]:
    """The run directory's files that belong in the artifact, sorted.

    Left out: temporary files of an interrupted write (`storage.atomic.is_temporary`) and checkpoint folders
    that are not complete, i.e. without their metadata file (written after every rank's shard) or beyond the
    latest marker (a save that a kill interrupted).
    """
    latest = read_latest_iteration(run_dir)
    names = []
    for folder, _, files in os.walk(run_dir):
        for file in files:
            name = os.path.relpath(os.path.join(folder, file), run_dir)
            if not is_temporary(name) and _in_complete_checkpoint(run_dir, name, latest):
                names.append(name)
    return sorted(names)


def _in_complete_checkpoint(run_dir: str, name: str, latest: int | None) -> bool:
    """True for a file outside the iteration folders, or inside a complete one."""
    match = _ITERATION_FOLDER.match(name.split(os.sep)[0])
    if match is None:
        return True
    iteration = int(match.group(1))
    complete = os.path.isfile(os.path.join(checkpoint_dir(run_dir, iteration), METADATA_FILENAME))
    return complete and latest is not None and iteration <= latest


COMMIT_JOURNAL = "commit.json"  # beside the run directory: what a finished run puts into the artifact


def train_and_commit(
    writer: ArtifactWriter,
    run_dir: str,
    command: list[str],
    train_iters: int | None,
    on_line: Callable[[str], None] | None = None,
) -> dict:
    """Run the training `command` (which saves to and loads from `run_dir`, in the writer's scratch space), resuming
    from the run directory's latest checkpoint, then put the finished run's files into the artifact; returns the
    manifest fields (iteration, consumed samples, resumed-from iteration, world size).

    Before the first file moves, the finished run's file list and manifest fields are written to a journal beside
    the run directory: a kill while moving (which leaves the run directory without some of its files) resumes the
    move from the journal instead of training again.
    """
    journal = os.path.join(os.path.dirname(run_dir), COMMIT_JOURNAL)
    if os.path.isfile(journal):
        with open(journal) as f:
            commit = json.load(f)
        log.info("%s: finishing the move of a finished run into the artifact (%s)", run_dir, journal)
    else:
        commit = {
            "fields": _train(run_dir, command, train_iters, on_line),
            "files": committable_files(run_dir),
        }
        atomic_write_text(journal, json.dumps(commit))
    for name in commit["files"]:
        local = os.path.join(run_dir, name)
        if os.path.exists(local):
            writer.put_file(local, name)
        elif not writer.has_file(name):
            raise RuntimeError(
                f"{local} is gone and not in the artifact {writer.url}: the scratch folder was changed by hand; "
                f"delete {os.path.dirname(run_dir)} and rerun to train again"
            )
    return commit["fields"]


def _train(
    run_dir: str, command: list[str], train_iters: int | None, on_line: Callable[[str], None] | None
) -> dict:
    """Run or resume the training job in `run_dir` to its last iteration; the manifest fields of the run."""
    resumed_from = read_latest_iteration(run_dir) if os.path.isdir(run_dir) else None
    if resumed_from is not None:
        log.info("resuming %s from iteration %d", run_dir, resumed_from)
    launch(command, on_line)
    iteration = read_latest_iteration(run_dir)
    if train_iters is not None and iteration != train_iters:
        raise RuntimeError(
            f"training stopped at iteration {iteration} of {train_iters} (an exit condition fired); "
            "rerun the stage to continue from there"
        )
    metadata = read_metadata(checkpoint_dir(run_dir, iteration))
    return {
        "iteration": iteration,
        "consumed_train_samples": metadata["consumed_train_samples"],
        "resumed_from": resumed_from,
        "world_size": metadata["world_size"],
    }


def run_directory(ref: ArtifactRef) -> str:
    """The local run directory of a pretrain artifact (for `--load` or `load_model_for_inference`); a remote
    artifact is downloaded to the local cache first."""
    for name in ref.files():
        ref.local_path(name)
    return os.path.dirname(ref.local_path("latest_checkpointed_iteration.txt"))


def _split_inputs(inputs: Inputs) -> tuple[ArtifactRef, ArtifactRef | None]:
    """(tokenize artifact, train_tokenizer artifact or None) of the stage's one or two inputs."""
    if len(inputs) not in (1, 2):
        raise ValueError(
            f"the pretrain stage takes [tokenize artifact] or [tokenize, train_tokenizer], got {inputs!r}"
        )
    return inputs[0], inputs[1] if len(inputs) == 2 else None


class PretrainStage(Stage):
    name = "pretrain"
    version = "1"
    libraries = ("torch",)
    Params = PretrainParams

    def params_from_dict(self, values: dict) -> PretrainParams:
        """Inverse of `dataclasses.asdict(params)`: the params nest the whole Megatron config."""
        launch = LaunchParams(**values.get("launch", {}))
        return PretrainParams(**{**values, "config": config_from_dict(values["config"]), "launch": launch})

    def code_modules(self, params: PretrainParams) -> tuple[str, ...]:
        """The stage, the `torchrun` entry point it launches and the module of the family it trains (what the
        training workers run; the entry point finds the family by name, so its imports do not reach it)."""
        entry = pretrain_family(params.model).entry_module
        return (*super().code_modules(params), entry, family_module(params.model))

    def key_params(self, params: PretrainParams) -> dict:
        """Where the processes run (node rank, rendezvous, launcher) does not change the run; how many do."""
        return {**dataclasses.asdict(params), "launch": {"nnodes": params.launch.nnodes}}

    def key_inputs(self, params: PretrainParams, inputs: Inputs) -> list[ArtifactRef | str]:
        """The tokenized data and the tokenizer: a train_tokenizer artifact, or the tokenizer files' hashes."""
        tokenized, tokenizer = _split_inputs(inputs)
        return [tokenized, *_tokenizer_flags(params, tokenizer)[1]]

    def run(
        self,
        params: PretrainParams,
        inputs: Inputs,
        store: ArtifactStore,
        *,
        on_line: Callable[[str], None] | None = None,
    ) -> ArtifactRef:
        """Train on `inputs` ([tokenize artifact] or [tokenize artifact, train_tokenizer artifact]) with
        torchrun; `on_line` receives every output line of the training job."""
        tokenized, tokenizer = _split_inputs(inputs)
        tokenizer_fields = _tokenizer_flags(params, tokenizer)[0]
        # Validate now, with a placeholder data path: a bad flag fails before anything launches.
        validate_config(run_config(params, "placeholder", tokenizer_fields, "run"), params.world_size)

        def build(writer: ArtifactWriter) -> dict:
            run_dir = os.path.join(writer.local_dir, "run")
            config = run_config(params, _data_prefix(tokenized, params.json_key), tokenizer_fields, run_dir)
            command = job_command(config, params, writer.local_dir)
            return train_and_commit(writer, run_dir, command, config.training.train_iters, on_line)

        return self.build_artifact(params, inputs, store, build)


STAGE = PretrainStage()
run = STAGE.run
key = STAGE.key
