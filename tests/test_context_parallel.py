"""Context parallelism on real gloo groups: each --cp-comm-type's attention equals full causal attention (values
and gradients, GQA, documents), the ring's bytes equal their closed form, and a one-process checkpoint continues
under CP=2 x DP=2 (p2p, all_gather, a2a), CP=2 x TP=2 + SP and CP=2 x PP=2 with the one process's losses (RoPE,
GQA, document masks), all on four ranks in one launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_train.arguments import parse_args
from megatron_train.models.context_attention import (
    ContextParallelDocuments,
    context_parallel_attention,
    ring_bytes_per_rank,
)
from megatron_train.parallel.context_parallel import chunk_indices, cp_p2p_counters, slice_batch
from tests.helpers.distributed import run_distributed
from tests.helpers.training import pretrain_worker, tiny_args, train_losses, write_corpus

BATCH, SEQ, HEADS, GROUPS, HEAD_DIM = 2, 16, 4, 2, 8
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
CASES = [(cp, comm, documents) for cp in (2, 4) for comm in ("p2p", "all_gather", "a2a") for documents in (False, True)
         if not (comm == "a2a" and cp == 4)]  # fmt: skip


def _full_attention(q, k, v, document_ids):
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None]
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask[:, None])
    return out.transpose(1, 2)


def _attention_worker(rank: int, world_size: int) -> dict:
    """Every case on this rank: max differences to full attention (output, dq, dk, dv) and the ring's bytes."""
    generator = torch.Generator().manual_seed(0)
    q, grad = (
        torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in "qg"
    )
    k, v = (torch.randn(BATCH, SEQ, GROUPS, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in "kv")
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]}
    results = {}
    for cp, comm, documents in CASES:
        group, cp_rank = groups[cp], rank % cp
        document_ids = DOCUMENTS if documents else None
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = _full_attention(*full, document_ids)
        (expected * grad).sum().backward()
        index = chunk_indices(SEQ, cp, cp_rank)
        local = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
        cp_p2p_counters.reset()
        masks = None if document_ids is None else ContextParallelDocuments(document_ids)
        context = context_parallel_attention(*local, group, comm, masks).transpose(0, 1)
        (context * grad[:, index]).sum().backward()
        errors = [(context - expected[:, index]).abs().max().item()]
        errors += [
            (mine.grad - theirs.grad[:, index]).abs().max().item()
            for mine, theirs in zip(local, full, strict=True)
        ]
        results[(cp, comm, documents)] = (errors, cp_p2p_counters.bytes_sent)
    return results


@pytest.fixture(scope="module")
def attention_results() -> list[dict]:
    return run_distributed(_attention_worker, 4)


@pytest.mark.processes
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c[0]}-{c[1]}-{'documents' if c[2] else 'causal'}")
def test_context_parallel_attention_equals_full_attention(attention_results, case) -> None:
    for rank in range(4):
        errors, _ = attention_results[rank][case]
        assert max(errors) < 1e-6, (rank, errors)  # fp32 blocks of fp64 inputs


@pytest.mark.processes
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_per_rank_equal_the_closed_form(attention_results, cp) -> None:
    forward, backward = ring_bytes_per_rank(BATCH, SEQ, cp, GROUPS, HEAD_DIM, element_size=8)
    assert forward == (cp - 1) * 2 * BATCH * (SEQ // cp) * GROUPS * HEAD_DIM * 8
    for rank in range(4):
        for documents in (False, True):
            assert attention_results[rank][(cp, "p2p", documents)][1] == forward + backward
            assert attention_results[rank][(cp, "all_gather", documents)][1] == 0


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert chunk_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    batch = {
        "tokens": torch.arange(16)[None],
        "position_ids": torch.arange(16)[None],
        "document_ids": DOCUMENTS,
    }
    assert slice_batch(batch, None)["tokens"].shape == (1, 16)


# -- training: a one-process checkpoint continues under context parallelism ------------------------------------

LLAMA_DOCUMENTS = [
    "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization",
    "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--reset-attention-mask",
    "--reset-position-ids", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip
CP2 = ["--context-parallel-size", "2"]
LAYOUTS = {  # name: flags, on four ranks (the CP=2 runs with DP=2)
    "cp2-p2p-dp2": CP2,
    "cp2-all_gather-dp2": [*CP2, "--cp-comm-type", "allgather"],
    "cp2-a2a-dp2": [*CP2, "--cp-comm-type", "a2a"],
    "cp2-tp2-sp": [*CP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2-pp2": [*CP2, "--pipeline-model-parallel-size", "2"],
}


def _argv(run_dir: str, data: str, *extra: str) -> list[str]:
    return tiny_args(
        run_dir, "--data-path", data, "--split", "90,10,0", "--train-iters", "4", "--save-interval", "2",
        "--eval-iters", "0", *LLAMA_DOCUMENTS, *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def continued_losses(tmp_path_factory) -> dict[str, list[float]]:
    """Iterations 3 and 4 of each layout resumed from the one-process run's iteration-2 checkpoint, and the one
    process's own four losses under "one process"."""
    tmp = tmp_path_factory.mktemp("cp")
    data = write_corpus(str(tmp))
    reference = str(tmp / "one-process")
    run_distributed(pretrain_worker, 1, [_argv(reference, data)], timeout=300)
    runs = []
    for name, flags in LAYOUTS.items():
        argv = _argv(str(tmp / name), data, *flags, "--ckpt-step", "2")
        argv[argv.index("--load") + 1] = reference
        runs.append(argv)
    run_distributed(pretrain_worker, 4, runs, timeout=300)
    return {
        "one process": train_losses(reference),
        **{name: train_losses(str(tmp / name)) for name in LAYOUTS},
    }


@pytest.mark.processes
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_process_checkpoint_continues_with_the_same_losses(continued_losses, name) -> None:
    reference = continued_losses["one process"]
    assert len(set(reference)) == 4
    np.testing.assert_allclose(continued_losses[name], reference[2:], rtol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--seq-length", "14", "--max-position-embeddings", "16"],
            "not divisible by 2 x --context-parallel-size 2",
        ),
        (["--attention-dropout", "0.1"], "needs --attention-dropout 0"),
        (["--cp-comm-type", "a2a", "--num-query-groups", "1"], "does not divide them"),
        (["--cp-comm-type", "a2a+p2p"], "--cp-comm-type"),
    ],
)
def test_flags_context_parallelism_cannot_take_are_refused(flags, message, capsys) -> None:
    argv = tiny_args("/nonexistent", "--train-iters", "1", *LLAMA_DOCUMENTS, *CP2, *flags)
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=2)
    assert message in capsys.readouterr().err


def test_families_without_causal_self_attention_refuse_context_parallelism() -> None:
    from megatron_train.families.registry import get_family
    from megatron_train.training.entry import check_family_config

    config = parse_args(tiny_args("/nonexistent", "--train-iters", "1", "--attention-dropout", "0", *CP2), 2)
    check_family_config(get_family("gpt"), config)
    with pytest.raises(ValueError, match="--context-parallel-size 2: BERT's attention is bidirectional"):
        check_family_config(get_family("bert"), config)
