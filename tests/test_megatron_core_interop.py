"""Our `torch_dist` and legacy `megatron` checkpoints against Megatron-Core itself (tests/helpers/megatron_core_interop.py,
run in a fresh process: it needs a process group, and dist_checkpointing spawns writers). megatron-core is a
dev dependency (pyproject.toml), so these run in CI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
@pytest.mark.parametrize("embeddings", ["tied", "untied"])
def test_megatron_core_loads_our_save_and_we_load_its_save(layout, embeddings):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, *sys.path])}
    run = subprocess.run([sys.executable, "-m", "tests.helpers.megatron_core_interop", embeddings, layout], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "megatron-core interop ok" in run.stdout, (
        run.stdout[-2000:] + run.stderr[-4000:]
    )


def test_megatron_core_and_we_read_each_others_moe_checkpoints():
    """An MoE GPT (top-2 of 4 experts, gated shared expert): Megatron-Core loads our torch_dist save (stacked expert
    keys, TP2 x PP2) and our legacy save computing our logits, its torch_dist save has exactly our keys, and we load
    its torch_dist and legacy saves (`local_experts.<j>`) to its logits; our routing (top k, pre-softmax,
    scaled, group-limited, sigmoid with expert bias, Sinkhorn, token dropping) and aux / z losses equal its
    moe_utils' on the same logits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, *sys.path])}
    run = subprocess.run([sys.executable, "-m", "tests.helpers.megatron_core_interop", "moe"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.count("megatron-core interop ok") == 3, (
        run.stdout[-2000:] + run.stderr[-4000:]
    )
