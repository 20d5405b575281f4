"""Multi-node launch: two torchrun agents meeting at a c10d rendezvous train like one agent with the same world
size; the Slurm batch script carries the same flags; the launch settings do not change the stage's key."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from megatron_train.arguments import config_to_argv, parse_args
from stages.launch import LaunchParams, slurm_script, torchrun_args
from stages.pretrain import STAGE, PretrainParams, job_command, torchrun_command
from tests.helpers.distributed import free_port
from tests.helpers.training import tiny_args, train_losses, write_corpus

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _config(tmp_path, name: str):
    prefix = write_corpus(str(tmp_path))
    argv = tiny_args(str(tmp_path / name), "--data-path", prefix, "--train-iters", "4", "--split", "100,0,0")
    return parse_args(argv, world_size=2)


def _run(commands: list[list[str]], tmp_path) -> None:
    """Start every command at once (one per "node"), wait for all; fail with the output of any that failed."""
    logs = [open(tmp_path / f"agent{n}.log", "w+") for n in range(len(commands))]  # noqa: SIM115
    procs = [
        subprocess.Popen(c, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        for c, log in zip(commands, logs, strict=True)
    ]
    codes = [proc.wait(300) for proc in procs]
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read()[-3000:])
        log.close()
    assert codes == [0] * len(commands), "\n\n".join(outputs)


@pytest.mark.processes
def test_two_nodes_with_c10d_rendezvous_train_like_one_node_of_two_processes(tmp_path):
    _run([torchrun_command(_config(tmp_path, "one-node"), 2)], tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    two_nodes = _config(tmp_path, "two-nodes")
    _run(
        [
            torchrun_command(
                two_nodes, 1, launch=LaunchParams(nnodes=2, node_rank=rank, rdzv_endpoint=endpoint)
            )
            for rank in (0, 1)
        ],
        tmp_path,
    )
    one = train_losses(str(tmp_path / "one-node"))
    assert len(one) == 4 and train_losses(str(tmp_path / "two-nodes")) == one


def test_torchrun_flags_for_one_node_and_for_many():
    assert torchrun_args(4, LaunchParams()) == ["--standalone", "--nproc-per-node=4"]
    launch = LaunchParams(nnodes=4, node_rank=3, rdzv_endpoint="node0:29500", rdzv_id="job7")
    assert torchrun_args(8, launch) == [
        "--nnodes=4", "--node-rank=3", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500", "--rdzv-id=job7",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--rdzv-endpoint host:port"):
        LaunchParams(nnodes=2)
    with pytest.raises(ValueError, match=r"--node-rank 2 is not in \[0, 2\)"):
        LaunchParams(nnodes=2, node_rank=2, rdzv_endpoint="node0:29500")


@pytest.mark.processes
def test_slurm_script_starts_one_agent_per_node_with_the_same_flags(tmp_path):
    config = _config(tmp_path, "run")
    params = PretrainParams(config=config, nproc_per_node=8, launch=LaunchParams(nnodes=4, launcher="slurm"))
    command = job_command(config, params, str(tmp_path))
    assert command == ["sbatch", "--wait", str(tmp_path / "pretrain.sbatch")]
    script = (tmp_path / "pretrain.sbatch").read_text()
    expected = slurm_script(8, params.launch, "megatron_train.pretrain_gpt", config_to_argv(config),
                            str(tmp_path / "slurm-%j.out"))  # fmt: skip
    assert script == expected
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"} <= set(lines)
    srun = lines[-1]
    assert srun.startswith("srun --kill-on-bad-exit=1 bash -c ")
    for flag in ("--nnodes=4", "--node-rank=$SLURM_NODEID", "--nproc-per-node=8", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$HEAD_NODE:29500", "-m megatron_train.pretrain_gpt", "--num-layers 2"):  # fmt: skip
        assert flag in srun, flag
    # The line srun runs on each node expands the node's own rank: bash sees it unquoted.
    inner = subprocess.run(
        ["bash", "-c", srun.replace("srun --kill-on-bad-exit=1 bash -c", "printf '%s\\n'")],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    words = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {inner}"],
        env={**ENV, "SLURM_NODEID": "3", "HEAD_NODE": "gpu-a1"}, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert "--node-rank=3" in words and "--rdzv-endpoint=gpu-a1:29500" in words
    assert words[words.index("--data-path") + 1] == config.data.data_path[0]


def test_launch_settings_other_than_the_node_count_leave_the_key_alone(tmp_path):
    params = PretrainParams(nproc_per_node=2)
    inputs = ["tokenize:abc"]
    base = STAGE.key(params, inputs)
    elsewhere = dataclasses.replace(
        params, launch=LaunchParams(nnodes=1, rdzv_endpoint="node0:29500", rdzv_id="x", launcher="slurm")
    )
    assert STAGE.key(elsewhere, inputs) == base
    two_nodes = dataclasses.replace(params, launch=LaunchParams(nnodes=2, node_rank=1, rdzv_endpoint="h:1"))
    assert STAGE.key(two_nodes, inputs) != base
    assert STAGE.key(dataclasses.replace(two_nodes, launch=dataclasses.replace(two_nodes.launch, node_rank=0)),
                     inputs) == STAGE.key(two_nodes, inputs)  # fmt: skip
    assert STAGE.params_from_dict(dataclasses.asdict(two_nodes)) == two_nodes


def test_pretrain_flow_flags_reach_the_stage_params():
    from flows.pretrain import PretrainFlowConfig, parse

    config = parse(
        ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29500"]
    )
    assert config.launch == LaunchParams(nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert (
        PretrainFlowConfig.model_validate_json(config.model_dump_json()).launch == config.launch
    )  # deployments
    assert parse(["--launcher", "slurm", "--nnodes", "4"]).launch.launcher == "slurm"
