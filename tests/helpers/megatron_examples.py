"""Megatron-LM's example scripts (tests/fixtures/megatron_examples) run with a stand-in `torchrun` that records
the argv they pass to the entry point."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_examples"


def example_argv(script: str, workdir: Path, *positional: str, entry: str = "pretrain_gpt.py") -> list[str]:
    """Run Megatron's example `script` with bash in `workdir`; return what it passes to `entry`."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    torchrun = bin_dir / "torchrun"
    torchrun.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_RECORD"\n')
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    (workdir / "pretrain_gpt.py").write_text("")  # the Llama script checks that it runs in Megatron's root
    record = workdir / "argv.txt"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_RECORD": str(record)}
    subprocess.run(["bash", str(FIXTURES / script), *positional], cwd=workdir, env=env, check=True)
    words = record.read_text().splitlines()
    return words[words.index(entry) + 1 :]
