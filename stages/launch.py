"""How the pretrain stage starts its training processes: `torchrun` on one node or many, or a Slurm batch job.

One node: `torchrun --standalone --nproc-per-node N`. Several: every node runs one `torchrun` agent with the
same `--nnodes`, `--rdzv-backend c10d --rdzv-endpoint host:port` and its own `--node-rank`; the agents meet at
the endpoint (node 0 hosts the rendezvous store) and number the processes node by node. `--launcher slurm`
writes a batch script whose `srun` starts one agent per node with the same flags (the node rank from
`$SLURM_NODEID`, the endpoint on the job's first node). The GPU-cluster set-up is in docs/architecture.md
("Multi-node training").
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from typing import Literal

DEFAULT_RDZV_PORT = 29500
# Shell words the batch script leaves for the shell to expand on each node (never quoted).
_SLURM_NODE_RANK = "$SLURM_NODEID"
_SLURM_ENDPOINT = f"$HEAD_NODE:{DEFAULT_RDZV_PORT}"


@dataclass(frozen=True)
class LaunchParams:
    """Where the training processes run. Only `nnodes` enters the stage's key (it sets the world size); the
    node rank, the rendezvous and the launcher say where the same run happens."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port reachable from every node; node 0 hosts the rendezvous
    rdzv_id: str = "megatron-flow"  # names the job at the endpoint: agents of one job share it
    launcher: Literal["torchrun", "slurm"] = "torchrun"

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is not in [0, {self.nnodes}) (--nnodes {self.nnodes})"
            )
        if self.launcher not in ("torchrun", "slurm"):
            raise ValueError(f"unknown --launcher {self.launcher!r}: use torchrun or slurm")
        if self.nnodes > 1 and self.launcher == "torchrun" and not self.rdzv_endpoint:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint host:port, an address of node 0 that every node "
                "reaches (e.g. --rdzv-endpoint node0:29500)"
            )


def torchrun_args(nproc_per_node: int, launch: LaunchParams) -> list[str]:
    """The `torch.distributed.run` flags for this node."""
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        return ["--standalone", f"--nproc-per-node={nproc_per_node}"]
    return [
        f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}", f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}", f"--rdzv-id={launch.rdzv_id}",
    ]  # fmt: skip


def torchrun_command(nproc_per_node: int, launch: LaunchParams, module: str, argv: list[str]) -> list[str]:
    """`python -m torch.distributed.run <launch flags> -m <module> <argv>` for this node."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(nproc_per_node, launch),
        "-m",
        module,
        *argv,
    ]


def slurm_script(
    nproc_per_node: int, launch: LaunchParams, module: str, argv: list[str], log_file: str
) -> str:
    """An sbatch script running the job on `launch.nnodes` nodes: one agent per node through `srun`, with the
    torchrun flags of `torchrun_args` (node rank `$SLURM_NODEID`, endpoint on the job's first node unless
    `rdzv_endpoint` is given)."""
    per_node = dataclasses.replace(launch, node_rank=0, rdzv_endpoint=launch.rdzv_endpoint or _SLURM_ENDPOINT)
    words = torchrun_command(nproc_per_node, per_node, module, argv)
    words = [f"--node-rank={_SLURM_NODE_RANK}" if w == "--node-rank=0" else w for w in words]
    # Quoted for the shell that srun starts on each node, except the per-node variables it must expand.
    command = " ".join(w if _SLURM_NODE_RANK in w or "$HEAD_NODE" in w else shlex.quote(w) for w in words)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={launch.rdzv_id}",
        f"#SBATCH --nodes={launch.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc_per_node}",
        f"#SBATCH --output={log_file}",
        "set -euo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export HEAD_NODE",
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(command)}",
        "",
    ])  # fmt: skip
