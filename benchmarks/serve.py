"""Serving throughput with dynamic batching against one request at a time: the same server, the same requests.

A GPT-2 shaped checkpoint (random weights, NullTokenizer) is served twice by the real entry point
(`python -m megatron_train.tools.run_text_generation_server`), once with dynamic batching and once with
`--no-dynamic-batching`; each time 8 concurrent clients send the same greedy `PUT /api` requests (one prompt
each), each client its next request as soon as its last one is answered. Prints requests/s and p50/p95
latency per mode, checks both modes answered the same tokens, and ends with `ratio: <batched / one at a time>`
of requests/s.

    .venv/bin/python -m benchmarks.serve [--clients 8 --requests-per-client 8 --layers 4 --hidden 256 \\
        --prompt-tokens 32 --new-tokens 32 --threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TrainingProgress, save_checkpoint
from megatron_train.data.config import DataConfig
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.tools.text_generation_cli import put_request
from megatron_train.training.config import CheckpointConfig, TokenizerConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    return parser.parse_args()


def save_model(args: argparse.Namespace, directory: str) -> None:
    """A random GPT-2 shaped model saved as a checkpoint whose tokenizer is NullTokenizer(vocab - 1)."""
    positions = args.prompt_tokens + args.new_tokens
    config = TransformerConfig.gpt2(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=positions,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, args.vocab)
    megatron = MegatronConfig(
        model=config,
        data=DataConfig(),
        checkpoint=CheckpointConfig(save=directory),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=args.vocab - 1),
    )
    save_checkpoint(1, model, None, None, TrainingProgress(), megatron, padded_vocab_size=args.vocab)


def start_server(load: str, port: int, threads: int, dynamic: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "megatron_train.tools.run_text_generation_server", "--load", load]
    command += ["--port", str(port), "--max-tokens-to-oom", "100000"]
    command += [] if dynamic else ["--no-dynamic-batching"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(
                f"the server exited with {server.returncode}: run {' '.join(command)} to see why"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if json.loads(response.read())["status"] == "ok":
                    return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise RuntimeError("the server did not answer /health within 180 s")


def run_clients(url: str, requests: list[list[dict]]) -> tuple[float, list[float], list[list[list[int]]]]:
    """Each client sends its requests one after another; returns wall seconds, latencies and the tokens."""

    def client(bodies: list[dict]) -> list[tuple[float, list[list[int]]]]:
        results = []
        for body in bodies:
            started = time.perf_counter()
            status, answer = put_request(url, body, timeout=600)
            if status != 200:
                raise RuntimeError(f"request failed with {status}: {answer}")
            results.append((time.perf_counter() - started, answer["tokens"]))
        return results

    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        per_client = list(pool.map(client, requests))
    wall = time.perf_counter() - started
    latencies = [latency for results in per_client for latency, _ in results]
    tokens = [answer for results in per_client for _, answer in results]
    return wall, latencies, tokens


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    requests = [
        [
            {
                "prompts": [" ".join(str(rng.randrange(args.vocab - 1)) for _ in range(args.prompt_tokens))],
                "tokens_to_generate": args.new_tokens,
                "top_k": 1,
                "no_log": True,
            }
            for _ in range(args.requests_per_client)
        ]
        for _ in range(args.clients)
    ]
    total = args.clients * args.requests_per_client
    print(
        f"{args.clients} clients x {args.requests_per_client} requests, {args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens, GPT {args.layers}x{args.hidden}, vocab {args.vocab}, "
        f"{args.threads} server threads"
    )
    throughput, answers = {}, {}
    with tempfile.TemporaryDirectory() as load:
        save_model(args, load)
        for name, dynamic in (("one at a time", False), ("dynamic batching", True)):
            port = _free_port()
            server = start_server(load, port, args.threads, dynamic)
            try:
                url = f"http://127.0.0.1:{port}/api"
                run_clients(url, [[body[0]] for body in requests[:2]])  # warm-up
                wall, latencies, answers[name] = run_clients(url, requests)
            finally:
                server.terminate()
                server.wait(timeout=60)
            throughput[name] = total / wall
            print(
                f"{name:>17}: {throughput[name]:6.2f} requests/s, latency p50 {percentile(latencies, 50):.3f} s, "
                f"p95 {percentile(latencies, 95):.3f} s ({wall:.1f} s for {total} requests)"
            )
    same = answers["one at a time"] == answers["dynamic batching"]
    print(f"same tokens in both modes: {same}")
    print(f"ratio: {throughput['dynamic batching'] / throughput['one at a time']:.2f}")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
