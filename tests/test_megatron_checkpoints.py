"""`--load` takes Megatron-LM checkpoints where they are: checkpoints Megatron-Core itself wrote on CPU
(tests/helpers/megatron_core_training.py: legacy `torch` files with Adam's state, with the distributed optimizer's
distrib_optim.pt, and `torch_dist`) continue training under pretrain_gpt with Megatron-Core's own losses, finetune
exactly as the same weights converted first through checkpoint_util, and serve the converted checkpoint's greedy
tokens; a folder that cannot be read ends the entry point in one line naming the file and what to do."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_train.convert.detect import open_checkpoint
from megatron_train.tools import checkpoint_util
from tests.helpers.distributed import run_distributed
from tests.helpers.generation import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.servers import put, serve

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny GPT on mock data; --vocab-size 127 is NullTokenizer's 128 tokens, so no padding row changes the loss.
ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--vocab-size", "127", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--train-iters", "5", "--mock-data", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--num-workers", "0", "--seed", "3",
]  # fmt: skip
SAVED = ("torch", "torch_dist", "torch_distributed_optimizer", "torch_dist_distributed_optimizer")
LOADERS = {"torch": "megatron", "torch_dist": "torch_dist"}  # checkpoint_util's names of the two formats


# The same GPT with MoE layers (top 2 of 4 experts; Megatron-Core's MoE MLP fails on CPU with bias, so none).
MOE_ARGV = [*ARGV, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
            "--moe-router-load-balancing-type", "none", "--disable-bias-linear"]  # fmt: skip


def megatron_core_checkpoints(root: str, argv: list[str]) -> dict[str, list[float]]:
    """Megatron-Core's checkpoints at iteration 2 of a run of `argv` (ROOT/<format>) and its losses of iterations
    3 to 5 by format."""
    with open(os.path.join(root, "argv.json"), "w") as handle:
        json.dump(argv, handle)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, *sys.path])}
    run = subprocess.run([sys.executable, "-m", "tests.helpers.megatron_core_training", root], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)  # fmt: skip
    assert run.returncode == 0 and "megatron-core training ok" in run.stdout, (
        run.stdout[-2000:] + run.stderr[-4000:]
    )
    with open(os.path.join(root, "reference.json")) as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def megatron_core_run(tmp_path_factory) -> tuple[str, dict]:
    """Megatron-Core's checkpoints at iteration 2 (ROOT/<format>), its losses of iterations 3 to 5, and the torch
    and torch_dist checkpoints converted by checkpoint_util (ROOT/<format>_flow)."""
    root = str(tmp_path_factory.mktemp("megatron_core"))
    reference = megatron_core_checkpoints(root, ARGV)
    for saved, loader in LOADERS.items():
        checkpoint_util.main(["--loader", loader, "--saver", "flow", "--load-dir", f"{root}/{saved}",
                              "--save-dir", f"{root}/{saved}_flow"])  # fmt: skip
    return root, reference


def _pretrain_runs(rank: int, world_size: int, runs: dict[str, list[str]]) -> dict[str, list[float] | str]:
    """pretrain_gpt once per argv: its training losses, or the line it ended with."""
    from megatron_train.pretrain_gpt import main

    results = {}
    for name, argv in runs.items():
        try:
            main(argv)
        except SystemExit as error:
            results[name] = str(error)
            continue
        with open(os.path.join(argv[argv.index("--save") + 1], "metrics.jsonl")) as handle:
            records = [json.loads(line) for line in handle]
        results[name] = [
            (r["iteration"], r["consumed samples"], r["lm loss"]) for r in records if "split" not in r
        ]
    return results


def test_pretrain_gpt_continues_megatron_core_checkpoints(megatron_core_run, tmp_path):
    root, reference = megatron_core_run
    runs = {saved: [*ARGV, "--load", f"{root}/{saved}", "--save", str(tmp_path / saved)] for saved in SAVED}
    runs["fresh Adam"] = [
        *ARGV,
        "--load",
        f"{root}/torch",
        "--no-load-optim",
        "--save",
        str(tmp_path / "fresh"),
    ]
    for saved in [*LOADERS, *(f"{name}_flow" for name in LOADERS)]:
        runs[f"finetune {saved}"] = [*ARGV, "--load", f"{root}/{saved}", "--finetune", "--train-iters", "2",
                                     "--save", str(tmp_path / f"finetune_{saved}")]  # fmt: skip
    runs["wider"] = [
        *ARGV,
        "--hidden-size",
        "64",
        "--load",
        f"{root}/torch",
        "--save",
        str(tmp_path / "wider"),
    ]
    runs["another lr"] = [
        *ARGV,
        "--load",
        f"{root}/torch_dist",
        "--save",
        str(tmp_path / "lr"),
        "--lr",
        "1e-3",
    ]
    no_optimizer = str(tmp_path / "weights_only")  # our torch_dist saver writes weights only
    checkpoint_util.main(["--loader", "flow", "--saver", "torch_dist", "--load-dir", f"{root}/torch_flow",
                          "--save-dir", no_optimizer])  # fmt: skip
    runs["no optimizer"] = [*ARGV, "--load", no_optimizer, "--save", str(tmp_path / "no_optimizer")]
    (results,) = run_distributed(_pretrain_runs, 1, runs, timeout=400)
    for (
        saved
    ) in SAVED:  # iterations 3 to 5 from consumed sample 8, with Megatron-Core's Adam state and scheduler
        assert [(it, consumed) for it, consumed, _ in results[saved]] == [(3, 12), (4, 16), (5, 20)], saved
        assert [loss for *_, loss in results[saved]] == pytest.approx(reference[saved], rel=1e-5), saved
    fresh = [loss for *_, loss in results["fresh Adam"]]
    assert fresh[0] == pytest.approx(reference["torch"][0], rel=1e-5)  # same weights ...
    assert (
        abs(fresh[2] - reference["torch"][2]) > 1e-2
    )  # ... but Adam's moments matter: the comparison sees them
    for saved in LOADERS:  # in memory or converted first: the same run
        assert results[f"finetune {saved}"] == results[f"finetune {saved}_flow"], saved
        assert [it for it, *_ in results[f"finetune {saved}"]] == [1, 2]
    assert results["wider"] == (
        f"pretrain_gpt: checkpoint {root}/torch/iter_0000002 was saved with hidden_size=32 but this run has "
        "hidden_size=64; pass --hidden-size 32 or load a matching checkpoint"
    )
    assert results["another lr"].startswith(
        "pretrain_gpt: the checkpoint's scheduler has max_lr=0.01 but this run has max_lr=0.001; pass "
        "--override-opt-param-scheduler"
    )
    assert results["no optimizer"] == (
        f"pretrain_gpt: {no_optimizer}/iter_0000002 holds no optimizer state (saved with --no-save-optim): pass "
        "--no-load-optim to continue from its weights with a fresh optimizer (or --finetune to start a new run "
        "from them)"
    )


@pytest.mark.parametrize("saved", list(LOADERS))
def test_server_and_tasks_main_read_megatron_checkpoints(megatron_core_run, monkeypatch, tmp_path, saved):
    from megatron_train.tasks import main as tasks_main

    root, _ = megatron_core_run
    request = {"prompts": ["5 6 7", "1 2 3 4"], "tokens_to_generate": 6, "top_k": 1}
    answers = [
        put(serve(monkeypatch, ["--load", f"{root}/{name}"]), request) for name in (saved, f"{saved}_flow")
    ]
    assert answers[0][0] == 200 and answers[0] == answers[1]
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(
        "".join(json.dumps({"text": f"{i} {i + 1} {i + 2} {i + 3}"}) + "\n" for i in range(20))
    )
    metrics = [
        tasks_main.main(["--task", "LAMBADA", "--valid-data", str(lambada), "--load", f"{root}/{name}"])
        for name in (saved, f"{saved}_flow")
    ]
    assert metrics[0]["correct"] == metrics[1]["correct"] and metrics[0]["total"] == 20


def _copy(root: str, name: str, target) -> str:
    shutil.copytree(f"{root}/{name}", target)
    return str(target)


def test_what_cannot_be_read_is_one_line_naming_the_file(megatron_core_run, tmp_path, capsys):
    from megatron_train.tasks import main as tasks_main

    root, _ = megatron_core_run
    neither = tmp_path / "neither"
    (neither / "iter_0000001").mkdir(parents=True)
    (neither / "iter_0000001" / "weights.npz").write_bytes(b"\0" * 16)
    (neither / "latest_checkpointed_iteration.txt").write_text("1")
    truncated = _copy(root, "torch", tmp_path / "truncated")
    pt = f"{truncated}/iter_0000002/mp_rank_00/model_optim_rng.pt"
    os.truncate(pt, os.path.getsize(pt) // 2)
    no_index = _copy(root, "torch_dist", tmp_path / "no_index")
    os.remove(f"{no_index}/iter_0000002/.metadata")
    no_metadata = _copy(root, "torch_dist", tmp_path / "no_metadata")
    os.remove(f"{no_metadata}/iter_0000002/metadata.json")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    no_args = tmp_path / "no_args"
    (no_args / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": argparse.Namespace(hidden_size=32), "model": {}},
               no_args / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")  # fmt: skip
    (no_args / "latest_checkpointed_iteration.txt").write_text("1")
    cases = {
        str(neither): f"{neither}/iter_0000001 is neither a Megatron-Flow checkpoint nor a Megatron-LM torch",
        truncated: f"{pt} is not a complete torch.save file (truncated or damaged",
        no_index: f"{no_index}/iter_0000002/.metadata is missing: {no_index}/iter_0000002 is not a complete "
        "torch_dist checkpoint",
        no_metadata: f"{no_metadata}/iter_0000002 holds torch_dist files but no metadata.json",
        str(hf): f"--load {hf} is a Hugging Face model folder: convert it first with python -m "
        f"megatron_train.tools.checkpoint_util --model-type GPT --loader hf --saver flow --load-dir {hf} "
        f"--save-dir {hf}_flow",
        f"{root}/torch/iter_0000002": "is one iteration's folder: pass the folder that holds it",
        str(no_args): f"{no_args}/iter_0000001/mp_rank_00/model_optim_rng.pt: its args lack ['num_layers', "
        "'num_attention_heads', 'padded_vocab_size', 'tensor_model_parallel_size', 'pipeline_model_parallel_size']",
    }
    for load, message in cases.items():
        with pytest.raises(SystemExit):
            tasks_main.main(["--task", "LAMBADA", "--valid-data", "unused.jsonl", "--load", load])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert "error: " in error and message in error, (load, error)
    with pytest.raises(SystemExit):
        tasks_main.main(
            ["--task", "LAMBADA", "--valid-data", "x", "--load", f"{root}/torch", "--num-layers", "3"]
        )
    assert "--num-layers (given: num_layers=3) does not match checkpoint" in capsys.readouterr().err
    assert open_checkpoint(str(tmp_path / "empty"), None, "gpt") is None  # nothing saved: a fresh start
    damaged = _copy(root, "torch_distributed_optimizer", tmp_path / "damaged_optimizer")
    state = f"{damaged}/iter_0000002/mp_rank_00/distrib_optim.pt"
    os.truncate(state, 100)
    saved = open_checkpoint(damaged, None, "gpt")  # the weights still load (--no-load-optim, --finetune) ...
    assert saved.has_optimizer_state() is False
    with pytest.raises(
        ValueError, match=f"{state} is not a complete torch.save file .*: pass --no-load-optim"
    ):
        saved.require_optimizer_state()  # ... Adam's state is refused naming its file


def test_megatron_core_moe_checkpoints_continue_with_their_chained_optimizer_state(tmp_path):
    """Megatron-Core's MoE GPT keeps its experts in an optimizer of their own (a ChainedOptimizer: a list in the
    legacy files and distrib_optim.pt, `chained_<i>.` keys in torch_dist): every expert's Adam moments land on our
    stacked expert tensor exactly (expert j of layer 1's fc1, transposed), the dense params' too, and pretrain_gpt
    continues each format at EP 2 x DP 2 (expert DP 1) with Megatron-Core's own losses."""
    root = str(tmp_path)
    reference = megatron_core_checkpoints(root, MOE_ARGV)
    for saved in SAVED:
        moments = torch.load(
            f"{root}/{'torch_distributed_optimizer' if 'distributed' in saved else 'torch'}/moments.pt"
        )
        checkpoint = open_checkpoint(f"{root}/{saved}", None, "gpt")
        for state in ("exp_avg", "exp_avg_sq"):
            stacked = checkpoint.global_tensor(f"decoder.layers.1.mlp.experts.weight1.{state}", "optimizer")
            for j in range(4):
                theirs = moments[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.weight"][state]
                assert torch.equal(stacked[j], theirs.t()), (saved, state, j)
            dense = checkpoint.global_tensor(
                f"decoder.layers.0.self_attention.linear_qkv.weight.{state}", "optimizer"
            )
            assert torch.equal(dense, moments["decoder.layers.0.self_attention.linear_qkv.weight"][state]), (
                saved
            )
    runs = {
        saved: [*MOE_ARGV, "--expert-model-parallel-size", "2", "--load", f"{root}/{saved}", "--save",
                str(tmp_path / f"ours_{saved}")]
        for saved in SAVED
    }  # fmt: skip
    results = run_distributed(_pretrain_runs, 2, runs, timeout=400)[0]
    for saved in SAVED:
        assert [(it, consumed) for it, consumed, _ in results[saved]] == [(3, 12), (4, 16), (5, 20)], saved
        assert [loss for *_, loss in results[saved]] == pytest.approx(reference[saved], rel=1e-5), saved
