"""Adding a model family is one registration: the toy family of `tests/helpers/toy_family.py` (a causal convolution
LM, defined outside the project) is trained by `torchrun` on 2 processes, saved, resharded by `checkpoint_util`,
loaded and served through the project's entry points with `--model-family tests.helpers.toy_family:TOY`, no other
module touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.inference.checkpoint import load_for_inference
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.tools import checkpoint_util
from megatron_train.tools import run_text_generation_server as server_tool
from tests.helpers.distributed import free_port
from tests.helpers.toy_family import TOY
from tests.helpers.training import ROOT, read_metrics, tiny_args, write_corpus

SPEC = "tests.helpers.toy_family:TOY"
pytestmark = pytest.mark.processes  # every test here uses the torchrun-trained checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """8 steps of the toy model under torchrun, TP=2 (its vocab-parallel embedding and output layer split), saved
    at iterations 4 and 8."""
    work = tmp_path_factory.mktemp("toy")
    run = str(work / "run")
    corpus = write_corpus(str(work))
    argv = tiny_args(run, "--data-path", corpus, "--split", "90,10,0", "--train-iters", "8", "--lr", "2e-2")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "megatron_train.pretrain", "--model-family", SPEC, "--tensor-model-parallel-size", "2",
        "--save-interval", "4", *argv,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_the_toy_family_trains_and_its_checkpoint_records_it(trained):
    losses = [r["lm loss"] for r in read_metrics(trained) if "split" not in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3  # it learns the counting corpus
    with open(os.path.join(trained, "iter_0000008", "metadata.json")) as handle:
        metadata = json.load(handle)
    assert (metadata["model_type"], metadata["model_family"]) == ("toy", SPEC)
    assert metadata["tensor_model_parallel_size"] == 2
    model, config = load_model_for_inference(trained, model_family=SPEC)
    assert TOY.terms(config, model.vocab_size).num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(
        ValueError, match=f"pass --model-family {SPEC} to do so"
    ):  # the checkpoint alone runs nothing
        load_model_for_inference(trained)


def test_the_toy_checkpoint_is_resharded_and_served(trained, tmp_path, capsys):
    resharded = str(tmp_path / "tp1")
    checkpoint_util.main(
        [
            "--load-dir",
            trained,
            "--save-dir",
            resharded,
            "--target-tensor-parallel-size",
            "1",
            "--model-family",
            SPEC,
        ]
    )
    with pytest.raises(SystemExit):
        checkpoint_util.main(
            ["--load-dir", trained, "--save-dir", str(tmp_path / "hf"), "--loader", "flow", "--saver", "hf",
             "--model-family", SPEC]
        )  # fmt: skip
    assert "--saver hf: the toy family has no Hugging Face mapping" in capsys.readouterr().err
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits = [load_model_for_inference(path, model_family=SPEC)[0](tokens) for path in (trained, resharded)]
    torch.testing.assert_close(logits[0], logits[1])

    args = server_tool.build_parser().parse_args(["--load", resharded, "--model-family", SPEC])
    model, tokenizer, _ = load_for_inference(args)
    client = TestClient(
        create_app(model, tokenizer, ServerLimits(max_batch_size=2, max_tokens_to_generate=8))
    )
    answer = client.put("/api", json={"prompts": ["5 6 7 8 9 10"], "tokens_to_generate": 4, "top_k": 1})
    assert answer.status_code == 200, answer.text
    expected = tokens.tolist()[0]
    for _ in range(4):  # greedy decoding by hand: the server reruns the text (the toy model has no KV cache)
        expected.append(int(model(torch.tensor([expected]))[0, -1].argmax()))
    assert answer.json()["text"][0].split() == [str(t) for t in expected]
    beams = client.put("/api", json={"prompts": ["5 6"], "tokens_to_generate": 2, "beam_width": 2})
    assert beams.status_code == 400 and "needs a KV cache" in beams.json()["message"]
