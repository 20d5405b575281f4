"""Cache keys that see code: a stage's key covers the import closure of its module by content (relative to the
project root) and its libraries' versions. Editing a stage's code reruns that stage and every stage after it,
the stages before it stay cache hits, and `--reuse-across-code-changes` keeps the artifacts built before the
edit. The project is copied to a temporary folder, so the edit never touches this checkout."""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages import clean, pretrain
from stages.download import EMBEDDED_CORPUS
from storage.code_fingerprint import describe_code

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "stages", "megatron_train", "retro", "flows")

# The corpus DAG (flows.corpus_plan.corpus_stages) with plain stage calls, no Prefect, once per mode given
# ("reuse": --reuse-across-code-changes): what each stage returned, then whether torch and Prefect were imported.
RUN_CORPUS = """
import json, sys
from flows.corpus_plan import CorpusConfig, corpus_stages
from stages.registry import input_refs, stage_named
from stages.shards import process_pool

def runner(config):
    def run(stage, params, inputs):
        runner, store = stage_named(stage), config.store_for()
        extra = {"map_shards": process_pool(1)} if runner.maps_shards else {}
        return runner.run(runner.params_from_dict(params), input_refs(store, inputs), store, **extra).to_dict()
    return run

for mode in sys.argv[2:]:
    config = CorpusConfig.model_validate_json(sys.argv[1]).model_copy(
        update={"reuse_across_code_changes": mode == "reuse"}
    )
    refs = corpus_stages(config, runner(config))
    print(json.dumps({stage: [ref["key"], ref["cache_hit"]] for stage, ref in refs.items()}))
print("torch" in sys.modules, "prefect" in sys.modules)
"""


def _copy_project(destination: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, destination / package, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def _python(project: Path, code: str, *args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=project,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(project), "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [
        line for line in done.stdout.splitlines() if line.strip()
    ]  # the tokenizer trainer prints blank lines


def test_the_code_is_the_import_closure_by_content_wherever_the_project_lies(tmp_path):
    code = describe_code(("stages.clean",), ("ftfy",))
    assert {"stages/clean.py", "stages/quality_filters.py", "stages/base.py", "storage/artifacts.py"} <= set(
        code["files"]
    )
    assert not any(name.startswith(("flows/", "megatron_train/models")) for name in code["files"])
    assert code["libraries"] == {"ftfy": clean.ftfy.__version__}
    # The pretrain stage's code includes the torchrun entry point its model launches, and torch's version.
    pretrain_code = pretrain.STAGE.code(pretrain.PretrainParams())
    assert "megatron_train/pretrain_gpt.py" in pretrain_code["files"] and pretrain_code["libraries"]["torch"]
    # Another copy of the project gives the same fingerprints, and computing them imports no torch.
    copy = _copy_project(tmp_path / "elsewhere")
    probe = (
        "import sys; from storage.code_fingerprint import describe_code; "
        "print(describe_code(('stages.clean',), ('ftfy',))['fingerprint']); "
        "print(describe_code(('stages.pretrain', 'megatron_train.pretrain_gpt'), ('torch',))['fingerprint']); "
        "print('torch' in sys.modules)"
    )
    assert _python(copy, probe) == [
        code["fingerprint"],
        describe_code(("stages.pretrain", "megatron_train.pretrain_gpt"), ("torch",))["fingerprint"],
        "False",
    ]


def test_editing_a_stages_code_reruns_it_and_what_follows(tmp_path):
    project = _copy_project(tmp_path / "project")
    source = tmp_path / "chapters.jsonl"
    with lzma.open(EMBEDDED_CORPUS, "rt") as f:
        source.write_text("".join(line for _, line in zip(range(12), f, strict=False)))
    config = {
        "store": str(tmp_path / "store"),
        "download": {"source": str(source), "docs_per_shard": 6},
        "train_tokenizer": {"kind": "bpe", "vocab_size": 300},
        "tokenize": {"append_eod": True, "workers": 1},
    }
    before, modules = _python(project, RUN_CORPUS, json.dumps(config), "normal")
    before = json.loads(before)
    assert not any(hit for _, hit in before.values()) and modules == "False False"

    # A bug fixed in the clean stage. With --reuse-across-code-changes: yesterday's artifacts, all cache hits.
    # Without: download stays a cache hit, clean and every stage after it run again.
    (project / "stages" / "clean.py").write_text(
        (project / "stages" / "clean.py").read_text() + "\n# fixed\n"
    )
    reused, after, _ = _python(project, RUN_CORPUS, json.dumps(config), "reuse", "normal")
    assert json.loads(reused) == {stage: [key, True] for stage, (key, _) in before.items()}
    after = json.loads(after)
    assert after["download"] == [before["download"][0], True]
    for stage in ("clean", "dedup", "train_tokenizer", "tokenize"):
        assert not after[stage][1] and after[stage][0] != before[stage][0], stage
