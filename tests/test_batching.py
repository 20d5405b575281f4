"""Dynamic batching: requests that arrive together run as one batch and get the answers they get alone;
incompatible ones run apart; limits split batches; bad input never reaches the model (400, never 500)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from megatron_train.inference.batcher import Batcher, BatchLimits
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.inference.ranks import ModelRunner, Work
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.tools.text_generation_cli import put_request
from tests.helpers.generation import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    CharTokenizer,
    build_tiny_gpt,
    one_torch_thread,
)
from tests.helpers.servers import uvicorn_serving

GREEDY = GenerationParams(tokens_to_generate=5, top_k=1, return_output_log_probs=True)
PROMPTS = ["hello", "ab", "the quick fox", "z", "abc def", "hi!"]


@pytest.fixture(scope="module")
def model():
    return build_tiny_gpt()


class RecordingRunner(ModelRunner):
    """A ModelRunner that records each batch's prompt count; `gate` holds the first batch until set."""

    def __init__(self, model, tokenizer) -> None:
        super().__init__(model, tokenizer)
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def run(self, work: Work):
        self.started.set()
        self.gate.wait(timeout=60)
        self.batches.append(len(work.prompts))
        return super().run(work)


def alone(model, prompt: str, params: GenerationParams):
    return generate(model, CharTokenizer(), [prompt], params)


def submit_behind_a_running_batch(batcher: Batcher, runner: RecordingRunner, works: list[Work]) -> list:
    """Submit one request, wait until it runs, queue `works` behind it, then let everything run."""
    first = batcher.submit(Work(("first",), GREEDY), longest=5)
    assert runner.started.wait(timeout=60)
    futures = [batcher.submit(work, longest=max(len(p) for p in work.prompts)) for work in works]
    runner.gate.set()
    first.result(timeout=60)
    return [future.result(timeout=60) for future in futures]


def test_waiting_requests_run_as_one_batch_and_answer_as_alone(model):
    runner = RecordingRunner(model, CharTokenizer())
    batcher = Batcher(runner, BatchLimits(max_prompts=16, max_tokens=10_000, max_wait_s=0.0))
    shorter = replace(GREEDY, tokens_to_generate=2)  # joins: each prompt keeps its own budget
    other = GenerationParams(tokens_to_generate=3, top_k=1)  # other params (no logprobs): its own batch
    seeded = GenerationParams(tokens_to_generate=5, temperature=1.5, random_seed=4)  # runs alone
    works = [Work((prompt,), GREEDY) for prompt in PROMPTS[:3]]
    works += [Work(("xyz",), other), Work(("seed",), seeded), Work(("short",), shorter)]
    works += [Work((prompt,), GREEDY) for prompt in PROMPTS[3:]]
    outputs = submit_behind_a_running_batch(batcher, runner, works)
    batcher.close()
    assert runner.batches == [1, 7, 1, 1]
    for work, output in zip(works, outputs, strict=True):
        expected = alone(model, work.prompts[0], work.params)
        assert output.tokens == expected.tokens and output.completions == expected.completions
        if work.params.return_output_log_probs:
            assert output.logprobs[0] == pytest.approx(expected.logprobs[0], abs=1e-5)


@pytest.mark.parametrize(
    ("limits", "batches"),
    [
        (BatchLimits(max_prompts=4, max_tokens=10_000, max_wait_s=0.0), [1, 4, 2]),
        # 6 rows x (13 + 5) tokens = 108 > 60: at most 3 rows of the longest prompt + 5 = 18 tokens
        (BatchLimits(max_prompts=16, max_tokens=60, max_wait_s=0.0), [1, 3, 3]),
    ],
)
def test_batches_stay_within_the_limits(model, limits, batches):
    runner = RecordingRunner(model, CharTokenizer())
    batcher = Batcher(runner, limits)
    outputs = submit_behind_a_running_batch(batcher, runner, [Work((p,), GREEDY) for p in PROMPTS])
    batcher.close()
    assert runner.batches == batches
    assert [output.tokens for output in outputs] == [alone(model, p, GREEDY).tokens for p in PROMPTS]


def test_one_at_a_time_runs_every_request_alone(model):
    runner = RecordingRunner(model, CharTokenizer())
    batcher = Batcher(runner, BatchLimits(16, 10_000, 0.0), dynamic=False)
    submit_behind_a_running_batch(batcher, runner, [Work((p,), GREEDY) for p in PROMPTS])
    batcher.close()
    assert runner.batches == [1] * 7


def test_requests_arriving_within_the_wait_join_the_first(model):
    runner = RecordingRunner(model, CharTokenizer())
    runner.gate.set()
    batcher = Batcher(runner, BatchLimits(16, 10_000, max_wait_s=0.5))
    futures = [batcher.submit(Work((p,), GREEDY), longest=len(p)) for p in PROMPTS[:3]]
    [future.result(timeout=60) for future in futures]
    batcher.close()
    assert runner.batches == [3]


@pytest.fixture(scope="module")
def live_server(model):
    """A uvicorn server whose batcher waits up to 200 ms for concurrent requests, and its recording runner."""
    app = create_app(model, CharTokenizer(), ServerLimits(max_batch_size=8), max_batch_wait_s=0.2)
    batches = []
    runner = app.state.service.batcher.runner
    run = runner.run
    runner.run = lambda work: batches.append(len(work.prompts)) or run(work)
    with uvicorn_serving(app) as address:
        yield f"http://{address}", batches


def test_concurrent_requests_are_batched_and_equal_sequential_ones(live_server, model):
    url, batches = live_server
    requests = [
        {"prompts": [prompt], "tokens_to_generate": 5, "top_k": 1, "logprobs": True} for prompt in PROMPTS
    ]
    requests += [{"prompts": ["two", "prompts"], "tokens_to_generate": 5, "top_k": 1, "logprobs": True}]
    batches.clear()
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda body: put_request(f"{url}/api", body, timeout=60), requests))
    assert len(batches) < len(requests) and sum(batches) == 8
    for body, (status, answer) in zip(requests, answers, strict=True):
        expected = generate(model, CharTokenizer(), body["prompts"], GREEDY)
        assert status == 200
        assert answer["tokens"] == expected.tokens and answer["text"] == expected.texts
        for got, want in zip(answer["logprobs"], expected.logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-5)


GARBAGE = [b"", b"null", b"{}", b"[]", b'"text"', b"{bad", b'{"prompts": null}', b'{"prompt": {"a": 1}}']
GARBAGE += [
    b'{"messages": "hi"}',
    b'{"prompts": ["a"], "beam_width": "2"}',
    b'{"prompts": ["a"], "beam_width": 2.5}',
]
GARBAGE += [
    b'{"prompt": "a", "logprobs": true}',
    b'{"prompt": "a", "max_tokens": 1e9}',
    b'{"prompts": [["a"]]}',
]


@pytest.fixture(scope="module")
def client(model):
    return TestClient(create_app(model, CharTokenizer(), ServerLimits()))


@pytest.mark.parametrize("body", GARBAGE)
@pytest.mark.parametrize("path", ["/api", "/v1/completions", "/v1/chat/completions"])
def test_bad_input_answers_400_never_500(client, path, body):
    send = client.put if path == "/api" else client.post
    response = send(path, content=body)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert (answer.get("message") or answer["error"]["message"]) and json.dumps(answer)


class SignalRecorder(ModelRunner):
    """Records the keep-alives and the stop a batcher sends to the follower ranks."""

    def __init__(self, model, tokenizer) -> None:
        super().__init__(model, tokenizer)
        self.signals: list[str] = []

    def keep_alive(self) -> None:
        self.signals.append("keep-alive")

    def stop(self) -> None:
        self.signals.append("stop")


def test_an_idle_batcher_keeps_followers_alive_and_stops_them_at_shutdown(model, monkeypatch):
    from megatron_train.inference import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "KEEP_ALIVE_S", 0.05)
    runner = SignalRecorder(model, CharTokenizer())
    app = create_app(model, CharTokenizer(), ServerLimits())
    app.state.service.batcher.close()  # replace the app's batcher by one with the recording runner
    app.state.service.batcher = Batcher(runner, BatchLimits(16, 10_000, 0.0))
    with TestClient(app) as client:  # leaving the block shuts the app down (its lifespan)
        deadline = time.monotonic() + 30  # a busy machine may starve the batcher's thread for a while
        while runner.signals.count("keep-alive") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.put("/api", json={"prompts": ["ab"], "tokens_to_generate": 2}).status_code == 200
    assert runner.signals.count("keep-alive") >= 2 and runner.signals[-1] == "stop"
