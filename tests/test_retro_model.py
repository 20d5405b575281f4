"""RetroModel: Megatron's Retro layer placement and names, chunked cross-attention that never shows a token its
future, the encoder's output reaching the later Retro layers, and TP=2 (+SP, + recompute) equal to one process."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_train.models.gpt import GPTModel
from megatron_train.models.retro import RetroModel, from_chunks, retro_decoder_layer_numbers, to_chunks
from megatron_train.models.retro_config import RetroConfig
from megatron_train.parallel import allreduce_sequence_parallel_grads, state
from megatron_train.parallel.random import get_rng_tracker, model_parallel_seed
from tests.helpers.distributed import run_distributed
from tests.helpers.tensors import full_tensor, relative_error
from tests.helpers.tiny import tiny_config, tiny_llama_config

VOCAB, SEQ, CHUNK, BATCH = 64, 16, 4, 2
RETRO = dict(retro_chunk_length=CHUNK, retro_encoder_hidden_dropout=0.0, retro_encoder_attention_dropout=0.0)


def _retro_config(**overrides) -> RetroConfig:
    return RetroConfig(**{**RETRO, **overrides})


def _inputs(retro: RetroConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    shape = (BATCH, SEQ // CHUNK, retro.retro_num_neighbors, retro.retro_retrieved_length)
    return ids, torch.randint(0, VOCAB, shape, generator=generator)


@pytest.mark.parametrize(
    "num_layers, expected", [(6, [6]), (12, [6, 9, 12]), (15, [6, 9, 12, 15]), (16, [9, 12, 15]), (24, [9, 12, 15, 18, 21, 24])]
)  # fmt: skip
def test_retro_layers_are_megatrons(num_layers, expected):
    assert retro_decoder_layer_numbers(num_layers) == expected


def test_a_decoder_without_a_retro_layer_is_refused():
    with pytest.raises(ValueError, match="at least 6 layers"):
        RetroModel(tiny_config(num_layers=5), VOCAB, retro=_retro_config())


def test_only_the_retro_layers_have_cross_attention_and_the_first_has_the_encoder():
    model = RetroModel(
        tiny_config(num_layers=9, seq_length=SEQ), VOCAB, retro=_retro_config(retro_encoder_layers=3)
    )
    names = list(model.state_dict())
    with_cross = {int(n.split(".")[2]) for n in names if ".cross_attention." in n}
    assert with_cross == {5, 8}  # 0-based: layers 6 and 9
    encoder_layers = {int(n.split(".")[6]) for n in names if ".cross_attention.encoder.layers." in n}
    assert encoder_layers == {0, 1, 2}
    assert all(n.startswith("decoder.layers.5.") for n in names if ".encoder." in n)
    encoder_cross = [n for n in names if ".encoder.layers." in n and ".cross_attention.attn." in n]
    assert encoder_cross and all(
        ".encoder.layers.0." in n for n in encoder_cross
    )  # Megatron: encoder layer 1
    assert "decoder.layers.8.cross_attention.attn.linear_kv.weight" in names


def test_chunks_round_trip():
    hidden = torch.arange(2 * 12 * 3, dtype=torch.float32).view(12, 2, 3)
    chunked = to_chunks(hidden, 4)
    assert chunked.shape == (4, 6, 3)
    torch.testing.assert_close(chunked[:, 1], hidden[4:8, 0])  # sample 0, chunk 1 is column 1
    torch.testing.assert_close(chunked[:, 3 + 2], hidden[8:12, 1])  # sample 1, chunk 2 is column 3 + 2
    torch.testing.assert_close(from_chunks(chunked, 2), hidden)


def _logits(model: RetroModel, ids: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, neighbor_tokens=neighbours)


def test_chunked_cross_attention_shows_no_token_its_future():
    """A token's logits depend on no later token, and on chunk j's neighbours only from chunk j's last token
    on (Megatron's shift by chunk_length - 1): neighbours are retrieved with the whole chunk."""
    torch.manual_seed(0)
    retro = _retro_config()
    model = RetroModel(tiny_config(num_layers=6, seq_length=SEQ), VOCAB, retro=retro).eval()
    ids, neighbours = _inputs(retro)
    reference = _logits(model, ids, neighbours)
    for position in (3, 9, 15):
        changed = ids.clone()
        changed[:, position] = (changed[:, position] + 1) % VOCAB
        logits = _logits(model, changed, neighbours)
        torch.testing.assert_close(logits[:, :position], reference[:, :position], rtol=0, atol=0)
        assert not torch.allclose(logits[:, position], reference[:, position])
    for chunk in range(SEQ // CHUNK):
        changed = neighbours.clone()
        changed[:, chunk] = (changed[:, chunk] + 1) % VOCAB
        logits = _logits(model, ids, changed)
        first_affected = chunk * CHUNK + CHUNK - 1
        torch.testing.assert_close(logits[:, :first_affected], reference[:, :first_affected], rtol=0, atol=0)
        assert not torch.allclose(logits[:, first_affected], reference[:, first_affected])


def test_the_encoder_output_is_the_context_of_the_later_retro_layers():
    """Layer 9's chunked cross-attention attends to what layer 6's encoder produced: [r * k, b * l, h]."""
    torch.manual_seed(0)
    retro = _retro_config()
    config = tiny_config(num_layers=9, seq_length=SEQ)
    model = RetroModel(config, VOCAB, retro=retro).eval()
    seen = {}
    for number in (5, 8):
        model.decoder.layers[number].cross_attention.attn.register_forward_hook(
            lambda module, args, output, number=number: seen.__setitem__(number, args[1])
        )
    ids, neighbours = _inputs(retro)
    _logits(model, ids, neighbours)
    k, r = retro.retro_num_neighbors, retro.retro_retrieved_length
    assert seen[5].shape == seen[8].shape == (r * k, BATCH * SEQ // CHUNK, config.hidden_size)
    assert seen[5] is seen[8]


def test_generation_lengths_that_are_not_whole_chunks_run():
    torch.manual_seed(0)
    retro = _retro_config()
    model = RetroModel(tiny_config(num_layers=6, seq_length=SEQ), VOCAB, retro=retro).eval()
    ids, neighbours = _inputs(retro)
    logits = _logits(model, ids[:, :7], neighbours[:, :2])
    assert logits.shape == (BATCH, 7, VOCAB) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"neighbor_tokens must be \[batch, chunks"):
        _logits(model, ids[:, :7], neighbours)


def _copy_task_batch(generator: torch.Generator, chunk: int, chunks: int, batch: int, vocab: int) -> tuple:
    """Random token sequences whose chunk j's one neighbour is the sequence's own chunk j and its continuation
    (a database holding the text): tokens after chunk 0 can be copied from the neighbours, none can be guessed."""
    seq = chunk * chunks
    text = torch.randint(0, vocab, (batch, seq + chunk + 1), generator=generator)
    neighbours = torch.stack([text[:, j * chunk : (j + 2) * chunk] for j in range(chunks)], 1).unsqueeze(2)
    return text[:, :seq], text[:, 1 : seq + 1], neighbours


@pytest.mark.slow  # 600 training steps in one process: a minute or more; make test-fast leaves it out
def test_retro_learns_to_read_the_continuation_of_its_neighbours():
    """Trained where only retrieval helps, Retro's loss falls below chance from chunk 0's last token on (the
    first that may see chunk 0's neighbours) and not before; other samples' neighbours make it worse than
    chance; the GPT of the same decoder stays at chance. The KJV of `make retro` has few chunks that another
    document continues, so there the gap is small (README, Retro flow); this shows the model can use them."""
    vocab, chunk, chunks, batch = 32, 4, 4, 16
    retro = _retro_config(retro_chunk_length=chunk, retro_num_neighbors=1)
    # The exact GELU, as when this seed and step count were chosen: with the tanh GELU (--bias-gelu-fusion, the
    # default since the Megatron flags) the same run stays at chance for 300 steps. Leaving chance on this copy
    # task is seed-sensitive (tanh GELU, lr 3e-3: seeds 0 and 2 stay, seed 1 barely leaves).
    config = tiny_config(num_layers=6, seq_length=chunk * chunks, bias_gelu_fusion=False)
    chance = math.log(vocab)
    torch.manual_seed(0)
    models = {"retro": RetroModel(config, vocab, retro=retro), "gpt": GPTModel(config, vocab)}
    losses = {}
    for name, model in models.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(1)
        for _ in range(300):
            ids, labels, neighbours = _copy_task_batch(generator, chunk, chunks, batch, vocab)
            extra = {"neighbor_tokens": neighbours} if name == "retro" else {}
            loss = model(ids, labels=labels, **extra).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        ids, labels, neighbours = _copy_task_batch(
            torch.Generator().manual_seed(99), chunk, chunks, 64, vocab
        )
        with torch.no_grad():
            if name == "retro":
                losses["retro"] = model(ids, labels=labels, neighbor_tokens=neighbours).mean(0)
                losses["shuffled"] = model(ids, labels=labels, neighbor_tokens=neighbours.roll(1, 0)).mean(0)
            else:
                losses["gpt"] = model(ids, labels=labels).mean(0)
    first = chunk - 1  # chunk 0's last token: the first whose prediction may read chunk 0's neighbours
    assert (losses["retro"][:first] - chance).abs().max() < 0.15, losses["retro"]
    assert losses["retro"][first:].mean() < chance - 0.3, losses["retro"]
    assert losses["shuffled"][first:].mean() > chance + 0.3, losses["shuffled"]
    assert (losses["gpt"] - chance).abs().max() < 0.1, losses["gpt"]


def test_a_fork_inside_a_fork_of_the_same_stream_continues_it():
    """Retro's encoder runs sequence parallel inside the sequence-parallel decoder: its dropout must draw the
    stream's next numbers, not replay those the decoder drew since the outer fork began."""
    model_parallel_seed(5)
    with get_rng_tracker().fork():
        straight = torch.rand(8)
    model_parallel_seed(5)
    with get_rng_tracker().fork():
        first = torch.rand(4)
        with get_rng_tracker().fork():
            nested = torch.rand(4)
    torch.testing.assert_close(torch.cat([first, nested]), straight, rtol=0, atol=0)


def _loss_and_grads(config, retro, sequence_parallel: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = RetroModel(config, VOCAB, retro=retro, sequence_parallel=sequence_parallel, init_seed=1234)
    ids, neighbours = _inputs(retro)
    losses = model(ids, labels=torch.roll(ids, -1, dims=1), neighbor_tokens=neighbours)
    loss = (losses * torch.linspace(0.5, 1.5, losses.numel()).view_as(losses)).mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model)
    return loss.detach(), {name: full_tensor(p.grad, p) for name, p in model.named_parameters()}


def _tensor_parallel_worker(rank: int, world_size: int) -> dict[str, tuple[float, float, bool]]:
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    cases = {
        "gpt": tiny_config(num_layers=6, seq_length=SEQ),
        "llama_gqa": tiny_llama_config(num_layers=6, seq_length=SEQ),
        "gpt_recompute": tiny_config(num_layers=6, seq_length=SEQ, **recompute),
    }
    retro_config = _retro_config()
    results = {}
    for name, config in cases.items():
        reference_loss, reference_grads = _loss_and_grads(config, retro_config, False)
        for sequence_parallel in (False, True):
            state.initialize_model_parallel(tensor_model_parallel_size=2)
            loss, grads = _loss_and_grads(config, retro_config, sequence_parallel)
            grad_error = max(relative_error(grads[key], reference_grads[key]) for key in reference_grads)
            retro = [key for key in grads if ".cross_attention." in key]
            retro_grads = sum(1 for key in retro if grads[key].abs().sum() > 0) == len(retro) > 10
            results[f"{name}_sp{int(sequence_parallel)}"] = (
                relative_error(loss, reference_loss),
                grad_error,
                retro_grads,
            )
            state.destroy_model_parallel()
    state.initialize_model_parallel(tensor_model_parallel_size=2)
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)
    noisy = _retro_config(retro_encoder_hidden_dropout=0.1, retro_encoder_attention_dropout=0.1)
    runs = []
    for config in (
        tiny_config(num_layers=6, seq_length=SEQ, **dropout),
        tiny_config(num_layers=6, seq_length=SEQ, **dropout, **recompute),
    ):
        model_parallel_seed(99)
        runs.append(_loss_and_grads(config, noisy, True))
    (loss, grads), (recomputed_loss, recomputed_grads) = runs
    grad_error = max(relative_error(recomputed_grads[key], grads[key]) for key in grads)
    results["sp_dropout_recompute"] = (relative_error(recomputed_loss, loss), grad_error, True)
    state.destroy_model_parallel()
    return results


@pytest.mark.processes
def test_retro_under_tensor_and_sequence_parallel_equals_one_process():
    """Loss and every gradient (chunked cross-attention and encoder included) within 1e-5 of one process; with
    dropout under SP, full recompute replays the masks of the first forward (the encoder's included)."""
    results = run_distributed(_tensor_parallel_worker, 2)[0]
    assert len(results) == 7
    for case, (loss_error, grad_error, retro_grads) in results.items():
        assert loss_error < 1e-5, case
        assert grad_error < 1e-5, case
        assert retro_grads, case  # the gradient reached every Retro weight
