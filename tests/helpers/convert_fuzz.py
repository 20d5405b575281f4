"""Fuzzing the converter's loaders with lying configs (tests/test_convert_loader_checks.py runs it in a subprocess).

    python -m tests.helpers.convert_fuzz FOLDER SEED CASES

builds a tiny model in each source format under FOLDER (a Hugging Face GPT-2 and Llama folder, a Megatron legacy
checkpoint, a torch_dist one, one of ours), then caps the process's address space a little above what it uses
(RLIMIT_AS), so an allocation of more than the tensors need fails loudly, and runs CASES seeded random edits of
the config each loader reads: sizes, types and signs of config.json's fields, of Megatron's `args`, of our
metadata.json's args. Each case must end in a ValueError or CheckpointError naming the edited file (or its
folder), or load a model of exactly the unedited source's tensor names and shapes, within a second. The last line
printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_train.checkpointing import CheckpointError
from megatron_train.checkpointing.layout import VOCAB_PARAMS
from megatron_train.convert import ModelWeights, flow, megatron, torch_dist
from megatron_train.convert.weights import trim_vocab
from megatron_train.tools.checkpoint_util import load_weights
from tests.helpers.convert_models import VOCAB, our_llama

PADDED = 256  # the sources' padded vocabulary: VOCAB rounded up to 128 x TP2
HEADROOM = 1 << 30  # the address space a case may take beyond what the process holds when fuzzing starts
CASE_SECONDS = (
    5.0  # a case takes milliseconds; the bound is for a loaded machine, a hang or a huge model fails it
)
VALUES: list[Any] = [0, -1, 1, 2, 3, 5, 8, 64, 1000, 10**6, 10**12, 2**63, -(2**40), 0.5, 2.0, 1e-300, 1e308,
                     math.inf, -math.inf, math.nan, "128", "", "gelu", None, True, False, [], [4], {}, {"a": 1}]  # fmt: skip


def _mutate(value: Any, rng: random.Random) -> Any:
    """A value a lying or damaged config may hold in place of `value`: another type, a sign, a scale."""
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return rng.choice([value + 1, value - 1, value * 2, value // 2, -value, value * 10**6])
    return copy.deepcopy(rng.choice(VALUES))


def _edit(config: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`config` with one to three of its keys (or a new one among them) changed or deleted."""
    edited = copy.deepcopy(config)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(sorted(edited))
        if rng.random() < 0.1:
            del edited[key]
        else:
            edited[key] = _mutate(edited[key], rng)
    return edited


def _hf_sources(folder: str) -> dict[str, str]:
    import transformers

    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(f"{folder}/hf_gpt2")
    transformers.LlamaForCausalLM(llama).save_pretrained(f"{folder}/hf_llama")
    return {"hf_gpt2": f"{folder}/hf_gpt2", "hf_llama": f"{folder}/hf_llama"}


def _checkpoint_sources(folder: str) -> dict[str, str]:
    config, model = our_llama(untied=True)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), f"{folder}/flow", 2, 2)
    weights = flow.load(f"{folder}/flow")
    megatron.save(weights, f"{folder}/megatron", 2, 1)
    torch_dist.save(flow.load(f"{folder}/flow"), f"{folder}/torch_dist", 1, 2)
    return {"flow": f"{folder}/flow", "megatron": f"{folder}/megatron", "torch_dist": f"{folder}/torch_dist"}


class Source:
    """One source format: where its config lives, how to read, edit and restore it, and how to load it."""

    def __init__(self, name: str, folder: str) -> None:
        self.name, self.folder = name, folder
        self.loader = "hf" if name.startswith("hf_") else name
        iteration = f"{folder}/iter_0000001"
        self.path = {
            "hf": f"{folder}/config.json",
            "flow": f"{iteration}/metadata.json",
            "megatron": f"{iteration}/mp_rank_00/model_optim_rng.pt",
            "torch_dist": f"{iteration}/common.pt",
        }[self.loader]
        with open(self.path, "rb") as handle:
            self.original = handle.read()

    def config(self) -> dict[str, Any]:
        if self.loader == "hf":
            return json.loads(self.original)
        if self.loader == "flow":
            return json.loads(self.original)["args"]["model"]
        return vars(torch.load(self.path, weights_only=False)["args"])

    def write(self, config: dict[str, Any]) -> None:
        if self.loader == "hf":
            with open(self.path, "w") as handle:
                json.dump(config, handle)
        elif self.loader == "flow":
            metadata = json.loads(self.original)
            metadata["args"]["model"] = config
            with open(self.path, "w") as handle:
                json.dump(metadata, handle)
        else:
            state = torch.load(self.path, weights_only=False)
            state["args"] = argparse.Namespace(**config)
            torch.save(state, self.path)

    def restore(self) -> None:
        with open(self.path, "wb") as handle:
            handle.write(self.original)

    def load(self) -> dict[str, tuple[int, ...]]:
        """The loaded tensors' shapes, the vocabulary's rows counted as the true vocabulary's: Megatron's args
        may give any size its padding allows (or none, when the padding rows are kept with a warning)."""
        weights = load_weights(self.loader, self.folder, None, None, "GPT")
        shapes = {name: tuple(tensor.shape) for name, tensor in weights.tensors.items()}
        for name in VOCAB_PARAMS:
            if (
                name in shapes and 0 < shapes[name][0] <= PADDED
            ):  # Megatron's args: any size the padding allows
                shapes[name] = (VOCAB, *shapes[name][1:])
        return shapes


def _limit_address_space() -> None:
    with open("/proc/self/status") as handle:
        size = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, resource.RLIM_INFINITY))


def fuzz(folder: str, seed: int, cases: int, log: Callable[[str], None]) -> dict[str, Any]:
    sources = [
        Source(name, path) for name, path in {**_hf_sources(folder), **_checkpoint_sources(folder)}.items()
    ]
    expected = {source.name: source.load() for source in sources}
    rng = random.Random(seed)
    _limit_address_space()
    counts = {"cases": 0, "refused": 0, "loaded": 0, "slowest_s": 0.0}
    for case in range(cases):
        source = sources[case % len(sources)]
        edited = _edit(source.config(), rng)
        source.write(edited)
        started = time.perf_counter()
        try:
            shapes = source.load()
        except (ValueError, CheckpointError) as error:
            named = source.folder in str(error) or os.path.basename(source.path) in str(error)
            if not named:
                log(f"case {case} ({source.name}): an error not naming the source: {error}")
                raise
            counts["refused"] += 1
        except BaseException:
            log(f"case {case} ({source.name}) failed; the edited config: {edited!r:.2000}")
            raise
        else:
            if shapes != expected[source.name]:
                differ = sorted(name for name in shapes.keys() | expected[source.name].keys()
                                if shapes.get(name) != expected[source.name].get(name))  # fmt: skip
                raise AssertionError(
                    f"case {case} ({source.name}): loaded other tensors than the source holds ({differ[:3]}); "
                    f"the edited config: {edited!r:.2000}"
                )
            counts["loaded"] += 1
        finally:
            source.restore()
        seconds = time.perf_counter() - started
        counts["slowest_s"] = max(counts["slowest_s"], seconds)
        if seconds > CASE_SECONDS:
            raise AssertionError(f"case {case} ({source.name}) took {seconds:.1f} s: {edited}")
        counts["cases"] += 1
    return counts


if __name__ == "__main__":
    folder, seed, cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(fuzz(folder, seed, cases, lambda line: print(line, file=sys.stderr))))
