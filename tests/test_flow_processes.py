"""Flow command lines as real processes: two at once on one store and one Prefect home, and a SIGKILL of a
flow leaving no server or worker process behind. Each flow here starts its own temporary Prefect server."""

from __future__ import annotations

import glob
import json
import lzma
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.download import EMBEDDED_CORPUS

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """The first 24 chapters of the embedded corpus: a flow on it takes seconds."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with lzma.open(EMBEDDED_CORPUS, "rt") as source, open(path, "w") as out:
        out.writelines(line for _, line in zip(range(24), source, strict=False))
    return path


def _flow(store: Path, corpus: Path, home: Path, runner: str, **popen) -> subprocess.Popen:
    """`python -m flows.corpus` with a Prefect home of its own and no PREFECT_API_URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", OMP_NUM_THREADS="1",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")  # fmt: skip
    command = [
        sys.executable, "-m", "flows.corpus", "--store", str(store), "--download.source", str(corpus),
        "--download.docs-per-shard", "8", "--tokenize.workers", "1", "--task-runner", runner, "--workers", "2",
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, **popen)


def test_two_flows_at_once_on_one_store_and_prefect_home_both_finish(small_corpus, tmp_path):
    store, home = tmp_path / "store", tmp_path / "prefect-home"
    logs = [tmp_path / f"flow{n}.log" for n in range(2)]
    with open(logs[0], "w") as first, open(logs[1], "w") as second:
        procs = [
            _flow(store, small_corpus, home, runner, stdout=out, stderr=subprocess.STDOUT)
            for runner, out in (("threads", first), ("processes", second))
        ]
        codes = [proc.wait(600) for proc in procs]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n\n".join(output[-3000:] for output in outputs)
    assert not any("Error logging to API" in output for output in outputs)  # logs drained before shutdown
    # Every thread and worker talks to the flow's server: Prefect started no temporary server of its own.
    assert not any("Starting temporary server" in output for output in outputs)
    tokens = [re.search(r"^tokens: (.+)$", output, re.MULTILINE).group(1) for output in outputs]
    assert tokens[0] == tokens[1] and os.path.exists(os.path.join(tokens[0], "manifest.json"))
    # Each stage was committed once; whichever flow lost a race reports a cache hit, none left scratch behind.
    for stage in ("download", "clean", "dedup", "train_tokenizer", "tokenize"):
        assert len(glob.glob(str(store / stage / "*" / "manifest.json"))) == 1, stage
    assert not [p for p in (store / ".scratch").rglob("*") if p.is_file() and p.suffix != ".lock"]


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_sigkill_of_a_flow_leaves_no_server_or_worker_running(small_corpus, tmp_path):
    proc = _flow(tmp_path / "store", small_corpus, tmp_path / "home", "processes",
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # the clean stage's shards run on pool workers
        if glob.glob(str(tmp_path / "store" / "clean" / "*" / "_shards" / "*.json")):
            break
        time.sleep(0.05)
    children = _children(proc.pid)
    assert proc.poll() is None and len(children) >= 2, "the flow ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.2)
    survivors = [pid for pid in children if _alive(pid)]
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") for pid in survivors}
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], json.dumps(commands)


LAUNCHER = """
import sys
from stages.pretrain import launch
launch([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
       on_line=lambda line: print(line, flush=True))
"""


def test_sigkill_of_the_stage_stops_its_training_job(tmp_path):
    """The pretrain stage's job (torchrun in a session of its own) gets SIGTERM when the stage's process dies."""
    parent = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    job = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{job}"):
        with open(f"/proc/{job}/stat") as stat:
            if stat.read().split(")")[1].split()[0] == "Z":  # exited, waiting to be reaped by init
                break
        time.sleep(0.1)
    else:
        assert not os.path.exists(f"/proc/{job}"), "the training job outlived its stage"
