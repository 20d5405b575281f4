"""The stage protocol: one registry, the map_shards flag, the key from one place, params from plain JSON."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

from stages import download, tokenize
from stages.base import Stage
from stages.registry import STAGE_MODULES, stage_named
from stages.shards import process_pool
from stages.tokenize_params import TokenizeParams
from storage.artifacts import ArtifactStore, stage_key

STAGES = {name: stage_named(name) for name in STAGE_MODULES}


def test_registry_names_every_stage_and_says_which_map_shards():
    assert list(STAGES) == [
        "download",
        "clean",
        "dedup",
        "train_tokenizer",
        "tokenize",
        "pretrain",
        "evaluate",
        "convert",
        "retro_embedder",
        "retro_db",
        "retro_embed",
        "retro_index_train",
        "retro_index_add",
        "retro_query",
        "retro_pretrain",
        "retro_evaluate",
    ]
    mapping = {"clean", "dedup", "tokenize", "retro_embed", "retro_index_add"}
    assert {name for name, stage in STAGES.items() if stage.maps_shards} == mapping
    for name, stage in STAGES.items():
        assert isinstance(stage, Stage) and stage.name == name and stage.version
        # A flow passes map_shards exactly to the stages that declare it; no stage takes arguments it ignores.
        parameters = list(inspect.signature(stage.run).parameters)
        assert parameters[:3] == ["params", "inputs", "store"]
        assert ("map_shards" in parameters) == stage.maps_shards
        assert "workers" not in parameters


@pytest.mark.processes
def test_registry_imports_a_stage_on_first_look_up_and_names_the_known_ones():
    # The corpus stages come without torch, so a command line with nothing to do stays quick.
    code = (
        "import sys; from stages.registry import stage_named; "
        "[stage_named(n) for n in ('download', 'clean', 'dedup', 'train_tokenizer', 'tokenize')]; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    with pytest.raises(ValueError, match=r"unknown stage 'tokenise'; stages: download, clean, .*evaluate"):
        stage_named("tokenise")


@pytest.mark.parametrize(
    "name",
    [
        "download",
        "clean",
        "dedup",
        "train_tokenizer",
        "tokenize",
        "evaluate",
        "convert",
        "retro_pretrain",
        "retro_evaluate",
    ],
)
def test_params_load_from_the_json_a_prefect_task_receives(name):
    stage = STAGES[name]
    params = stage.Params()
    assert stage.params_from_dict(json.loads(json.dumps(dataclasses.asdict(params)))) == params


def test_tokenize_params_from_json_stay_hashable():
    params = TokenizeParams(json_keys=["text", "title"])  # a list, as JSON gives it
    assert params.json_keys == ("text", "title") and hash(params) == hash(
        TokenizeParams(json_keys=("text", "title"))
    )


def test_key_comes_from_the_stage_hooks(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a b c"}\n')
    params = download.DownloadParams(source=str(path))
    expected = stage_key("download", "1", dataclasses.replace(params, storage_options={}), [
        download.source_description(params)
    ], download.STAGE.code(params)["fingerprint"])  # fmt: skip
    with_credentials = dataclasses.replace(params, storage_options={"key": "secret"})
    assert download.key(params, []) == download.key(with_credentials, []) == expected
    ref = download.run(params, [], ArtifactStore(str(tmp_path / "store")))
    assert ref.key == expected and "secret" not in json.dumps(ref.manifest())

    tokenize_params = TokenizeParams(tokenizer_type="NullTokenizer", vocab_size=100, workers=1)
    assert tokenize.key(tokenize_params, str(path)) == tokenize.key(
        dataclasses.replace(tokenize_params, workers=5, fail_on_empty=True), [str(path)]
    )


def test_download_takes_no_inputs(tmp_path):
    with pytest.raises(
        ValueError, match=r"the download stage takes no inputs \(its source is params\.source"
    ):
        download.run(download.DownloadParams(), ["s3://somewhere"], ArtifactStore(str(tmp_path)))


def _square(x: int) -> int:
    return x * x


@pytest.mark.processes
@pytest.mark.parametrize("workers", [1, 2])
def test_process_pool_reports_each_result_as_it_finishes_and_returns_them_in_order(workers):
    seen: list[int] = []
    results = process_pool(workers)(_square, [(i,) for i in range(6)], seen.append)
    assert results == [0, 1, 4, 9, 16, 25] and sorted(seen) == results
