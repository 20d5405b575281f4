"""The tokenizer a converted model carries, for every `--tokenizer-type`: which files it is, how each saver
places them, and how the `hf` loader reads them back (docs/architecture.md, checkpoints).

A loader gives `ModelWeights` the tokenizer settings (`config.tokenizer`, Megatron's flags) and the files they
name, `{name in a saved folder: source path}`. Every saver copies those files into its output and rewrites the
settings to the copies, keeping the type, so a model converted out and back in builds the same tokenizer:
ours and Megatron's formats into `<save-dir>/tokenizer/` (named by the saved args), a Hugging Face folder at
its top level with `megatron_tokenizer.json` recording the settings (file names relative to the folder) and,
for GPT-2 BPE and WordPiece, a `tokenizer_config.json` that `transformers.AutoTokenizer` loads. A Hugging Face
folder without that record is read as transformers would: its tokenizer files (HuggingFaceTokenizer), else a
bare vocab.json + merges.txt (GPT-2 BPE).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from megatron_train.convert.checks import check_fields
from megatron_train.convert.source import inside, member, read_json_object
from megatron_train.training.config import TokenizerConfig
from storage.atomic import atomic_copy, atomic_write_text

logger = logging.getLogger(__name__)

TOKENIZER_FOLDER = "tokenizer"  # ours and Megatron's formats: the copies, named by the saved args
RECORD_FILE = "megatron_tokenizer.json"  # Hugging Face folders: our tokenizer settings
FOLDER = "."  # a HuggingFaceTokenizer whose --tokenizer-model is the folder itself
# A Hugging Face tokenizer's files, any of which a model folder may hold.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
)
# The files of each type: the TokenizerConfig field that names one -> its name in a saved folder.
FILE_FIELDS: dict[str, dict[str, str]] = {
    "GPT2BPETokenizer": {"vocab_file": "vocab.json", "merge_file": "merges.txt"},
    "BertWordPieceLowerCase": {"vocab_file": "vocab.txt"},
    "BertWordPieceCase": {"vocab_file": "vocab.txt"},
    "SentencePieceTokenizer": {"tokenizer_model": "tokenizer.model"},
    "GPTSentencePieceTokenizer": {"tokenizer_model": "tokenizer.model"},
    "Llama2Tokenizer": {"tokenizer_model": "tokenizer.model"},
    "TikTokenizer": {"tokenizer_model": "tiktoken.json"},
    "NullTokenizer": {},
}
# What transformers.AutoTokenizer needs beside the files of the types it has an equivalent of.
HF_TOKENIZER_CONFIGS: dict[str, dict[str, Any]] = {
    "GPT2BPETokenizer": {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_prefix_space": False,
    },
    "BertWordPieceLowerCase": {"tokenizer_class": "BertTokenizer", "do_lower_case": True},
    "BertWordPieceCase": {"tokenizer_class": "BertTokenizer", "do_lower_case": False},
}


def _folder_form(tokenizer: TokenizerConfig) -> bool:
    """A HuggingFaceTokenizer given as a folder (transformers' AutoTokenizer) rather than one tokenizer.json."""
    return tokenizer.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(
        tokenizer.tokenizer_model or ""
    )


def hf_tokenizer_files_in(folder: str) -> dict[str, str]:
    """{file name: path} of the Hugging Face tokenizer files `folder` holds, each a regular file inside it."""
    return {
        name: inside(folder, os.path.join(folder, name), "a tokenizer file")
        for name in HF_TOKENIZER_FILES
        if os.path.lexists(os.path.join(folder, name))
    }


def _check_inside(source_dir: str | None, path: str, what: str) -> None:
    """A path the source's settings name inside the source folder must also resolve inside it."""
    if source_dir is None:
        return
    real_source = os.path.realpath(source_dir)
    if os.path.commonpath([real_source, os.path.abspath(path)]) != real_source:
        return  # the user's own file elsewhere, named by the flags the run was given
    real = os.path.realpath(path)
    if os.path.commonpath([real_source, real]) != real_source:
        raise ValueError(
            f"{path}: {what} resolves to {real}, outside {source_dir}; a model folder's files must lie inside "
            "it (copy the file in instead of linking it)"
        )


def tokenizer_sources(tokenizer: TokenizerConfig, source_dir: str | None = None) -> dict[str, str]:
    """{name in a saved folder: path} of the files `tokenizer`'s settings name; {} when one is missing (a
    checkpoint recording paths of the machine it was trained on: a warning says to pass the tokenizer flags).
    A file or folder that `source_dir` (the checkpoint read) holds must resolve inside it."""
    kind, model = tokenizer.tokenizer_type, tokenizer.tokenizer_model
    if kind == "HuggingFaceTokenizer" and model and os.path.isdir(model):
        _check_inside(source_dir, model, "the tokenizer folder")
        return hf_tokenizer_files_in(model)
    if kind == "HuggingFaceTokenizer":
        named = {"tokenizer.json": model}
    else:
        named = {name: getattr(tokenizer, field) for field, name in FILE_FIELDS.get(kind, {}).items()}
    missing = [str(path) for path in named.values() if not path or not os.path.isfile(path)]
    if missing:
        logger.warning(
            "the %s files the source names (%s) are not here: the converted model records the settings as they "
            "are; give the tokenizer flags when you use it", kind, ", ".join(missing),
        )  # fmt: skip
        return {}
    for path in named.values():
        _check_inside(source_dir, path, "a tokenizer file")
    return named


def placed_tokenizer(tokenizer: TokenizerConfig, files: dict[str, str], folder: str) -> TokenizerConfig:
    """`tokenizer` with its file settings pointing at `files`' copies under their names in `folder`."""
    if not files:
        return tokenizer
    if tokenizer.tokenizer_type == "HuggingFaceTokenizer":
        model = (
            folder if _folder_form(tokenizer) or len(files) > 1 else os.path.join(folder, next(iter(files)))
        )
        return dataclasses.replace(tokenizer, tokenizer_model=model)
    return dataclasses.replace(
        tokenizer,
        **{
            field: os.path.join(folder, name) for field, name in FILE_FIELDS[tokenizer.tokenizer_type].items()
        },
    )


def copy_tokenizer(
    tokenizer: TokenizerConfig, files: dict[str, str], build_dir: str, final_dir: str
) -> TokenizerConfig:
    """Copy `files` into `<build_dir>/tokenizer/`; returns the settings naming them at `<final_dir>/tokenizer/`
    (where they lie once the output is moved into place). Ours and Megatron's savers."""
    for name, source in files.items():
        atomic_copy(source, os.path.join(build_dir, TOKENIZER_FOLDER, name))
    return placed_tokenizer(tokenizer, files, os.path.join(os.path.abspath(final_dir), TOKENIZER_FOLDER))


def write_hf_tokenizer(tokenizer: TokenizerConfig, files: dict[str, str], folder: str) -> None:
    """The `hf` saver's tokenizer: the files at the folder's top level, the record of our settings, and a
    tokenizer_config.json for transformers where the type has an equivalent and the files bring none."""
    needs_files = tokenizer.tokenizer_type == "HuggingFaceTokenizer" or FILE_FIELDS.get(
        tokenizer.tokenizer_type
    )
    if tokenizer.tokenizer_type is None or (needs_files and not files):
        return  # none, or its files are not here (the loader said so)
    for name, source in files.items():
        atomic_copy(source, os.path.join(folder, name))
    placed = placed_tokenizer(tokenizer, files, FOLDER)
    record = {key: value for key, value in dataclasses.asdict(placed).items() if value is not None}
    for field in ("vocab_file", "merge_file", "tokenizer_model"):
        if field in record:
            record[field] = os.path.basename(record[field]) if record[field] != FOLDER else FOLDER
    atomic_write_text(os.path.join(folder, RECORD_FILE), json.dumps(record, indent=2))
    hf_config = HF_TOKENIZER_CONFIGS.get(tokenizer.tokenizer_type)
    if hf_config is not None and "tokenizer_config.json" not in files:
        atomic_write_text(os.path.join(folder, "tokenizer_config.json"), json.dumps(hf_config, indent=2))


def read_hf_tokenizer(folder: str) -> tuple[TokenizerConfig, dict[str, str]]:
    """(settings, files) of the tokenizer a Hugging Face folder holds: as its `megatron_tokenizer.json` records,
    else its Hugging Face tokenizer files, else a bare vocab.json + merges.txt (GPT-2 BPE), else none."""
    record_path = os.path.join(folder, RECORD_FILE)
    if os.path.lexists(record_path):
        record = read_json_object(inside(folder, record_path, "the tokenizer record"))
        check_fields(record, TokenizerConfig, record_path)
        kind = record.get("tokenizer_type")
        if kind != "HuggingFaceTokenizer" and kind not in FILE_FIELDS:
            raise ValueError(
                f"{record_path}: tokenizer_type {kind!r} is not one of "
                f"{', '.join(['HuggingFaceTokenizer', *FILE_FIELDS])}"
            )
        for field in ("vocab_file", "merge_file", "tokenizer_model"):
            if record.get(field) == FOLDER:
                record[field] = folder
            elif record.get(field) is not None:
                record[field] = member(folder, record[field], f"{record_path}'s {field}")
        tokenizer = TokenizerConfig(**record)
        return tokenizer, tokenizer_sources(tokenizer, folder)
    files = hf_tokenizer_files_in(folder)
    if "tokenizer.json" in files or "tokenizer_config.json" in files:
        return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder), files
    if {"vocab.json", "merges.txt"} <= set(files):
        tokenizer = TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab.json"], merge_file=files["merges.txt"]
        )
        return tokenizer, {name: files[name] for name in ("vocab.json", "merges.txt")}
    return TokenizerConfig(), {}
