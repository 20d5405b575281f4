"""`make gpu-check` on a machine without CUDA: one line saying it skipped, exit status 0 (this machine has no GPU;
the check itself runs where one is, with that machine's python3 and CUDA torch). Its structure is what lets it run
there: no venv, nothing installed, torch imported only inside the checks."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.training import ROOT

MODULE = Path(ROOT) / "megatron_train" / "tools" / "gpu_check.py"


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_gpu_check_skips_in_one_line_without_cuda() -> None:
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu-check: skipped: no CUDA device (torch {torch.__version__}, CUDA build None)"
    ]
    # a python3 without torch (here: site-packages left out by -S)
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable} -S"], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"gpu-check: skipped: {sys.executable} has no torch"]


def test_gpu_check_needs_no_setup_and_imports_only_the_standard_library_at_load() -> None:
    """A python3 without torch gets the skip line, not an ImportError: the module's top-level imports are the
    standard library's; the Makefile target neither depends on `setup` nor names the venv."""
    tree = ast.parse(MODULE.read_text())
    top_level = {
        alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names
    }
    top_level |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top_level <= set(sys.stdlib_module_names) | {"__future__"}, top_level
    makefile = (Path(ROOT) / "Makefile").read_text()
    target = re.search(r"^gpu-check:(.*)\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert target is not None and target.group(1).strip() == ""
    assert "$(PY)" not in target.group(
        2
    ) and "$(GPU_PYTHON) -m megatron_train.tools.gpu_check" in target.group(2)
    checks = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
    }
    assert checks == {"check_nccl", "check_precision", "check_kernels", "check_throughput"}
