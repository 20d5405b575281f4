"""InstructRetro: `pretrain_retro --sft` instruction-tunes a Retro model on JSONL conversations, the loss on the
assistant's tokens only, each sample's chunks retrieving their neighbours from the project's index; a tiny run
lowers the loss and `--finetune --load` continues from its checkpoint.

The project here uses a word-level Hugging Face tokenizer with a chat template's tokens
(`tests.helpers.convert_models.save_chat_tokenizer`), so conversations render; its embedder is `word_embed` (the
workers put it where the project's BERT embedder would be loaded)."""

from __future__ import annotations

import json
import os
import zlib

import faiss
import numpy as np
import pytest

from megatron_train import pretrain_retro
from megatron_train.arguments import parse_args
from megatron_train.tasks import main as tasks_main
from megatron_train.tasks.retro_qa import normalize_answer
from megatron_train.tokenizer.bert import BertWordPieceTokenizer
from megatron_train.tokenizer.huggingface import HuggingFaceAutoTokenizer
from retro import family as retro_family
from retro.config import ChunkDatabaseConfig
from retro.db import ChunkDatabase, build_chunk_database
from retro.project import DATA_DIR, RetroProject, db_dir, index_path
from retro.retrieval import RetrievingDataset, complete_chunks
from storage.atomic import atomic_path
from tests.helpers.convert_models import CHAT_SPECIALS, VOCAB, save_chat_tokenizer
from tests.helpers.distributed import run_distributed
from tests.helpers.retro_corpus import write_corpus, write_jsonl
from tests.helpers.training import read_metrics
from tests.helpers.wordpiece_corpus import write_vocab

SEQ_LENGTH, CHUNK_LENGTH, EMBED_DIM = 16, 4, 64
FIRST_WORD = len(CHAT_SPECIALS) + 3  # w0 (after the specials and "system", "user", "assistant")


def word_embed(texts: list[str]) -> np.ndarray:
    """float32 [n, EMBED_DIM]: each (position, word) hashed into a bucket, so equal texts are at distance 0."""
    vectors = np.zeros((len(texts), EMBED_DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        for position, word in enumerate(text.split()):
            vectors[row, zlib.crc32(f"{position}:{word}".encode()) % EMBED_DIM] += 1.0
    return vectors


def build_chat_project(directory: str) -> str:
    """DIR/tok (the GPT tokenizer), DIR/data, DIR/db, DIR/index and DIR/config.json (no pretraining neighbours)."""
    save_chat_tokenizer(os.path.join(directory, "tok"), None)
    tokenizer = HuggingFaceAutoTokenizer(os.path.join(directory, "tok"))
    rng = np.random.default_rng(0)
    documents = [
        np.append(rng.integers(FIRST_WORD, VOCAB, size=rng.integers(6, 20)), tokenizer.eod) for _ in range(30)
    ]
    os.makedirs(os.path.join(directory, DATA_DIR))
    write_corpus(os.path.join(directory, DATA_DIR, "corpus"), documents)
    write_vocab(os.path.join(directory, "bert_vocab.txt"))
    project = RetroProject(
        retro_gpt_data_path=["corpus"], retro_gpt_split="100,0,0", retro_gpt_seq_length=SEQ_LENGTH,
        retro_gpt_chunk_length=CHUNK_LENGTH, retro_gpt_seed=7, retro_gpt_train_samples=8,
        retro_gpt_eval_interval=1000, retro_gpt_eval_iters=0, retro_gpt_global_batch_size=4,
        retro_gpt_tokenizer_type="HuggingFaceTokenizer", retro_bert_tokenizer_type="BertWordPieceLowerCase",
        retro_bert_vocab_file="bert_vocab.txt", retro_block_size=50, retro_query_num_neighbors_save=2,
        retro_gpt_tokenizer_model="tok",
    )  # fmt: skip
    db = build_chunk_database(
        project.data_path(directory),
        db_dir(directory),
        ChunkDatabaseConfig(retro_gpt_chunk_length=CHUNK_LENGTH, retro_gpt_split="100,0,0"),
        tokenizer,
        BertWordPieceTokenizer(os.path.join(directory, "bert_vocab.txt")),
    )
    index = faiss.IndexFlatL2(EMBED_DIM)
    index.add(word_embed(db.chunk_texts(range(len(db)), tokenizer)))
    os.makedirs(os.path.dirname(index_path(directory)))
    with atomic_path(index_path(directory)) as tmp:
        faiss.write_index(index, tmp)
    project.save(directory)
    return directory


def write_conversations(path: str, count: int = 24) -> str:
    """User "wI wJ", assistant "wJ wI": an answer the model can learn from the prompt."""
    with open(path, "w") as f:
        for i in range(count):
            user, assistant = f"w{i} w{i + 30}", f"w{i + 30} w{i}"
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> str:
    return build_chat_project(str(tmp_path_factory.mktemp("chat_project")))


def sft_args(project: str, data: str, save: str, *extra: str) -> list[str]:
    return [
        "--retro-project-dir", project, "--retro-add-retriever", "--sft", "--train-data-path", data,
        "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings", "128",
        "--micro-batch-size", "4",
        "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--num-workers", "0", "--eval-iters", "0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--retro-encoder-hidden-dropout", "0.0", "--retro-encoder-attention-dropout", "0.0", "--save", save,
        *extra,
    ]  # fmt: skip


def sft_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[list[dict]]:
    retro_family.load_embedder = lambda path, device: word_embed  # the project's embedder, in this test
    results = []
    for argv in runs:
        pretrain_retro.main(argv)
        results.append(read_metrics(argv[argv.index("--save") + 1]))
    return results


def test_sft_samples_mask_all_but_the_answer_and_retrieve_per_chunk(project, tmp_path, monkeypatch):
    monkeypatch.setattr(retro_family, "load_embedder", lambda path, device: word_embed)
    data = write_conversations(str(tmp_path / "qa.jsonl"))
    argv = retro_family.with_project_settings(
        sft_args(project, data, str(tmp_path / "s"), "--train-iters", "2")
    )
    assert argv[argv.index("--seq-length") + 1] == str(SEQ_LENGTH)  # the project's, as a default
    assert "--data-path" not in argv  # the conversations, not the project's corpus
    config = parse_args(argv, world_size=1)
    tokenizer = HuggingFaceAutoTokenizer(os.path.join(project, "tok"))
    train, valid, test = retro_family.datasets_provider(config, tokenizer, (8, 0, 0))
    assert isinstance(train, RetrievingDataset) and valid is None and test is None
    db = ChunkDatabase(db_dir(project))
    for idx in range(4):
        sample = train[idx]
        labels, mask = sample["labels"], sample["loss_mask"]
        # Only the assistant's answer and its end-of-turn token are in the loss.
        answer = tokenizer.detokenize(labels[mask == 1].tolist()).split()
        assert len(answer) == 3 and answer[2] == "<|im_end|>" and {"user", "assistant"}.isdisjoint(answer)
        user = tokenizer.detokenize(sample["tokens"].tolist()).split()
        assert answer[:2] == user[user.index("user") + 1 : user.index("user") + 3][::-1]
        # Neighbours [chunks, k, 2 chunks]: each chunk's nearest database chunks and their continuations.
        neighbours = sample["neighbor_tokens"]
        assert neighbours.shape == (SEQ_LENGTH // CHUNK_LENGTH, 2, 2 * CHUNK_LENGTH)
        tokens = sample["tokens"].tolist()
        ids = train.retriever.neighbour_ids(
            [tokens[s:e] for s, e in complete_chunks(len(tokens), CHUNK_LENGTH)]
        )
        for chunk in range(SEQ_LENGTH // CHUNK_LENGTH):
            first = db.chunk_tokens(int(ids[chunk, 0]))
            np.testing.assert_array_equal(neighbours[chunk, 0, : len(first)], first)
    with pytest.raises(ValueError, match="--seq-length 18 is not a multiple of the Retro chunk length 4"):
        RetrievingDataset(train.dataset, train.retriever, 18)


@pytest.fixture(scope="module")
def sft_runs(project, tmp_path_factory) -> dict:
    """A 40-step SFT from scratch, then 2 steps of `--finetune --load` from its checkpoint."""
    tmp = tmp_path_factory.mktemp("sft_runs")
    data = write_conversations(str(tmp / "qa.jsonl"))
    first, second = str(tmp / "sft"), str(tmp / "sft2")
    runs = [
        sft_args(project, data, first, "--train-iters", "40"),
        sft_args(project, data, second, "--train-iters", "2", "--load", first, "--finetune"),
    ]
    sft, finetuned = run_distributed(sft_worker, 1, runs, timeout=300)[0]
    return {"sft": sft, "finetuned": finetuned, "sft-dir": first}


@pytest.mark.processes
def test_a_tiny_sft_lowers_the_loss_and_finetune_continues_from_it(sft_runs):
    sft, finetuned = sft_runs["sft"], sft_runs["finetuned"]
    losses = [r["lm loss"] for r in sft if "split" not in r]
    assert len(losses) == 40 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    continued = [r for r in finetuned if "split" not in r]
    assert [r["iteration"] for r in continued] == [1, 2]  # --finetune: from iteration 0, the weights loaded
    assert continued[0]["lm loss"] < np.mean(losses[:3])


@pytest.mark.processes
def test_retro_qa_on_the_sft_checkpoint_retrieves_and_scores_known_answers(
    sft_runs, project, tmp_path, monkeypatch, capsys
):
    """`tasks.main --task RETRO-QA --retro-project-dir`: the Retro checkpoint answers with retrieval; the first
    question's answers are its own greedy answer, the second's one it cannot give: EM 0.5, F1 0.5."""
    monkeypatch.setattr(retro_family, "load_embedder", lambda path, device: word_embed)
    questions = [{"question": "w3 w33", "ctxs": [{"title": "w1", "text": "w2 w4"}]}, {"question": "w5 w35"}]
    load = ["--load", sft_runs["sft-dir"], "--retro-project-dir", project, "--out-seq-length", "3"]
    probe = write_jsonl(tmp_path / "probe.jsonl", [{**q, "answers": ["x"]} for q in questions])
    predictions = tasks_main.main(["--task", "RETRO-QA", "--valid-data", probe, *load])["predictions"]
    assert normalize_answer(predictions[0])
    records = [{**questions[0], "answers": [predictions[0]]}, {**questions[1], "answers": ["zzz zzz"]}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    metrics = tasks_main.main(["--task", "RETRO-QA", "--valid-data", path, *load])
    assert metrics["predictions"] == predictions and (metrics["exact_match"], metrics["f1"]) == (0.5, 0.5)
    assert "Exact Match: 0.5000; Method: RETRO-QA; Precision: 0.5000; recall: 0.5000; f1: 0.5000" in (
        capsys.readouterr().out
    )
