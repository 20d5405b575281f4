"""Every tokenizer a checkpoint can carry survives a round trip through every saver and loader: a GPT trained with
it, converted out (hf, megatron, torch_dist) and back in (flow), serves the same greedy answer through the loading
path of `run_text_generation_server --load` (tokenizer rebuilt from the checkpoint's own files)."""

from __future__ import annotations

import base64
import json
import os
import shutil

import pytest
import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.convert import ModelWeights, flow
from megatron_train.convert.tokenizer_files import tokenizer_sources
from megatron_train.convert.weights import trim_vocab
from megatron_train.data.config import DataConfig
from megatron_train.inference.checkpoint import build_inference_parser, load_for_inference
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.tokenizer import tokenizer_from_config, vocab_size_with_padding
from megatron_train.tokenizer.train import train_byte_level_bpe
from megatron_train.tools.checkpoint_util import main
from megatron_train.training.config import TokenizerConfig

TEXT = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
] * 8
WORDS = sorted({word.strip(".,").lower() for line in TEXT for word in line.split()})
SAVERS = ("hf", "megatron", "torch_dist")


def _wordpiece(folder) -> TokenizerConfig:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    path = folder / "vocab.txt"
    path.write_text("\n".join(specials + WORDS + [".", ","] + [chr(c) for c in range(97, 123)]) + "\n")
    return TokenizerConfig(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(path))


def _tiktoken(folder) -> TokenizerConfig:
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the", b"in", b"an", b"and"]
    records = [{"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("latin-1")}
               for rank, token in enumerate(tokens)]  # fmt: skip
    (folder / "tiktoken.json").write_text(json.dumps(records))
    return TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(folder / "tiktoken.json"),
                           tiktoken_pattern="v2", tiktoken_num_special_tokens=10)  # fmt: skip


def _sentencepiece(folder) -> str:
    sentencepiece = pytest.importorskip("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_prefix=str(folder / "spm"), vocab_size=30, model_type="unigram",
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )  # fmt: skip
    return str(folder / "spm.model")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, TokenizerConfig]:
    """One tokenizer of every --tokenizer-type (HuggingFaceTokenizer as a tokenizer.json and as a folder)."""
    root = tmp_path_factory.mktemp("tokenizers")
    bpe = train_byte_level_bpe(TEXT, str(root / "bpe"), vocab_size=300)
    alone = root / "alone"
    alone.mkdir()
    shutil.copy(bpe["tokenizer_json"], alone / "tokenizer.json")
    spm = _sentencepiece(root)
    return {
        "GPT2BPETokenizer": TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer", vocab_file=bpe["vocab_file"], merge_file=bpe["merge_file"]
        ),  # fmt: skip
        "HuggingFaceTokenizer-file": TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(alone / "tokenizer.json")
        ),  # fmt: skip
        "HuggingFaceTokenizer-folder": TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(root / "bpe")
        ),  # fmt: skip
        "SentencePieceTokenizer": TokenizerConfig(
            tokenizer_type="SentencePieceTokenizer", tokenizer_model=spm
        ),
        "GPTSentencePieceTokenizer": TokenizerConfig(
            tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=spm
        ),
        "Llama2Tokenizer": TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=spm),
        "BertWordPieceLowerCase": _wordpiece(root),
        "TikTokenizer": _tiktoken(root),
        "NullTokenizer": TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=40),
    }


def _trained_with(tokenizer_config: TokenizerConfig, folder: str) -> None:
    """A tiny GPT of this tokenizer's vocabulary saved as a run of ours would (the tokenizer's files copied)."""
    vocab = tokenizer_from_config(tokenizer_config).vocab_size
    model_config = TransformerConfig.gpt2(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=32,
                                          true_vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(5)
    model = GPTModel(model_config, vocab_size_with_padding(vocab, 128))
    config = MegatronConfig(model=model_config, data=DataConfig(), tokenizer=tokenizer_config)
    weights = ModelWeights(config, trim_vocab(model.state_dict(), vocab), tokenizer_sources(tokenizer_config))
    flow.save(weights, folder)


def _serve_greedy(load_dir: str, prompt: str) -> tuple[str, list[int]]:
    """What `run_text_generation_server --load load_dir` answers a greedy request with."""
    model, tokenizer, _ = load_for_inference(
        build_inference_parser("").parse_args(["--load", load_dir]), "cpu"
    )
    params = GenerationParams(tokens_to_generate=6, top_k=1, use_eod_token_for_early_termination=False)
    output = generate(model, tokenizer, [prompt], params)
    return output.texts[0], output.tokens[0]


@pytest.mark.parametrize(
    "kind",
    ["GPT2BPETokenizer", "HuggingFaceTokenizer-file", "HuggingFaceTokenizer-folder", "SentencePieceTokenizer",
     "GPTSentencePieceTokenizer", "Llama2Tokenizer", "BertWordPieceLowerCase", "TikTokenizer", "NullTokenizer"],
)  # fmt: skip
def test_every_tokenizer_serves_the_same_answer_after_a_round_trip_through_every_saver(
    tokenizers, tmp_path, capsys, kind
):
    source = str(tmp_path / "run")
    _trained_with(tokenizers[kind], source)
    prompt = "3 4 5" if kind == "NullTokenizer" else "In the beginning"
    expected = _serve_greedy(source, prompt)
    for saver in SAVERS:
        out, back = str(tmp_path / saver), str(tmp_path / f"{saver}-back")
        main(["--saver", saver, "--load-dir", source, "--save-dir", out])
        main(["--loader", saver, "--load-dir", out, "--save-dir", back])
        printed = capsys.readouterr().out
        assert f"serve: python -m megatron_train.tools.run_text_generation_server --load {back}" in printed
        assert _serve_greedy(back, prompt) == expected, saver
        recorded = flow.load(back).config.tokenizer
        assert recorded.tokenizer_type == tokenizers[kind].tokenizer_type, saver
        for field in (
            "vocab_file",
            "merge_file",
            "tokenizer_model",
        ):  # the copies inside the converted folder
            value = getattr(recorded, field)
            assert value is None or value.startswith(os.path.join(back, "tokenizer")), (saver, field, value)


def test_the_exports_tokenizer_loads_in_transformers_where_it_has_an_equivalent(tokenizers, tmp_path):
    transformers = pytest.importorskip("transformers")
    for kind in ("GPT2BPETokenizer", "BertWordPieceLowerCase", "HuggingFaceTokenizer-folder"):
        source, out = str(tmp_path / kind), str(tmp_path / f"{kind}-hf")
        _trained_with(tokenizers[kind], source)
        main(["--saver", "hf", "--load-dir", source, "--save-dir", out])
        theirs = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
        ours = tokenizer_from_config(tokenizers[kind])
        text = "in the beginning god created the earth"
        assert theirs(text, add_special_tokens=False).input_ids == ours.tokenize(text), kind


def test_an_export_without_the_tokenizer_record_converts_in_and_serves(tokenizers, tmp_path, capsys):
    """The issue's case: a GPT-2 BPE checkpoint exported with --saver hf by a version that wrote only vocab.json
    and merges.txt, converted in again, printed a serve: command that failed ("not a loadable tokenizer folder")."""
    source, out, back = str(tmp_path / "run"), tmp_path / "hf", str(tmp_path / "back")
    _trained_with(tokenizers["GPT2BPETokenizer"], source)
    main(["--saver", "hf", "--load-dir", source, "--save-dir", str(out)])
    for name in ("megatron_tokenizer.json", "tokenizer_config.json"):
        os.remove(out / name)
    assert sorted(os.listdir(out)) == ["config.json", "merges.txt", "model.safetensors", "vocab.json"]
    main(["--loader", "hf", "--load-dir", str(out), "--save-dir", back])
    assert _serve_greedy(back, "In the beginning") == _serve_greedy(source, "In the beginning")
    assert flow.load(back).config.tokenizer.tokenizer_type == "GPT2BPETokenizer"
