"""The generation server with a Retro checkpoint (`run_text_generation_server --retro-project-dir`): answers equal
`generate_with_retrieval`, the neighbours come from the project's database at request time, beam search and
multi-rank serving are refused."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TrainingProgress, save_checkpoint
from megatron_train.data.config import DataConfig
from megatron_train.inference.checkpoint import load_for_inference
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.models.retro import RetroModel
from megatron_train.models.retro_config import RetroConfig
from megatron_train.tokenizer.null import NullTokenizer
from megatron_train.tools import run_text_generation_server as server_tool
from megatron_train.training.config import CheckpointConfig, TokenizerConfig
from retro import family as retro_family
from retro.retrieval import RetrievingModel, generate_with_retrieval
from tests.helpers.retro_project import CHUNK_LENGTH, VOCAB_SIZE, bag_of_tokens, build_project, twin_documents
from tests.helpers.tiny import tiny_config

LIMITS = ServerLimits(max_batch_size=4, max_tokens_to_generate=16, max_tokens_to_oom=400)
PROMPTS = ["5 17 3 99 40 2 8", "60 61 62 63 64"]


def save_tiny_retro_checkpoint(directory: str) -> str:
    """A randomly initialised 6-layer RetroModel (one Retro layer, the 6th) saved as pretrain_retro saves."""
    torch.manual_seed(0)
    model_config = tiny_config(num_layers=6, max_position_embeddings=64, init_method_std=0.2)
    retro = RetroConfig(
        retro_chunk_length=CHUNK_LENGTH,
        retro_encoder_hidden_dropout=0.0,
        retro_encoder_attention_dropout=0.0,
    )
    model = RetroModel(model_config, 128, retro=retro)
    config = MegatronConfig(
        model=model_config,
        retro=retro,
        data=DataConfig(),
        checkpoint=CheckpointConfig(save=directory),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB_SIZE),
    )
    save_checkpoint(1, model, None, None, TrainingProgress(), config, padded_vocab_size=128)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_retro_checkpoint(str(tmp_path_factory.mktemp("retro_ckpt")))


@pytest.fixture(scope="module")
def projects(tmp_path_factory) -> tuple[str, str]:
    """Two projects with the same settings and different databases (other documents)."""
    first, second = (str(tmp_path_factory.mktemp(name)) for name in ("project_a", "project_b"))
    build_project(first, twin_documents(40, seed=0))
    build_project(second, twin_documents(40, seed=1))
    return first, second


def served(checkpoint: str, project: str, *flags: str) -> RetrievingModel:
    args = server_tool.build_parser().parse_args(
        ["--load", checkpoint, "--retro-project-dir", project, "--retro-query-nprobe", "1", *flags]
    )
    with mock.patch.object(retro_family, "load_embedder", lambda path, device: bag_of_tokens):
        model, tokenizer, _ = load_for_inference(args)
    assert isinstance(model, RetrievingModel) and isinstance(tokenizer, NullTokenizer)
    return model


def client_for(model: RetrievingModel) -> TestClient:
    return TestClient(create_app(model, NullTokenizer(VOCAB_SIZE), LIMITS))


def put(client: TestClient, body: dict) -> tuple[int, dict]:
    response = client.put("/api", content=json.dumps(body), headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


def test_server_answers_equal_generate_with_retrieval(checkpoint, projects):
    model = served(checkpoint, projects[0])
    client = client_for(model)
    tokenizer = NullTokenizer(VOCAB_SIZE)
    expected = [
        tokenizer.tokenize(p)
        + generate_with_retrieval(model.model, model.retriever, tokenizer.tokenize(p), 6)
        for p in PROMPTS
    ]
    status, answer = put(client, {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1})
    assert status == 200
    assert answer["tokens"] == expected  # both prompts in one batch, each retrieving for its own text
    response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200
    generated = expected[0][len(tokenizer.tokenize(PROMPTS[0])) :]
    assert response.json()["choices"][0]["text"] == tokenizer.detokenize(generated)


def test_the_neighbours_come_from_the_projects_database(checkpoint, projects):
    body = {"prompts": PROMPTS[:1], "tokens_to_generate": 6, "top_k": 1, "logprobs": True}
    answers = [put(client_for(served(checkpoint, project)), body)[1] for project in (*projects, projects[0])]
    assert answers[0] == answers[2]  # same database: the same answer
    assert not np.allclose(answers[0]["logprobs"], answers[1]["logprobs"])  # another database: another one
    prompt_length = len(PROMPTS[0].split())
    assert answers[0]["tokens"][0][prompt_length:] != answers[1]["tokens"][0][prompt_length:]


def test_sampling_is_served_and_seeded(checkpoint, projects):
    client = client_for(served(checkpoint, projects[0]))
    body = {"prompts": PROMPTS[:1], "tokens_to_generate": 8, "top_k": 20, "temperature": 1.5}
    first = put(client, {**body, "random_seed": 3})
    assert first[0] == 200 and len(first[1]["tokens"][0]) > len(PROMPTS[0].split())
    assert put(client, {**body, "random_seed": 3}) == first


def test_beam_search_is_refused_for_retro(checkpoint, projects):
    status, answer = put(
        client_for(served(checkpoint, projects[0])),
        {"prompts": PROMPTS[:1], "tokens_to_generate": 4, "beam_width": 2},
    )
    assert status == 400 and "beam search (beam_width) needs a KV cache" in answer["message"]


def test_a_retro_checkpoint_needs_its_project_and_one_process(checkpoint, projects, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        server_tool.main(["--load", checkpoint])
    error = capsys.readouterr().err
    assert "holds a retro model" in error and "--retro-project-dir DIR" in error
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        server_tool.main(["--load", checkpoint, "--retro-project-dir", projects[0]])
    assert "a Retro model is served by one process" in capsys.readouterr().err
