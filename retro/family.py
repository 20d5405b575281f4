"""The Retro family: what `torchrun -m megatron_train.pretrain_retro --retro-project-dir DIR --retro-add-retriever
<Megatron flags>` trains (Megatron's pretrain_retro.py), and how the tools serve a Retro checkpoint.

It lives here, beside the preprocessing whose project it reads, because it depends on both `megatron_train` (the
model, the GPT data, the loop) and `retro` (the project, its database, neighbours and index); the training engine
finds it by name through `megatron_train.families.registry`, never by import (docs/architecture.md, model
families).

The project directory (`retro.project`) fixes what the neighbours were queried for: sequence length, chunk
length, data blend, split, seed and GPT tokenizer come from its config.json (a flag that disagrees is an
error naming it), and the sample counts (--train-samples, --global-batch-size, --eval-interval, --eval-iters)
default to the project's. The datasets are built with the project's sample counts, so sample i is the one whose
chunks have neighbour rows i * l .. i * l + l - 1. Without --retro-add-retriever the same samples train a
plain GPT (Megatron's baseline).

Retro-fitting: `--load <GPT checkpoint> --finetune` starts the Retro model from a GPT checkpoint of the same
decoder (its weights map one to one; the chunked cross-attention and the encoder start freshly initialised);
`--retro-fit-freeze-decoder` then trains only those. TP, SP, DP, the distributed optimizer, mixed precision and
recompute work as for GPT; pipeline parallelism is refused, as Megatron did. This is the one training entry
point that reads a Retro project (`retro.project`, `retro.db`, `retro.query`).

InstructRetro (Megatron's tools/retro/sft): `--sft --finetune --load CKPT` with `--data-path` / `--train-data-path`
JSONL conversations instruction-tunes a Retro (or, without --retro-add-retriever, a GPT) checkpoint on
`SFTDataset` samples, the loss on the assistant's tokens only. Only the tokenizer and chunk length are the
project's (the sequence length defaults to it); each sample's chunks get their neighbours from the project's
index when the sample is read (`retro.retrieval.RetrievingDataset`, the server's retrieval), not from
pretraining's neighbour query. Megatron's sft_retro fed the encoder zeros instead.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
from typing import Any

import torch

from megatron_train.arguments import MegatronConfig, build_parser
from megatron_train.checkpointing import CheckpointError, SavedCheckpoint, check_compatible
from megatron_train.checkpointing.names import global_names
from megatron_train.convert.detect import open_checkpoint
from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.retro_dataset import RetroDataset
from megatron_train.data.sft_dataset import build_sft_datasets
from megatron_train.device import get_device
from megatron_train.families.family import (
    DENSE_DIMENSIONS,
    InferenceHooks,
    Layouts,
    ModelFamily,
    ModelProvider,
)
from megatron_train.families.gpt import DECODER_PIPELINE, GPT, forward_step, gpt_terms
from megatron_train.families.registry import saved_family_name
from megatron_train.models.retro import RetroModel, is_retro_parameter, retro_decoder_layer_numbers
from megatron_train.models.terms import ModelTerms, cross_attention_terms, layer_stack_terms
from megatron_train.parallel import state
from megatron_train.parallel.param_init import materialize
from megatron_train.tokenizer import MegatronTokenizer
from retro.config import QueryConfig
from retro.db import ChunkDatabase
from retro.embedder import load_embedder
from retro.index import load_index
from retro.project import RetroProject, db_dir, embedder_dir, index_path
from retro.query import SPLIT_NAMES, load_neighbours
from retro.retrieval import Retriever, RetrievingDataset, RetrievingModel, add_retrieval_flags

logger = logging.getLogger(__name__)

# Settings the neighbours were queried for: taken from the project; a flag may only repeat them.
FIXED_FLAGS = {
    "seq_length": "--seq-length",
    "retro_chunk_length": "--retro-chunk-length",
    "data_path": "--data-path",
    "split": "--split",
    "seed": "--seed",
    "tokenizer_type": "--tokenizer-type",
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
    "tokenizer_model": "--tokenizer-model",
}
# The project's defaults for the run's length and evaluation (a flag may change them within the queried samples).
DEFAULT_FLAGS = {
    "train_samples": "--train-samples",
    "global_batch_size": "--global-batch-size",
    "eval_interval": "--eval-interval",
    "eval_iters": "--eval-iters",
    "data_cache_path": "--data-cache-path",
}
PATH_SETTINGS = ("vocab_file", "merge_file", "tokenizer_model", "data_cache_path")
# --sft trains on its own JSONL data: only what ties the model to the database stays fixed.
SFT_FIXED_FLAGS = {
    dest: FIXED_FLAGS[dest]
    for dest in ("retro_chunk_length", "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
}
SFT_DEFAULT_FLAGS = {"seq_length": "--seq-length"}


def project_settings(project: RetroProject, project_dir: str) -> dict[str, Any]:
    """The flag values (by dest) a Retro project implies (Megatron's `load_retro_args`)."""
    return {
        "seq_length": project.retro_gpt_seq_length,
        "retro_chunk_length": project.retro_gpt_chunk_length,
        "data_path": project.data_path(project_dir),
        "split": project.retro_gpt_split,
        "seed": project.retro_gpt_seed,
        "tokenizer_type": project.retro_gpt_tokenizer_type,
        "vocab_file": project.path(project_dir, project.retro_gpt_vocab_file),
        "merge_file": project.path(project_dir, project.retro_gpt_merge_file),
        "tokenizer_model": project.path(project_dir, project.retro_gpt_tokenizer_model),
        "train_samples": project.retro_gpt_train_samples,
        "global_batch_size": project.retro_gpt_global_batch_size,
        "eval_interval": project.retro_gpt_eval_interval,
        "eval_iters": project.retro_gpt_eval_iters,
        "data_cache_path": project.retro_gpt_data_cache_path,
    }


def _normalised(dest: str, value: Any) -> Any:
    if value is None:
        return None
    if dest in PATH_SETTINGS:
        return os.path.realpath(value)
    if dest == "data_path":  # weights as numbers, prefixes as real paths
        return [float(v) if v.replace(".", "", 1).isdigit() else os.path.realpath(v) for v in value]
    return value


def with_project_settings(argv: list[str]) -> list[str]:
    """`argv` plus the flags its --retro-project-dir implies; a flag that contradicts the project is an error."""
    given = vars(build_parser().parse_args(argv))
    project_dir = given.get("retro_project_dir")
    if project_dir is None:
        raise ValueError(
            "give --retro-project-dir: the Retro project (config.json, data, neighbours) to train on"
        )
    settings = project_settings(RetroProject.load(project_dir), project_dir)
    sft = given.get("sft", False)
    fixed, defaults = (SFT_FIXED_FLAGS, SFT_DEFAULT_FLAGS) if sft else (FIXED_FLAGS, DEFAULT_FLAGS)
    for dest, flag in fixed.items():
        if dest in given and _normalised(dest, given[dest]) != _normalised(dest, settings[dest]):
            raise ValueError(
                f"{flag} {given[dest]} differs from the Retro project's {settings[dest]} "
                f"({os.path.join(project_dir, 'config.json')}): the neighbours were queried for the project's "
                f"setting; drop {flag}"
            )
    split_paths = any(f"{split}_data_path" in given for split in ("train", "valid", "test"))
    if not sft and ("mock_data" in given or split_paths):
        raise ValueError(
            "pretrain_retro trains on the Retro project's --data-path blend: drop --mock-data and the "
            "per-split --*-data-path flags (or pass --sft to instruction-tune on JSONL conversations)"
        )
    if "train_iters" in given:
        settings.pop("train_samples")
    extra: list[str] = []
    for dest, flag in {**fixed, **defaults}.items():
        value = settings.get(dest)
        if dest not in given and value is not None:
            extra += [flag, *(str(v) for v in value)] if isinstance(value, list) else [flag, str(value)]
    return [*argv, *extra]


def retro_model_options(config: MegatronConfig) -> dict[str, Any]:
    """RetroModel's settings: the run's Retro flags (chunk length, neighbours, encoder, decoder freezing)."""
    return {"retro": config.retro}


def retrofitted(
    gpt_checkpoint: SavedCheckpoint,
    config: MegatronConfig,
    padded_vocab_size: int,
    *stage: Any,
    **options: Any,
) -> RetroModel:
    """Retro-fitting: this stage of the Retro model with the weights of `gpt_checkpoint` loaded into its decoder
    as it is built (`load_gpt_decoder`). Built on the meta device (sharded initialization), it is materialised
    first: weights loaded into meta tensors would be lost, and the GPT's drawn afresh."""
    model = RETRO.model_provider(config, padded_vocab_size, *stage, **options)
    if any(param.is_meta for param in model.parameters()):
        model = materialize(model, get_device())
    load_gpt_decoder(model, config, padded_vocab_size, gpt_checkpoint)
    return model


def load_gpt_decoder(
    model: RetroModel, config: MegatronConfig, padded_vocab_size: int, saved: SavedCheckpoint
) -> None:
    """Retro-fitting: the GPT checkpoint's weights into every parameter of the same name (embedding, decoder
    layers, final norm, output layer), resharded to this rank's TP slice; the Retro parameters keep their init."""
    iteration_dir = saved.iteration_dir
    check_compatible(saved.metadata, config, padded_vocab_size, iteration_dir)
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    weights = {
        local: saved.tensor_for(name, "model", tp_size, tp_rank, padded_vocab_size)
        for local, name in global_names(model, config).items()
        if not is_retro_parameter(local)
    }
    missing = model.load_state_dict(weights, strict=False).missing_keys
    logger.info("retro-fitting from %s: %d GPT tensors loaded, %d Retro tensors initialised", iteration_dir,
                len(weights), len(missing))  # fmt: skip


def gpt_checkpoint_to_retrofit(config: MegatronConfig) -> SavedCheckpoint | None:
    """The GPT checkpoint `--load` holds when it is one (retro-fitting; ours, or a Megatron-LM one converted in
    memory), else None (a Retro run to resume)."""
    ckpt = config.checkpoint
    if not config.retro.retro_add_retriever or ckpt.load is None:
        return None
    saved = open_checkpoint(ckpt.load, ckpt.ckpt_step, GPT.name)
    if saved is None or saved_family_name(saved.metadata) != GPT.name:
        return None
    if not ckpt.finetune:
        raise CheckpointError(
            f"--load {ckpt.load} holds a GPT checkpoint ({saved.iteration_dir}): pass --finetune to retro-fit from "
            "it (Retro weights start fresh, iterations from 0), or --load a Retro checkpoint to resume"
        )
    return saved


def check_queried_samples(
    project: RetroProject, project_dir: str, num_samples: tuple[int, int, int]
) -> tuple[int, int, int]:
    """The project's queried (train, valid, test) sample counts; an error naming the flag to lower when the run
    reads more samples of a split than the project has neighbours for."""
    queried = project.num_samples()
    flags = ("--train-samples/--train-iters", "--eval-interval/--eval-iters", "--eval-iters")
    for split, needed, available, flag in zip(SPLIT_NAMES, num_samples, queried, flags, strict=True):
        if needed > available:
            raise ValueError(
                f"this run reads {needed} {split} samples but the Retro project "
                f"{os.path.join(project_dir, 'config.json')} queried neighbours for {available}: lower {flag} "
                "(or query neighbours for more samples: the Retro flow's --query.train-samples, "
                "--query.eval-interval and --query.eval-iters)"
            )
    return queried


def datasets_provider(
    config: MegatronConfig, tokenizer: MegatronTokenizer, num_samples: tuple[int, int, int]
) -> tuple:
    """The GPT datasets of the project's sample counts, wrapped as RetroDatasets with --retro-add-retriever;
    with --sft the SFT datasets, their neighbours retrieved per sample."""
    if config.data.sft:
        return sft_datasets(config, tokenizer, num_samples)
    project_dir = config.retro.retro_project_dir
    project = RetroProject.load(project_dir)
    queried = check_queried_samples(project, project_dir, num_samples)
    datasets = build_train_valid_test_datasets(
        config.data,
        config.model.seq_length,
        queried,
        config.training.seed,
        tokenizer.eod,
        tokenizer.vocab_size,
    )
    if not config.retro.retro_add_retriever:
        return datasets
    db = ChunkDatabase(db_dir(project_dir))
    retro = config.retro
    return tuple(
        None
        if dataset is None
        else RetroDataset(
            dataset,
            load_neighbours(project.neighbor_dir(project_dir, split)),
            db,
            config.model.seq_length,
            retro.retro_chunk_length,
            retro.retro_num_neighbors,
            retro.retro_num_retrieved_chunks,
            tokenizer.eod,
            retro.retro_verify_neighbor_count,
        )
        for split, dataset in zip(SPLIT_NAMES, datasets, strict=True)
    )


def sft_datasets(
    config: MegatronConfig, tokenizer: MegatronTokenizer, num_samples: tuple[int, int, int]
) -> tuple:
    """`pretrain_gpt --sft`'s datasets; with --retro-add-retriever each sample's chunks retrieve their
    neighbours from the project's index with its embedder (on CPU: the DataLoader's workers run it)."""
    seq_length = config.model.seq_length
    datasets = build_sft_datasets(config.data, tokenizer, seq_length, num_samples, config.training.seed)
    retro = config.retro
    if not retro.retro_add_retriever:
        return datasets
    project_dir = retro.retro_project_dir
    query = QueryConfig()
    retriever = Retriever(
        ChunkDatabase(db_dir(project_dir)),
        load_index(index_path(project_dir), query.retro_query_nprobe, query.retro_query_ef_search),
        load_embedder(embedder_dir(project_dir), device="cpu"),
        tokenizer,
        retro.retro_chunk_length,
        retro.retro_num_neighbors,
        retro.retro_num_retrieved_chunks,
    )
    return tuple(
        None if dataset is None else RetrievingDataset(dataset, retriever, seq_length) for dataset in datasets
    )


def run_model_provider(config: MegatronConfig) -> ModelProvider:
    """The provider of a pretrain_retro run: without --retro-add-retriever the GPT baseline's; retro-fitting from
    the GPT checkpoint `--load` names (whose weights load into the model as it is built, so the run loads nothing
    more); else the Retro family's."""
    if not config.retro.retro_add_retriever:
        return GPT.model_provider
    gpt_checkpoint = gpt_checkpoint_to_retrofit(config)
    if gpt_checkpoint is None:
        return RETRO.model_provider
    config.checkpoint.load = None
    return functools.partial(retrofitted, gpt_checkpoint)


def check_retro_config(config: MegatronConfig) -> None:
    """The Retro model refuses pipeline stages (its baseline, a GPT, does not)."""
    if config.retro.retro_add_retriever and config.parallel.pipeline_model_parallel_size > 1:
        raise ValueError(
            "--pipeline-model-parallel-size > 1: Retro does not support pipeline parallelism (its encoder "
            "runs inside a decoder layer; Megatron refused it too); use TP, SP and DP"
        )


def retro_terms(config: MegatronConfig, padded_vocab_size: int) -> ModelTerms:
    """GPT's terms, plus with --retro-add-retriever the chunked cross-attention of the Retro layers over the
    encoded neighbours and the encoder over the neighbours (conditioned on their chunks)."""
    terms = gpt_terms(config, padded_vocab_size)
    model, retro = config.model, config.retro
    if not retro.retro_add_retriever:
        return terms
    chunk, neighbours, retrieved = (
        retro.retro_chunk_length,
        retro.retro_num_neighbors,
        retro.retro_retrieved_length,
    )
    chunks = math.ceil(model.seq_length / chunk)
    neighbour_tokens = chunks * neighbours * retrieved
    retro_layers = len(retro_decoder_layer_numbers(model.num_layers))
    encoder = retro.retro_encoder_layers
    return (
        terms
        + cross_attention_terms(
            "Retro", model, retro_layers, model.seq_length, neighbour_tokens, neighbours * retrieved
        )
        + layer_stack_terms(
            "Retro encoder", model, encoder, neighbour_tokens, final_norm=False, keys=retrieved
        )
        + cross_attention_terms(
            "Retro encoder", model, 1, neighbour_tokens, neighbours * chunks * chunk, chunk
        )
    )


def retrieving_model(
    model: torch.nn.Module, tokenizer: MegatronTokenizer, args: argparse.Namespace, device: Any
) -> RetrievingModel:
    """The tools' Retro model: the checkpoint's, retrieving from the project --retro-project-dir names (its
    index and embedder) before each forward."""
    project_dir = getattr(args, "retro_project_dir", None)  # Megatron's flags default to "not given"
    if not project_dir:
        raise ValueError(
            f"--load {args.load} holds a retro model; serve or evaluate it with --retro-project-dir DIR (its "
            "retrieval database)"
        )
    embed = load_embedder(embedder_dir(project_dir), device=device)
    retriever = Retriever.from_project(
        project_dir, model, embed, tokenizer, args.retro_query_nprobe, args.retro_query_ef_search
    )
    return RetrievingModel(model, retriever).eval()


RETRO = ModelFamily(
    name="retro",
    model_class=RetroModel,
    model_options=retro_model_options,
    terms=retro_terms,
    layouts=Layouts(
        DENSE_DIMENSIONS - {"context"},
        {
            "context": "Retro's chunked cross-attention needs every chunk of the sequence on one rank (Megatron's "
            "Retro has no context parallelism); use tensor and sequence parallelism"
        },
    ),
    pipeline=DECODER_PIPELINE,
    forward_step=functools.partial(forward_step, inputs=("neighbor_tokens", "document_ids")),
    datasets_provider=datasets_provider,
    per_token_loss=True,
    check_config=check_retro_config,
    prepare_argv=with_project_settings,
    run_model_provider=run_model_provider,
    entry_module="megatron_train.pretrain_retro",
    inference=InferenceHooks(
        add_flags=add_retrieval_flags,
        prepare=retrieving_model,
        one_process="a Retro model is served by one process (retrieval runs on rank 0 only); start the server "
        "without torchrun",
    ),
)
