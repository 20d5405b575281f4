"""Convert a checkpoint between formats and reshard it offline, as Megatron's tools/checkpoint/convert.py:

    python -m megatron_train.tools.checkpoint_util --model-type GPT --load-dir A --save-dir B \\
        [--loader flow|hf|megatron|torch_dist --saver flow|hf|megatron|torch_dist] --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

Another format goes through a loader and a saver (`megatron_train.convert`): weights only, the model config read
from the source, and the flags to train or serve the result printed at the end. Flow to flow (the default) is
the resharding below, optimizer state included.

One process, no process groups. The output is written one pipeline stage at a time: each tensor's source TP
shards are merged, its padded vocabulary re-padded for the new TP size, and the result split for the target
TP ranks, so memory peaks at about one stage. The output is a complete checkpoint (weights, optimizer state
when the source has it, progress, scheduler, args with the new sizes) whose latest marker is written last.
RNG states are per rank and do not carry across layouts: load the result with --no-load-rng.

The format does not depend on virtual pipeline stages (--num-layers-per-virtual-pipeline-stage): tensors are
found by their global names whichever stage's file holds them, so a run with or without virtual stages loads
any checkpoint. --target-num-layers-per-virtual-pipeline-stage only places each target rank's chunks (its
interleaved layers) in its own files, as an interleaved run writes them, and records the setting in the args.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from megatron_train import convert
from megatron_train.arguments import MegatronConfig, config_to_argv, config_to_dict
from megatron_train.checkpointing import (
    FORMAT_VERSION,
    CheckpointError,
    SavedCheckpoint,
    checkpoint_dir,
    model_shard_dir,
    require_iteration_dir,
    saved_true_vocab_range,
    sharding_record,
    write_metadata_and_marker,
    write_shard,
)
from megatron_train.checkpointing.layout import (
    ExpertLayout,
    TensorSharding,
    check_layout,
    sharding_of,
    split_expert_tensor,
    split_tp_shard,
    stage_tensor_names,
)
from megatron_train.convert import flow, hf, megatron, torch_dist
from megatron_train.convert.target import check_target, output_folder
from megatron_train.convert.tokenizer_files import copy_tokenizer, tokenizer_sources
from megatron_train.convert.weights import trim_vocab
from megatron_train.families.family import PipelineSplit
from megatron_train.families.registry import BUILTIN_FAMILIES, checkpoint_family, get_family
from megatron_train.legacy_flags import GIVEN, Renamed, add_legacy_flags
from megatron_train.tokenizer import vocab_size_with_padding

logger = logging.getLogger("megatron_train.tools.checkpoint_util")
# Formats written split for a target (TP, PP); hf writes one unsplit model.
SHARDED_SAVERS = {"flow": flow, "megatron": megatron, "torch_dist": torch_dist}
# Megatron-LM's --ckpt-format of our savers of its formats (its choices: torch, torch_dist, torch_dcp, fsdp_dtensor).
MEGATRON_CKPT_FORMATS = {"megatron": "torch", "torch_dist": "torch_dist"}


def target_padded_vocab_size(
    saved: SavedCheckpoint, divisible_by: int, target_tp: int, true_vocab_size: int | None
) -> int:
    """Megatron's padding of --true-vocab-size for the target TP; without it, the saved padded size padded
    further if the target TP needs it (never cuts a row: every saved row may hold a real token)."""
    if true_vocab_size is None:
        return vocab_size_with_padding(saved.padded_vocab_size, divisible_by, target_tp)
    if true_vocab_size > saved.padded_vocab_size:
        raise ValueError(
            f"--true-vocab-size {true_vocab_size} exceeds the checkpoint's padded vocabulary "
            f"({saved.padded_vocab_size}); pass the size of the tokenizer it was trained with"
        )
    return vocab_size_with_padding(true_vocab_size, divisible_by, target_tp)


def convert_checkpoint(
    load_dir: str,
    save_dir: str,
    target_tp: int | None = None,
    target_pp: int | None = None,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    target_layers_per_virtual_stage: int | None = None,
    overwrite: bool = False,
    model_family: str | None = None,
    target_ep: int | None = None,
    target_etp: int | None = None,
) -> str:
    """Write `load_dir`'s checkpoint (latest, or `iteration`) to `save_dir` under (target_tp, target_pp),
    each defaulting to the saved size, with files laid out for virtual stages of
    `target_layers_per_virtual_stage` layers (None: a plain pipeline), cut as the checkpoint's family cuts its
    model (a family from outside the project needs `model_family`, --model-family); MoE experts in the files of
    (target_ep, target_etp) ranks (default: the saved EP, the target TP). Returns the written iteration folder.
    `save_dir` is built whole beside its final name (`convert.target`): a folder holding anything is refused
    unless `overwrite`, which replaces it.

    Raises ValueError for a layout the model cannot be cut into, CheckpointError for a broken checkpoint.
    """
    check_target(save_dir, overwrite, load_dir)
    iteration_dir = require_iteration_dir(load_dir, iteration)
    saved = SavedCheckpoint(iteration_dir)
    target_tp, target_pp = target_tp or saved.tp_size, target_pp or saved.pp_size
    metadata = saved.metadata
    family = checkpoint_family(metadata, model_family, iteration_dir)
    config = flow.checked_saved_config(saved, iteration_dir, family)
    padded_vocab_size = target_padded_vocab_size(
        saved, config.tokenizer.make_vocab_size_divisible_by, target_tp, true_vocab_size
    )
    check_layout(
        config.model,
        family.pipeline,
        padded_vocab_size,
        target_tp,
        target_pp,
        target_layers_per_virtual_stage,
    )
    config.parallel.tensor_model_parallel_size = target_tp
    config.parallel.pipeline_model_parallel_size = target_pp
    config.parallel.num_layers_per_virtual_pipeline_stage = target_layers_per_virtual_stage
    target_ep, target_etp = target_ep or saved.ep_size, target_etp or target_tp
    config.parallel.expert_model_parallel_size = target_ep
    config.parallel.expert_tensor_parallel_size = target_etp
    layouts = [ExpertLayout(target_ep, e, target_etp, t) for e in range(target_ep) for t in range(target_etp)]
    virtual_size = config.parallel.virtual_pipeline_model_parallel_size(config.model.num_layers)
    with_optimizer = saved.has_optimizer_state()
    start = time.perf_counter()
    tokenizer_files = tokenizer_sources(config.tokenizer, load_dir)
    with output_folder(save_dir, overwrite) as build:
        config.tokenizer = copy_tokenizer(config.tokenizer, tokenizer_files, build, save_dir)
        files = _reshard(
            saved,
            config,
            family.pipeline,
            build,
            target_tp,
            target_pp,
            padded_vocab_size,
            virtual_size,
            layouts,
        )
        _write_resharded_metadata(saved, config, build, files, target_tp, target_pp, padded_vocab_size,
                                  true_vocab_size, virtual_size)  # fmt: skip
    out_dir = checkpoint_dir(save_dir, metadata["iteration"])
    seconds, written_bytes = time.perf_counter() - start, sum(record["size"] for record in files.values())
    logger.info(
        "resharded %s from (TP, PP) = (%d, %d) to (%d, %d) into %s: %.1f MB in %.1f s (%.1f MB/s)%s",
        iteration_dir, saved.tp_size, saved.pp_size, target_tp, target_pp, out_dir, written_bytes / 1e6,
        seconds, written_bytes / 1e6 / max(seconds, 1e-9), "" if with_optimizer else "; no optimizer state",
    )  # fmt: skip
    return out_dir


def _reshard(
    saved: SavedCheckpoint,
    config: MegatronConfig,
    split: PipelineSplit,
    root: str,
    target_tp: int,
    target_pp: int,
    padded_vocab_size: int,
    virtual_size: int | None,
    layouts: list[ExpertLayout],
) -> dict:
    """Every target rank's shard files in the folder `root`, one pipeline stage at a time (the model cut by its
    family's `split`; MoE experts into the folders of the (expert TP, EP) ranks `layouts`); their records."""
    with_optimizer, files = saved.has_optimizer_state(), {}
    out_dir = checkpoint_dir(root, saved.metadata["iteration"])
    stages = tqdm(range(target_pp), desc="pipeline stages", unit="stage", disable=None)
    for pp_rank in stages:
        layers = split.stage_layers(config.model, pp_rank, target_pp, virtual_size)
        names = stage_tensor_names(split, list(saved.params), layers, pp_rank == 0, pp_rank == target_pp - 1)
        experts = [name for name in names if saved.is_expert(name)]
        dense = [name for name in names if name not in experts]

        def dense_cut(tensor: torch.Tensor, sharding: TensorSharding, name: str) -> list[torch.Tensor]:
            return [
                split_tp_shard(tensor, sharding, target_tp, tp_rank, name) for tp_rank in range(target_tp)
            ]

        def expert_cut(tensor: torch.Tensor, sharding: TensorSharding, name: str) -> list[torch.Tensor]:
            return [split_expert_tensor(tensor, sharding, layout, name) for layout in layouts]

        # each dense (TP, PP) rank's folder, then (a stage with MoE layers) each (expert TP, EP) rank's
        targets = [(dense, dense_cut, [(tp_rank, None) for tp_rank in range(target_tp)])]
        if experts:
            targets.append((experts, expert_cut, layouts))
        for part, cut, ranks in targets:
            params = {name: name for name in part}  # the files keep checkpoint names
            weights = _split(saved, params, "model", padded_vocab_size, cut, len(ranks))
            optimizer_tensors = optimizer_meta = None
            if with_optimizer:
                optimizer_names = saved.optimizer_tensor_names(params)
                optimizer_tensors = _split(
                    saved, optimizer_names, "optimizer", padded_vocab_size, cut, len(ranks)
                )
                optimizer_meta = saved.optimizer_meta_for(params)
            for index, rank in enumerate(ranks):
                layout = rank if isinstance(rank, ExpertLayout) else None
                tp_rank, tp_size = (layout.etp_rank, layout.etp_size) if layout else (rank[0], target_tp)
                sharding = {
                    name: _target_record(saved.params[name], weights[index][name].shape, tp_rank, tp_size,
                                         pp_rank, target_pp, name, layout)
                    for name in part
                }  # fmt: skip
                optimizer_state = (
                    None if optimizer_tensors is None else (optimizer_tensors[index], optimizer_meta)
                )
                shard_dir = model_shard_dir(out_dir, tp_rank, pp_rank, target_pp, layout and layout.ep_rank)
                files.update(write_shard(shard_dir, weights[index], sharding, optimizer_state))
    return files


def _write_resharded_metadata(
    saved: SavedCheckpoint,
    config: MegatronConfig,
    root: str,
    files: dict,
    target_tp: int,
    target_pp: int,
    padded_vocab_size: int,
    true_vocab_size: int | None,
    virtual_size: int | None,
) -> None:
    """metadata.json for the new layout, then the latest marker, in the folder `root`."""
    metadata, iteration_dir = saved.metadata, saved.iteration_dir
    data_parallel_size = metadata["data_parallel_size"]
    write_metadata_and_marker(
        root,
        metadata["iteration"],
        {
            **metadata,
            "format_version": FORMAT_VERSION,
            "padded_vocab_size": padded_vocab_size,
            # without --true-vocab-size the tokenizer's size is still only known to lie in the saved range
            "true_vocab_size_range": (
                saved_true_vocab_range(metadata)
                if true_vocab_size is None
                else (true_vocab_size - 1, true_vocab_size)
            ),
            "world_size": target_tp * target_pp * data_parallel_size,
            "tensor_model_parallel_size": target_tp,
            "pipeline_model_parallel_size": target_pp,
            "virtual_pipeline_model_parallel_size": virtual_size,
            "expert_model_parallel_size": config.parallel.expert_model_parallel_size,
            "expert_tensor_parallel_size": config.parallel.expert_tensor_parallel_size,
            "args": config_to_dict(config),
            "converted_from": {
                "iteration_dir": os.path.abspath(iteration_dir),
                "tensor_model_parallel_size": saved.tp_size,
                "pipeline_model_parallel_size": saved.pp_size,
                "virtual_pipeline_model_parallel_size": metadata.get("virtual_pipeline_model_parallel_size"),
                "padded_vocab_size": saved.padded_vocab_size,
            },
        },
        files,
    )


def _split(
    saved: SavedCheckpoint,
    names: dict[str, str],
    kind: str,
    padded_vocab_size: int,
    cut: Callable[[torch.Tensor, TensorSharding, str], list[torch.Tensor]],
    num_ranks: int,
) -> list[dict[str, torch.Tensor]]:
    """Per target rank, {key: its part of saved tensor names[key]} (`cut`: every rank's part of a whole tensor):
    each tensor is merged once."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_ranks)]
    for key, name in names.items():
        tensor, sharding = saved.global_tensor(name, kind, padded_vocab_size), saved.sharding(name, kind)
        for shard, part in zip(shards, cut(tensor, sharding, name), strict=True):
            shard[key] = part
    return shards


def _target_record(
    source: dict,
    local_shape: tuple[int, ...],
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    name: str,
    experts: ExpertLayout | None = None,
) -> dict:
    sharding = sharding_of(source)
    global_shape = list(local_shape)
    if sharding.is_split:
        global_shape[sharding.partition_dim] *= tp_size
    if experts is not None:
        global_shape[0] *= experts.ep_size
    return sharding_record(
        global_shape, sharding, source["sequence_parallel"], tp_rank, tp_size, pp_rank, pp_size, name, experts
    )


def load_weights(
    loader: str,
    load_dir: str,
    iteration: int | None,
    true_vocab_size: int | None,
    model_type: str = "GPT",
    model_family: str | None = None,
) -> convert.ModelWeights:
    """The model `loader` reads from `load_dir`, its vocabulary cut to `true_vocab_size` when given. Megatron's
    formats are read as the family `model_family` (--model-family) or else `model_type` (Megatron's
    --model-type GPT or BERT) says; ours and Hugging Face's record their family, which must be that one."""
    family = get_family(model_family or model_type.lower())
    if loader in ("megatron", "torch_dist"):
        return SHARDED_SAVERS[loader].load(load_dir, iteration, true_vocab_size, family)
    weights = (
        flow.load(load_dir, iteration, true_vocab_size, model_family)
        if loader == "flow"
        else hf.load(load_dir, model_family)
    )
    if weights.family.name != family.name:
        flag = "--model-family" if model_family else "--model-type"
        raise ValueError(
            f"{flag} {model_family or model_type}, but {load_dir} holds a {weights.family.name.upper()} model: "
            f"pass --model-type {weights.family.name.upper()} (or --model-family {weights.family.name})"
        )
    if loader == "hf" and true_vocab_size is not None:
        if true_vocab_size > weights.true_vocab_size:
            raise ValueError(
                f"--true-vocab-size {true_vocab_size} exceeds the {weights.true_vocab_size} vocabulary rows of "
                f"{load_dir}: pass the size of its tokenizer"
            )
        weights.config.model.true_vocab_size = true_vocab_size
        weights.tensors = trim_vocab(weights.tensors, true_vocab_size)
    return weights


def convert_format(
    loader: str,
    saver: str,
    load_dir: str,
    save_dir: str,
    target_tp: int | None = None,
    target_pp: int | None = None,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    max_shard_size: int = 5 * 10**9,
    model_type: str = "GPT",
    overwrite: bool = False,
    model_family: str | None = None,
) -> convert.ModelWeights:
    """Read `load_dir` with `loader`, write it to `save_dir` with `saver` (the flow saver under the target
    (TP, PP), default 1 x 1); returns what was written (its config records the layout). A `save_dir` that
    holds anything is refused before the source is read, unless `overwrite` (`convert.target`)."""
    check_target(save_dir, overwrite, load_dir)
    if saver == "hf" and (target_tp or 1, target_pp or 1) != (1, 1):
        raise ValueError(
            "--saver hf writes one unsplit model: leave out --target-tensor/pipeline-parallel-size"
        )
    weights = load_weights(loader, load_dir, iteration, true_vocab_size, model_type, model_family)
    start = time.perf_counter()
    if saver in SHARDED_SAVERS:
        SHARDED_SAVERS[saver].save(weights, save_dir, target_tp or 1, target_pp or 1, overwrite)
    else:
        hf.save(weights, save_dir, max_shard_size, overwrite)
    logger.info("converted %s (%s) to %s (%s) in %.1f s", load_dir, loader, save_dir, saver,
                time.perf_counter() - start)  # fmt: skip
    return weights


def usage_lines(saver: str, save_dir: str, weights: convert.ModelWeights) -> list[str]:
    """How to train or serve what was written, by its family."""
    family = weights.family
    if saver == "hf":
        line = f"load it with transformers: {family.hf.auto_class}.from_pretrained({save_dir!r})"
        return [
            line + (f"; serve it with vLLM: vllm serve {save_dir}" if family.inference is not None else "")
        ]
    if saver in MEGATRON_CKPT_FORMATS:
        return [
            f"load it in Megatron-LM: --load {save_dir} --ckpt-format {MEGATRON_CKPT_FORMATS[saver]} --use-checkpoint-args "
            "--transformer-impl local --finetune (or --no-load-optim --no-load-rng)"
        ]
    flags = " ".join(config_to_argv(weights.config))
    lines = [
        f"finetune: torchrun -m {family.entry_module} {flags} --load {save_dir} --finetune {family.finetune_data}"
    ]
    if family.inference is not None:
        lines.append(f"serve: python -m megatron_train.tools.run_text_generation_server --load {save_dir}")
    return lines


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a size, a count, a parallel size)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert a checkpoint between formats (flow, hf, megatron, torch_dist) and reshard it to another tensor/pipeline "
        "parallel layout",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--model-type",
        default="GPT",
        choices=[name.upper() for name in BUILTIN_FAMILIES],
        help="Model family (Megatron's flag: GPT, BERT; HYBRID for Mamba and hybrid models): how to read --loader "
        "megatron/torch_dist; checked against what flow and hf sources record.",
    )
    parser.add_argument(
        "--model-family",
        default=None,
        help="Instead of --model-type: a model family of this project or `pkg.module:ATTR` naming one defined "
        "elsewhere (a checkpoint of such a family is converted only when this names it).",
    )
    parser.add_argument(
        "--loader", default="flow", choices=convert.FORMATS, help="Format of --load-dir (default: ours)."
    )
    parser.add_argument(
        "--saver",
        default="flow",
        choices=convert.FORMATS,
        help="Format to write --save-dir in (default: ours).",
    )
    parser.add_argument(
        "--load-dir", required=True, help="Checkpoint to read (a training run's --save, an HF folder)."
    )
    parser.add_argument("--save-dir", required=True, help="Directory to write the converted checkpoint to.")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace --save-dir whole when it already holds files (another run's checkpoints, another model); "
        "without it such a folder is refused.",
    )
    parser.add_argument(
        "--max-shard-size",
        type=positive_int,
        default=5 * 10**9,
        help="--saver hf: bytes per safetensors shard (more shards get model.safetensors.index.json).",
    )
    parser.add_argument(
        "--iteration", type=non_negative_int, default=None, help="Iteration to convert; default: the latest."
    )
    parser.add_argument(
        "--target-tensor-parallel-size",
        type=positive_int,
        default=None,
        help="Default: the checkpoint's TP size.",
    )
    parser.add_argument(
        "--target-pipeline-parallel-size",
        type=positive_int,
        default=None,
        help="Default: the checkpoint's PP size.",
    )
    parser.add_argument(
        "--target-expert-model-parallel-size",
        type=positive_int,
        default=None,
        help="Flow to flow: the MoE experts' files for this EP size; default the checkpoint's (any EP loads it).",
    )
    parser.add_argument(
        "--target-expert-tensor-parallel-size",
        type=positive_int,
        default=None,
        help="Flow to flow: the experts' tensor parallel size; default --target-tensor-parallel-size.",
    )
    parser.add_argument(
        "--target-num-layers-per-virtual-pipeline-stage",
        type=positive_int,
        default=None,
        help="Lay each target rank's files out for virtual pipeline stages of this many layers; default: a plain "
        "pipeline. Any run loads either layout: the checkpoint format does not depend on virtual stages.",
    )
    parser.add_argument(
        "--true-vocab-size",
        type=positive_int,
        default=None,
        help="Tokenizer vocabulary before padding: re-pad it exactly for the target TP size (Megatron's flag).",
    )
    misspelt = Renamed(  # Megatron's README printed it so from 2021 to 2023 (its own tool refused it)
        "--target-pipeline-paralle-size",
        "--target-pipeline-parallel-size {}",
        {"target_pipeline_parallel_size": GIVEN},
        type=int,
        why="a misspelling in Megatron's README",
    )
    add_legacy_flags(parser, (misspelt,))
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.loader, args.saver) != ("flow", "flow"):
        if args.target_num_layers_per_virtual_pipeline_stage is not None:
            parser.error(
                "--target-num-layers-per-virtual-pipeline-stage lays out flow -> flow resharding only"
            )
        try:
            weights = convert_format(
                args.loader,
                args.saver,
                args.load_dir,
                args.save_dir,
                args.target_tensor_parallel_size,
                args.target_pipeline_parallel_size,
                args.iteration,
                args.true_vocab_size,
                args.max_shard_size,
                args.model_type,
                args.overwrite,
                args.model_family,
            )
        except (ValueError, CheckpointError) as error:
            parser.error(str(error))
        print(
            "\n".join([f"wrote {args.save_dir}", *usage_lines(args.saver, args.save_dir, weights)]),
            flush=True,
        )
        return
    try:
        out_dir = convert_checkpoint(
            args.load_dir,
            args.save_dir,
            args.target_tensor_parallel_size,
            args.target_pipeline_parallel_size,
            args.iteration,
            args.true_vocab_size,
            args.target_num_layers_per_virtual_pipeline_stage,
            args.overwrite,
            args.model_family,
            args.target_expert_model_parallel_size,
            args.target_expert_tensor_parallel_size,
        )
    except (ValueError, CheckpointError) as error:
        parser.error(str(error))
    print(f"wrote {out_dir}; load it with --no-load-rng (RNG states do not carry across layouts)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
