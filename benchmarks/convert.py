"""Checkpoint conversion throughput: a Hugging Face Llama folder -> our checkpoint, against `transformers`
loading and re-saving the same folder (`from_pretrained` + `save_pretrained`), in one run.

    .venv/bin/python -m benchmarks.convert [--layers 8 --hidden 1024 --repeats 3]

Both read the same safetensors folder and write a full copy of the weights; ours also regroups the QKV and
MLP projections, splits the result for --target-tp x --target-pp ranks, hashes and fsyncs every file (the
checkpoint contract); a third line times the peer with its files fsynced too. Throughput is GB of weights per
second, the median of --repeats runs each. The last line is `ratio: <ours GB/s / transformers GB/s>`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import transformers

from megatron_train.tools.checkpoint_util import convert_format


def _median_seconds(run: Callable[[str], None], root: str, repeats: int) -> float:
    seconds = []
    for repeat in range(repeats):
        out = f"{root}/out_{repeat}"
        start = time.perf_counter()
        run(out)
        seconds.append(time.perf_counter() - start)
        shutil.rmtree(out)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--target-tp", type=int, default=1)
    parser.add_argument("--target-pp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        model = transformers.LlamaForCausalLM(config)
        gigabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
        model.save_pretrained(f"{root}/hf")
        del model

        def ours(out: str) -> None:
            convert_format("hf", "flow", f"{root}/hf", out, args.target_tp, args.target_pp)

        def peer(out: str) -> None:
            transformers.AutoModelForCausalLM.from_pretrained(f"{root}/hf").save_pretrained(out)

        def peer_durable(out: str) -> None:
            peer(out)
            for name in os.listdir(out):  # what ours does for every file it writes
                with open(os.path.join(out, name), "rb") as handle:
                    os.fsync(handle.fileno())

        ours_seconds = _median_seconds(ours, root, args.repeats)
        peer_seconds = _median_seconds(peer, root, args.repeats)
        durable_seconds = _median_seconds(peer_durable, root, args.repeats)
    ours_rate, peer_rate = gigabytes / ours_seconds, gigabytes / peer_seconds
    print(f"weights: {gigabytes:.3f} GB ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab})")
    print(
        f"ours  HF -> flow (TP{args.target_tp} x PP{args.target_pp}): {ours_seconds:.2f} s, {ours_rate:.2f} GB/s"
    )
    print(f"transformers from_pretrained + save_pretrained: {peer_seconds:.2f} s, {peer_rate:.2f} GB/s")
    print(
        f"the same with its files fsynced as ours are: {durable_seconds:.2f} s, {gigabytes / durable_seconds:.2f} "
        f"GB/s (ours / this: {durable_seconds / ours_seconds:.2f})"
    )
    print(f"ratio: {ours_rate / peer_rate:.2f}")


if __name__ == "__main__":
    main()
