"""Megatron-LM's own command lines as test fixtures (tests/fixtures/megatron_examples): its newer example scripts
run with a stand-in `torchrun` that records the argv they pass to the entry point, and its older scripts and
README commands read without running them.

The older scripts hold placeholders (`CHECKPOINT_PATH=<Specify path>`) that stop bash, and the README's commands
are fenced blocks of a Markdown file, so `shell_commands` reads shell text as bash would for what matters here:
comments dropped, continued lines joined, `NAME=value` assignments remembered and `$NAME` / `${NAME}` expanded in
later lines (a README's `NAME=<same as ... above>` keeps the value NAME has), and the words after the entry
script (up to a shell operator) taken as its argv.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_examples"
# Megatron-LM's scripts (by the path its commands give) -> the entry point here that takes their command line.
ENTRY_POINTS = {
    "pretrain_gpt.py": "pretrain_gpt",
    "pretrain_gpt2.py": "pretrain_gpt",  # its name until 2020
    "pretrain_bert.py": "pretrain_bert",
    "pretrain_t5.py": "pretrain_t5",
    "pretrain_t5_core.py": "pretrain_t5",
    "tasks/main.py": "tasks.main",
    "tools/preprocess_data.py": "preprocess_data",
    "tools/run_text_generation_server.py": "run_text_generation_server",
    "tools/checkpoint_util.py": "checkpoint_util",
    "tools/checkpoint/util.py": "checkpoint_util",
    "tools/checkpoint/convert.py": "checkpoint_util",
}
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1"}
ASSIGNMENT = re.compile(r"(?:export\s+)?([A-Za-z_]\w*)=(.*)", re.S)
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+)|@)")


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


def _logical_lines(text: str) -> list[str]:
    """Lines with comments and prompts (`$ `, `> ` in a README) dropped, backslash continuations and lines inside
    an open double quote joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        line = re.sub(r"^\s*[>$]\s", "", raw).rstrip()
        if not current and line.lstrip().startswith("#"):
            continue
        continued = line.endswith("\\")
        current += (line[:-1] if continued else line) + " "
        if not continued and current.count('"') % 2 == 0:
            lines.append(current.strip())
            current = ""
    return [*lines, current.strip()] if current.strip() else lines


def _expand(text: str, variables: dict[str, str]) -> str:
    return VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2) or "", ""), text)


def shell_commands(text: str, variables: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """(entry point, argv) of each command in shell `text` that runs one of Megatron's ENTRY_POINTS. Assignments
    go into `variables` (pass one dict for several blocks of one README: later blocks use earlier ones)."""
    variables = {} if variables is None else variables
    commands = []
    for line in _logical_lines(text):
        assignment = ASSIGNMENT.fullmatch(line)
        if assignment:
            name, value = assignment.groups()
            quote = value[0] if len(value) > 1 and value[0] in "'\"" and value.endswith(value[0]) else ""
            value = value[1:-1] if quote else value
            if name in variables and re.fullmatch(r"<[^<>]*>", value):
                continue  # the README's "OUTPUT_ARGS=<same as those in BERT pretraining above>"
            variables[name] = value if quote == "'" else _expand(value, variables)
            continue
        words = _expand(line, variables).replace('"', " ").replace("'", " ").split()
        for i, word in enumerate(words):
            entry = next(
                (e for script, e in ENTRY_POINTS.items() if word == script or word.endswith("/" + script)),
                None,
            )
            if entry is not None:
                argv = words[i + 1 :]
                end = next((j for j, w in enumerate(argv) if w in SHELL_OPERATORS), len(argv))
                commands.append((entry, argv[:end]))
                break
    return commands


def flag_names(argv: list[str]) -> list[str]:
    """The `--flag`s of an argv (`--flag=value` counts as `--flag`)."""
    return [word.split("=")[0] for word in argv if word.startswith("--") and len(word) > 2]
