"""The Retro project directory's config.json: round trip, Megatron's sample counts, paths, bad files."""

from __future__ import annotations

import json

import pytest

from retro.project import RetroProject

PROJECT = RetroProject(
    retro_gpt_data_path=["3", "a", "1", "b"],
    retro_gpt_split="98,2,0",
    retro_gpt_seq_length=256,
    retro_gpt_chunk_length=64,
    retro_gpt_seed=1234,
    retro_gpt_train_samples=1000,
    retro_gpt_eval_interval=10,
    retro_gpt_eval_iters=2,
    retro_gpt_global_batch_size=16,
    retro_gpt_tokenizer_type="GPT2BPETokenizer",
    retro_bert_tokenizer_type="BertWordPieceLowerCase",
    retro_bert_vocab_file="embedder/vocab.txt",
    retro_block_size=1000,
    retro_query_num_neighbors_save=2,
    retro_neighbor_dirs={"train": "train", "valid": "valid", "test": None},
    retro_gpt_vocab_file="gpt/vocab.json",
    retro_gpt_merge_file="gpt/merges.txt",
)


def test_config_round_trip_and_paths(tmp_path):
    PROJECT.save(str(tmp_path))
    assert RetroProject.load(str(tmp_path)) == PROJECT
    assert PROJECT.data_path("/p") == ["3", "/p/data/a", "1", "/p/data/b"]
    single = RetroProject(**{**PROJECT.__dict__, "retro_gpt_data_path": ["corpus"]})
    assert single.data_path("/p") == ["/p/data/corpus"]
    assert PROJECT.neighbor_dir("/p", "valid") == "/p/query/valid"
    assert PROJECT.neighbor_dir("/p", "test") is None
    assert PROJECT.path("/p", PROJECT.retro_gpt_merge_file) == "/p/gpt/merges.txt"


def test_num_samples_follow_megatron_training():
    # 1000 samples / 16 = 62 iterations; evaluations at 10, 20, ..., 60 and at the end: 7 of 2 batches
    assert PROJECT.num_samples() == (1000, 7 * 2 * 16, 2 * 16)


def test_load_names_file_and_fields(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json: no Retro project config"):
        RetroProject.load(str(tmp_path))
    PROJECT.save(str(tmp_path))
    path = tmp_path / "config.json"
    values = json.loads(path.read_text())
    del values["retro_gpt_seq_length"]
    values["retro_new_field"] = 1
    path.write_text(json.dumps(values))
    with pytest.raises(
        ValueError, match=r"missing \['retro_gpt_seq_length'\], unknown \['retro_new_field'\]"
    ):
        RetroProject.load(str(tmp_path))
    with pytest.raises(ValueError, match="unknown split"):
        PROJECT.neighbor_dir("/p", "dev")
