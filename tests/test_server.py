"""The generation server: Megatron's PUT /api, OpenAI's /v1/completions, every 400, a real uvicorn server and
the interactive client."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.tokenizer import build_tokenizer
from megatron_train.tools.text_generation_cli import put_request
from tests.helpers.distributed import free_port
from tests.helpers.generation import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    CharTokenizer,
    build_tiny_gpt,
    one_torch_thread,
    save_tiny_checkpoint,
)
from tests.helpers.readiness import wait_until_ready
from tests.helpers.servers import generation_server_healthy, put, serve, uvicorn_serving

LIMITS = ServerLimits(
    max_batch_size=4, max_tokens_to_generate=32, max_tokens_to_oom=200, max_request_bytes=2000
)


@pytest.fixture(scope="module")
def model():
    return build_tiny_gpt()


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="module")
def client(model, tokenizer):
    return TestClient(create_app(model, tokenizer, LIMITS))


def test_health(client):
    assert client.get("/health").json()["status"] == "ok"


def test_api_answers_what_generate_returns(client, model, tokenizer):
    status, body = put(
        client, {"prompts": ["hello", "ab"], "tokens_to_generate": 6, "top_k": 1, "logprobs": True}
    )
    expected = generate(
        model,
        tokenizer,
        ["hello", "ab"],
        GenerationParams(tokens_to_generate=6, top_k=1, return_output_log_probs=True),
    )
    assert status == 200
    assert body["text"] == expected.texts and body["segments"] == expected.segments
    assert body["tokens"] == expected.tokens
    assert body["logprobs"] == expected.logprobs  # JSON round-trips floats exactly
    assert put(client, {"prompts": ["hello"], "tokens_to_generate": 3})[1]["logprobs"] is None


def test_api_seeded_sampling_is_reproducible(client):
    request = {"prompts": ["seed"], "tokens_to_generate": 12, "temperature": 10.0, "random_seed": 5}
    first = put(client, request)[1]["text"]
    assert first == put(client, request)[1]["text"]
    assert first != put(client, {**request, "random_seed": 6})[1]["text"]


def test_api_scores_with_zero_tokens(client, model, tokenizer):
    status, body = put(client, {"prompts": ["score me"], "tokens_to_generate": 0, "logprobs": True})
    assert status == 200 and body["text"] == ["score me"] and len(body["logprobs"][0]) == len("score me") - 1


OK = {"prompts": ["ab"], "tokens_to_generate": 2}
API_ERRORS = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    ({"tokens_to_generate": 2}, "prompts argument required"),
    ({**OK, "max_len": 4}, "max_len is no longer used"),
    ({**OK, "sentences": ["a"]}, "sentences is no longer used"),
    ({"prompts": "ab"}, "prompts is not a list of strings"),
    ({"prompts": ["ab", 3]}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["a"] * 5}, "Maximum number of prompts is 4"),
    ({**OK, "tokens_to_generate": "2"}, "tokens_to_generate must be an integer"),
    ({**OK, "tokens_to_generate": -1}, "tokens_to_generate must be an integer"),
    ({**OK, "tokens_to_generate": 33}, "between 0 and 32"),
    ({**OK, "tokens_to_generate": True}, "tokens_to_generate must be an integer"),
    ({**OK, "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
    ({**OK, "logprobs": "yes"}, "logprobs must be a boolean value"),
    ({**OK, "temperature": 0.0}, "temperature must be a positive number"),
    ({**OK, "temperature": "hot"}, "temperature must be a positive number"),
    ({**OK, "top_k": 1001}, "top_k must be an integer"),
    ({**OK, "top_k": 1.5}, "top_k must be an integer"),
    ({**OK, "top_p": 1.5}, "top_p must be a float between 0 and 1.0"),
    ({**OK, "top_k": 5, "top_p": 0.5}, "cannot set both top-k and top-p samplings."),
    ({"prompts": ["ab", ""]}, "Empty prompts require add_BOS=true"),
    ({**OK, "add_BOS": 1}, "add_BOS must be a boolean value"),
    ({**OK, "stop_on_eol": "no"}, "stop_on_eol must be a boolean value"),
    ({**OK, "random_seed": -5}, "random_seed must be a non-negative integer"),
    ({**OK, "stop_token": "x"}, "stop_token must be an integer"),
    ({**OK, "stop_strings": [""]}, "stop_strings must be a list of non-empty strings"),
    ({**OK, "beam_width": 0}, "beam_width must be an integer >= 1"),
    ({"prompts": ["ab", "c"], "beam_width": 2}, "When doing beam_search, batch size must be 1"),
    ({**OK, "beam_width": 2, "length_penalty": "long"}, "length_penalty must be a float"),
    ({"prompts": ["x" * 40] * 4, "tokens_to_generate": 20}, "Too many tokens.  240 is greater than 200"),
    (
        {"prompts": ["x" * 50], "tokens_to_generate": 20},
        "Length of prompt + tokens_to_generate longer than allowed",
    ),
    (json.dumps({"prompts": ["x" * 2100]}).encode(), "limit is 2000"),
    # each of these answered 500 before: an id no tensor holds, logits / temperature overflowing to inf,
    # a string UTF-8 cannot encode, a seed torch cannot take
    ({**OK, "stop_token": 10**30}, "stop_token must be an integer token id from 0 to 78"),
    ({**OK, "stop_token": 79}, "stop_token must be an integer token id from 0 to 78"),
    (
        {**OK, "temperature": 1e-45},
        "temperature must be a positive number less than or equal to 100.0 and at",
    ),
    ({"prompts": ["ab", "a\ud800b"]}, "prompts[1] is not valid Unicode"),
    ({**OK, "stop_strings": ["\udc00"]}, "stop_strings must be a list of non-empty strings"),
    ({**OK, "random_seed": 10**30}, "random_seed must be a non-negative integer below 2**63"),
]


@pytest.mark.parametrize(("body", "message"), API_ERRORS, ids=[message for _, message in API_ERRORS])
def test_api_bad_requests_answer_400_and_the_server_keeps_serving(client, body, message):
    status, answer = put(client, body)
    assert status == 400
    assert message in answer["message"]
    assert put(client, OK)[0] == 200


def test_the_smallest_temperature_samples(client):
    status, body = put(client, {**OK, "temperature": 1e-4, "random_seed": 1})
    assert status == 200 and body["text"][0].startswith("ab")
    assert complete(client, {"prompt": "ab", "max_tokens": 2, "temperature": 1e-4})[0] == 200


@pytest.fixture(scope="module")
def roomy_client(model, tokenizer):
    """A server that reads megabyte bodies, so its parser and logs meet them."""
    limits = ServerLimits(max_batch_size=4, max_tokens_to_generate=32, max_tokens_to_oom=200)
    return TestClient(create_app(model, tokenizer, limits))


def test_deeply_nested_json_answers_400(roomy_client):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/api", "/v1/completions"):
        response = roomy_client.request("PUT" if path == "/api" else "POST", path, content=deep)
        assert response.status_code == 400
        assert "request body is nested too deeply to parse" in response.text


def test_logs_a_bounded_summary_of_a_megabyte_request(roomy_client, caplog):
    prompts = ["y" * 250_000] * 4
    with caplog.at_level(logging.INFO, logger="megatron_train.inference.server"):
        status, answer = put(roomy_client, {"prompts": prompts, "tokens_to_generate": 2})
        huge_value = {**OK, "temperature": "z" * 900_000}
        assert put(roomy_client, huge_value)[0] == 400
    assert status == 400 and answer["message"].startswith("Too many tokens.")
    (record,) = caplog.records
    assert "4 prompt(s) of 1000000 characters" in record.getMessage()
    assert "tokens_to_generate=2" in record.getMessage()
    assert max(len(r.getMessage()) for r in caplog.records) < 400


def complete(client, body) -> tuple[int, dict]:
    response = client.post("/v1/completions", content=json.dumps(body).encode())
    return response.status_code, response.json()


def test_completions_shape_and_greedy_text(client, model, tokenizer):
    status, body = complete(
        client, {"prompt": ["hello", "ab"], "max_tokens": 5, "temperature": 0, "logprobs": 0}
    )
    expected = generate(
        model,
        tokenizer,
        ["hello", "ab"],
        GenerationParams(tokens_to_generate=5, top_k=1, return_output_log_probs=True),
    )
    assert status == 200 and body["object"] == "text_completion"
    assert [choice["text"] for choice in body["choices"]] == expected.completions
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 7
    assert body["usage"]["completion_tokens"] == sum(len(t) for t in expected.tokens) - 7
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    first = body["choices"][0]["logprobs"]
    assert first["tokens"] == expected.segments[0][5:]
    assert first["token_logprobs"] == pytest.approx(expected.logprobs[0][4:])
    assert first["text_offset"][:2] == [0, len(first["tokens"][0])]


def test_completions_echo_with_logprobs_covers_the_prompt(client, model, tokenizer):
    body = complete(
        client, {"prompt": "hello", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    )[1]
    expected = generate(
        model,
        tokenizer,
        ["hello"],
        GenerationParams(tokens_to_generate=3, top_k=1, return_output_log_probs=True),
    )
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == expected.segments[0]
    assert logprobs["token_logprobs"] == [None, *expected.logprobs[0]]


def test_completions_echo_and_stop(client, model, tokenizer):
    greedy = generate(
        model, tokenizer, ["hello"], GenerationParams(tokens_to_generate=8, top_k=1)
    ).completions[0]
    body = complete(client, {"prompt": "hello", "max_tokens": 8, "temperature": 0, "echo": True})[1]
    assert body["choices"][0]["text"] == "hello" + greedy
    stop = greedy[3:5]
    body = complete(client, {"prompt": "hello", "max_tokens": 8, "temperature": 0, "stop": stop})[1]
    assert body["choices"][0]["text"] == greedy[: greedy.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


COMPLETION_ERRORS = [
    ({"max_tokens": 2}, "prompt is required"),
    ({"prompt": 5}, "prompt is not a list of strings"),
    ({"prompt": ""}, "prompt must not be empty"),
    ({"prompt": "ab", "n": 2}, "n must be 1"),
    ({"prompt": "ab", "stream": True}, "stream is not supported"),
    ({"prompt": "ab", "max_tokens": -1}, "max_tokens must be an integer"),
    ({"prompt": "ab", "max_tokens": 0}, "max_tokens=0 needs echo=true"),
    ({"prompt": "ab", "temperature": 3}, "temperature must be between 0 and 2"),
    ({"prompt": "ab", "top_p": 0}, "top_p must be in (0, 1]"),
    ({"prompt": "ab", "logprobs": 6}, "logprobs must be 0 to 5"),
    ({"prompt": "ab", "stop": ["a", "b", "c", "d", "e"]}, "up to 4"),
    ({"prompt": "ab", "seed": -1}, "seed must be an integer"),
    ({"prompt": "ab", "temperature": 1e-300}, "temperature must be between 0 and 2"),
    ({"prompt": ["a\ud800"]}, "prompt[0] is not valid Unicode"),
    ({"prompt": "ab", "stop": "\ud800"}, "stop must be a non-empty string"),
    ({"prompt": "ab", "seed": 10**30}, "seed must be an integer >= 0 and below 2**63"),
]


@pytest.mark.parametrize(("body", "message"), COMPLETION_ERRORS, ids=[m for _, m in COMPLETION_ERRORS])
def test_completions_bad_requests(client, body, message):
    status, answer = complete(client, body)
    assert status == 400
    assert message in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def live_server(model, tokenizer):
    """A real uvicorn server, stopped after the module's tests."""
    with uvicorn_serving(create_app(model, tokenizer, LIMITS)) as address:
        yield address


def test_real_server_answers_concurrent_requests(live_server, model, tokenizer):
    requests = [
        {"prompts": ["hello"], "tokens_to_generate": 10, "top_k": 1},
        {"prompts": ["ab", "xyz"], "top_k": 1, "tokens_to_generate": 8},
    ]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda r: put_request(f"http://{live_server}/api", r, timeout=60), requests))
    for request, (status, body) in zip(requests, answers, strict=True):
        params = GenerationParams(tokens_to_generate=request["tokens_to_generate"], top_k=1)
        assert status == 200
        assert body["text"] == generate(model, tokenizer, request["prompts"], params).texts


@pytest.mark.processes
def test_cli_prints_the_response_and_errors(live_server):
    result = subprocess.run(
        [sys.executable, "-m", "megatron_train.tools.text_generation_cli", live_server],
        input="hello\n3\nab\nmany\nab\n99\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Megatron Response: \nhello" in result.stdout
    assert "Error: 'many' is not a whole number of tokens" in result.stdout
    assert "Error 400: tokens_to_generate must be an integer between 0 and 32" in result.stdout


@pytest.mark.processes
def test_run_text_generation_server_serves_a_checkpoint(tmp_path):
    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_train.tools.run_text_generation_server",
            "--load",
            load,
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_until_ready(
            lambda: generation_server_healthy(port),
            "run_text_generation_server",
            process=server,
            output=lambda: server.stderr.read().decode(),
        )
        status, body = put_request(
            f"http://127.0.0.1:{port}/api", {"prompts": ["5 6 7"], "tokens_to_generate": 4, "top_k": 1}
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    model, _ = load_model_for_inference(load)
    expected = generate(model, build_tokenizer("NullTokenizer", vocab_size=100), ["5 6 7"], GREEDY4)
    assert status == 200 and body["tokens"] == expected.tokens and body["text"] == expected.texts


GREEDY4 = GenerationParams(tokens_to_generate=4, top_k=1)


def test_server_takes_a_megatron_training_scripts_flags(tmp_path, monkeypatch):
    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    megatron_flags = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--tensor-model-parallel-size", "2", "--micro-batch-size", "4",
        "--lr", "1e-4", "--train-iters", "10", "--bf16", "--use-checkpoint-args", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "100", "--temperature", "1.0", "--top_k", "1",
    ]  # fmt: skip
    client = serve(monkeypatch, ["--load", load, "--port", "5000", *megatron_flags])
    status, body = put(client, {"prompts": ["5 6 7"], "tokens_to_generate": 4, "top_k": 1})
    model, _ = load_model_for_inference(load)
    expected = generate(model, build_tokenizer("NullTokenizer", vocab_size=100), ["5 6 7"], GREEDY4)
    assert status == 200 and body["tokens"] == expected.tokens


def save_checkpoint_padded_to_eight(directory: str) -> str:
    """A checkpoint of a NullTokenizer(100) model (101 tokens) padded to 104, a multiple of 8: only a
    tokenizer of 97 to 104 tokens fits it."""
    from megatron_train.arguments import MegatronConfig
    from megatron_train.checkpointing import TrainingProgress, save_checkpoint
    from megatron_train.data.config import DataConfig
    from megatron_train.models.gpt import GPTModel
    from megatron_train.training.config import CheckpointConfig, TokenizerConfig

    model = GPTModel(build_tiny_gpt().config, vocab_size=104)
    tokenizer = TokenizerConfig(
        tokenizer_type="NullTokenizer", vocab_size=100, make_vocab_size_divisible_by=8
    )
    config = MegatronConfig(
        model=model.config,
        data=DataConfig(),
        checkpoint=CheckpointConfig(save=directory),
        tokenizer=tokenizer,
    )
    save_checkpoint(1, model, None, None, TrainingProgress(), config, padded_vocab_size=104)
    return directory


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # ids past the embedding: an IndexError 500 on the first request, before
        (["--vocab-size", "200"], "the tokenizer has 201 tokens but checkpoint"),
        # a smaller vocabulary than the model's: garbage text, before
        (["--vocab-size", "90"], "was trained with a vocabulary of 97 to 104 tokens (padded to 104)"),
        (["--num-layers", "3"], "--num-layers (given: num_layers=3) does not match checkpoint"),
        (["--disable-bias-linear"], "--disable-bias-linear (given: add_bias_linear=False) does not match"),
    ],
)
def test_server_refuses_at_start_up_what_does_not_fit_the_checkpoint(
    tmp_path, monkeypatch, capsys, flags, message
):
    load = save_checkpoint_padded_to_eight(str(tmp_path / "ckpt"))
    with pytest.raises(SystemExit) as exit_info:
        serve(monkeypatch, ["--load", load, *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and os.path.join(load, "iter_0000001") in error


def test_server_refuses_a_metadata_json_whose_args_lie_about_its_tensors(tmp_path, monkeypatch, capsys):
    """The args decide the model the server builds: a num_layers of 10**6 was built (minutes, gigabytes) before
    its weights were found missing; now they are checked against the saved tensors first."""
    load = save_checkpoint_padded_to_eight(str(tmp_path / "ckpt"))
    metadata_file = os.path.join(load, "iter_0000001", "metadata.json")
    with open(metadata_file) as saved:
        metadata = json.load(saved)
    metadata["args"]["model"]["num_layers"] = 10**6
    os.chmod(metadata_file, 0o644)
    with open(metadata_file, "w") as out:
        json.dump(metadata, out)
    with pytest.raises(SystemExit) as exit_info:
        serve(monkeypatch, ["--load", load])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{metadata_file}: args.model.num_layers is 1000000, but there are 2 layers" in error


def test_server_takes_a_tokenizer_of_the_checkpoints_vocabulary(tmp_path, monkeypatch):
    load = save_checkpoint_padded_to_eight(str(tmp_path / "ckpt"))
    client = serve(monkeypatch, ["--load", load, "--vocab-size", "99"])  # 100 tokens: 97 to 104 fit
    status, body = put(client, {"prompts": ["5 6 7"], "tokens_to_generate": 2, "top_k": 1})
    assert status == 200 and len(body["tokens"][0]) == 5


@pytest.fixture(scope="module")
def nan_client(tokenizer):
    """A server of a model whose weights hold NaN (a damaged or diverged checkpoint)."""
    broken = build_tiny_gpt()
    with torch.no_grad():
        broken.decoder.final_layernorm.weight.fill_(float("nan"))
    return TestClient(create_app(broken, tokenizer, LIMITS))


NAN_MESSAGE = (
    "the model produced non-finite logits (NaN or inf): its weights or activations are not finite, so no token "
    "can be chosen; check the checkpoint (a damaged or diverged one), or serve it in float32 if it overflows in "
    "half precision"
)


@pytest.mark.parametrize(
    "body",
    [
        {"prompts": ["ab"], "tokens_to_generate": 3},  # sampling: torch.multinomial's "inf, nan" before
        {
            "prompts": ["ab"],
            "tokens_to_generate": 3,
            "top_k": 1,
        },  # greedy: argmax picked a NaN's index before
        {"prompts": ["ab"], "tokens_to_generate": 0, "logprobs": True},  # NaN logprobs JSON cannot carry
        {"prompts": ["ab"], "tokens_to_generate": 3, "beam_width": 2},
    ],
)
def test_non_finite_logits_answer_a_500_with_a_message_and_the_server_keeps_serving(
    nan_client, client, body, caplog
):
    with caplog.at_level(logging.INFO, logger="megatron_train.inference.server"):
        status, answer = put(nan_client, body)
    assert (status, answer) == (500, {"message": NAN_MESSAGE})
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        f"PUT /api: {NAN_MESSAGE}"
    ]
    response = nan_client.post("/v1/completions", content=json.dumps({"prompt": "ab", "max_tokens": 2}))
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": NAN_MESSAGE,
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert put(nan_client, {"prompts": ["ab"], "tokens_to_generate": 1, "temperature": "x"})[0] == 400
    assert put(client, {"prompts": ["ab"], "tokens_to_generate": 2, "top_k": 1})[0] == 200


async def _half_a_body(app, method: str, path: str) -> list[dict]:
    """Drive the app as uvicorn would for a client that sends part of its body and hangs up."""
    messages = iter([{"type": "http.request", "body": b'{"prompts": ["a', "more_body": True},
                     {"type": "http.disconnect"}])  # fmt: skip
    sent = []

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"400")],
             "client": ("10.0.0.7", 5555), "server": ("127.0.0.1", 5000)}  # fmt: skip
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize(("method", "path"), [("PUT", "/api"), ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions")])  # fmt: skip
def test_a_client_that_hangs_up_mid_body_is_one_log_line(model, tokenizer, method, path, caplog):
    import asyncio

    app = create_app(model, tokenizer, LIMITS)
    with caplog.at_level(logging.DEBUG):
        asyncio.run(
            _half_a_body(app, method, path)
        )  # raised ClientDisconnect into a 75-line traceback before
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING] == [
        ("WARNING", f"client 10.0.0.7 disconnected after sending 15 of 400 bytes of its {method} {path} request; "
                    "nothing answered")
    ]  # fmt: skip
    assert not any(r.exc_info for r in caplog.records)
