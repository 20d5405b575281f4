"""Serving a model split over ranks (gloo): TP=2 and PP=2 give the tokens and logprobs of one process, for
greedy and seeded sampling, top logprobs and beam search; and the torchrun server answers HTTP from rank 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.inference.beam_search import BeamSearchParams, beam_search
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.tokenizer import build_tokenizer
from megatron_train.tools.text_generation_cli import put_request
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.generation import one_torch_thread, save_tiny_checkpoint  # noqa: F401 (one_torch_thread is an autouse fixture)
from tests.helpers.readiness import wait_until_ready
from tests.helpers.servers import generation_server_healthy

pytestmark = pytest.mark.processes  # every test here starts processes

PROMPTS = ["5 6 7", "1 2 3 4 5 6 7 8"]
GREEDY = GenerationParams(tokens_to_generate=6, top_k=1, return_output_log_probs=True, top_logprobs=3)
SEEDED = GenerationParams(tokens_to_generate=6, temperature=2.0, random_seed=3)
BEAM = BeamSearchParams(beam_width=3, tokens_to_generate=5)
LAYOUTS = [(2, 1), (1, 2)]  # (TP, PP)


def save_tiny_llama_checkpoint(directory: str) -> str:
    """A tiny Llama (GQA, RoPE, untied output layer) checkpoint whose tokenizer is NullTokenizer(100)."""
    from megatron_train.models.gpt import GPTModel
    from tests.helpers.tiny import tiny_llama_config

    torch.manual_seed(1)
    model = GPTModel(tiny_llama_config(seq_length=64, init_method_std=0.2), vocab_size=128)
    return save_tiny_checkpoint(directory, model)


def answers(model: torch.nn.Module) -> dict:
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    greedy = generate(model, tokenizer, PROMPTS, GREEDY)
    beams = beam_search(model, tokenizer, PROMPTS[0], BEAM)
    return {
        "tokens": greedy.tokens,
        "logprobs": greedy.logprobs,
        "top_ids": [[[token for token, _ in top] for top in row] for row in greedy.top_logprobs],
        "sampled": generate(model, tokenizer, PROMPTS, SEEDED).tokens,
        "beams": beams.tokens,
        "beam_scores": beams.scores,
    }


def _answers_in_layouts(rank: int, world_size: int, loads: list[str]) -> dict:
    from megatron_train.checkpointing import load_model_stage_for_inference
    from megatron_train.parallel import state

    results = {}
    for tp, pp in LAYOUTS:
        state.initialize_model_parallel(tp, pp)
        for load in loads:
            model, _ = load_model_stage_for_inference(load)
            results[(load, tp, pp)] = answers(model)
        state.destroy_model_parallel()
    return results


def test_tp2_and_pp2_serve_what_one_process_serves(tmp_path):
    loads = [save_tiny_checkpoint(str(tmp_path / "gpt")), save_tiny_llama_checkpoint(str(tmp_path / "llama"))]
    expected = {load: answers(load_model_for_inference(load)[0]) for load in loads}
    for rank_results in run_distributed(_answers_in_layouts, 2, loads):
        for (load, tp, pp), got in rank_results.items():
            want = expected[load]
            where = f"{os.path.basename(load)} TP={tp} PP={pp}"
            for key in ("tokens", "top_ids", "sampled", "beams"):
                assert got[key] == want[key], f"{where}: {key}"
            for key in ("logprobs", "beam_scores"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=where)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2)])
def test_torchrun_server_answers_from_rank_0(tmp_path, tp, pp):
    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp),
        "--master-port", str(free_port()), "-m", "megatron_train.tools.run_text_generation_server",
        "--load", load, "--port", str(port), "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp),
    ]  # fmt: skip
    server = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        wait_until_ready(
            lambda: generation_server_healthy(port),
            "the torchrun text generation server",
            process=server,
            output=lambda: server.stderr.read().decode(),
        )
        url = f"http://127.0.0.1:{port}/api"
        status, greedy = put_request(
            url, {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1, "logprobs": True}
        )
        assert status == 200, greedy
        status, beams = put_request(url, {"prompts": PROMPTS[:1], "tokens_to_generate": 5, "beam_width": 3})
        assert status == 200, beams
        status, error = put_request(url, {"prompts": ["1 2"], "tokens_to_generate": 2, "top_k": "x"})
        assert status == 400 and "top_k must be an integer" in error["message"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    expected = answers(load_model_for_inference(load)[0])
    assert greedy["tokens"] == expected["tokens"]
    torch.testing.assert_close(greedy["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5)
    assert [text.split() for text in beams["text"]] == [[str(t) for t in row] for row in expected["beams"]]
