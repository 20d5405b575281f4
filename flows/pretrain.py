"""The pretrain flow: the corpus flow's token data, then `torchrun -m megatron_train.pretrain_gpt` as a stage.

    python -m flows.pretrain                                   # a small GPT on the embedded corpus, 2 processes
    python -m flows.pretrain --nproc-per-node 1 -- --num-layers 8 --hidden-size 512 --train-iters 2000
    python -m flows.pretrain --model bert                      # BERT: sentence-split data, a trained WordPiece
    python -m flows.pretrain --nproc-per-node 8 --nnodes 4 --launcher slurm --store /shared/artifacts

`--model hybrid` trains a Mamba-Transformer hybrid (its family's flags: the pattern M*M-, no position embeddings)
with the same flags and data as the GPT. `--model bert|t5` (a model family whose corpus is sentence-split) tokenizes the corpus with `--split-sentences`
and a WordPiece vocabulary the flow trains (unless the corpus config names a vocabulary), and launches the
family's entry point (`pretrain_bert` / `pretrain_t5`); `--model pkg.module:ATTR` trains a family defined outside
the project.

Flags after `--` are Megatron's and override the small defaults below (later flags win). The stage is cached
like every other: rerun with nothing changed returns the trained run at once; a retry after a crash resumes from
the run's latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict, field_validator

from flows.corpus import CorpusConfig, corpus_flow
from flows.corpus_plan import rebuild_stages
from flows.failures import command_line
from flows.publish import publish_stages
from flows.server import prefect_api
from flows.tasks import make_task_runner, stage_ref
from stages.launch import LaunchParams
from stages.pretrain import corpus_families, params_from_argv, pretrain_family
from stages.tokenize import TokenizeParams
from stages.train_tokenizer import TrainTokenizerParams

NPROC_PER_NODE_ENV = "NPROC_PER_NODE"
DEFAULT_NPROC_PER_NODE = 2

# A GPT small enough to train in a few minutes on 2 CPU cores, large enough for the validation loss to fall.
SMALL_GPT_ARGS: tuple[str, ...] = (
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "8", "--global-batch-size", "16",
    "--train-iters", "400", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--clip-grad", "1.0", "--split", "949,50,1",
    "--eval-interval", "50", "--eval-iters", "5", "--log-interval", "10", "--seed", "1234",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
)  # fmt: skip


class PretrainFlowConfig(BaseModel):
    """The corpus to train on, the model family, Megatron's flags for the run, and how many processes run it."""

    model_config = ConfigDict(frozen=True)

    corpus: CorpusConfig = CorpusConfig()
    model: str = "gpt"  # the model family (stages.pretrain.pretrain_family)
    megatron_args: tuple[str, ...] = SMALL_GPT_ARGS
    nproc_per_node: int | None = None  # None: the worker's $NPROC_PER_NODE (a work-pool job variable), else 2
    save_interval: int = 50
    launch: LaunchParams = LaunchParams()  # one node, or several with a c10d rendezvous, or a Slurm job

    @field_validator("model")
    @classmethod
    def _pretrains_on_a_corpus(cls, model: str) -> str:
        pretrain_family(model)
        return model

    def processes_per_node(self) -> int:
        """How many training processes `torchrun` starts on this machine."""
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        return int(os.environ.get(NPROC_PER_NODE_ENV, DEFAULT_NPROC_PER_NODE))


def corpus_for_model(corpus: CorpusConfig, model: str) -> CorpusConfig:
    """The corpus the family `model` reads: whole documents (GPT), or, for a family of sentence-split data (BERT,
    T5), documents split into sentences, tokenized with WordPiece (trained by the corpus flow when no vocabulary
    is given), without end-of-document tokens, as Megatron's preprocess_data for them."""
    if pretrain_family(model).corpus == "document":
        return corpus
    tokenize: TokenizeParams = corpus.tokenize
    if not tokenize.tokenizer_type.startswith("BertWordPiece"):
        tokenize = dataclasses.replace(tokenize, tokenizer_type="BertWordPieceLowerCase", vocab_file=None)
    tokenize = dataclasses.replace(tokenize, split_sentences=True, append_eod=False, merge_file=None)
    train_tokenizer = corpus.train_tokenizer
    if train_tokenizer.kind != "wordpiece":  # the same vocabulary size as the corpus's BPE
        train_tokenizer = TrainTokenizerParams(kind="wordpiece", vocab_size=train_tokenizer.vocab_size)
    return corpus.model_copy(update={"tokenize": tokenize, "train_tokenizer": train_tokenizer})


@flow(name="pretrain")
def pretrain_flow(config: PretrainFlowConfig = PretrainFlowConfig()) -> dict[str, Any]:
    """Corpus (cached) -> pretrain; returns every stage's artifact reference."""
    refs = corpus_flow(corpus_for_model(config.corpus, config.model))
    params = params_from_argv(
        (*pretrain_family(config.model).flow_flags, *config.megatron_args),
        config.processes_per_node(),
        config.save_interval,
        config.model,
        config.launch,
    )
    inputs = [refs["tokenize"], *([refs["train_tokenizer"]] if "train_tokenizer" in refs else [])]
    refs["pretrain"] = stage_ref("pretrain", dataclasses.asdict(params), inputs, config.corpus)
    get_run_logger().info("trained run: %s", refs["pretrain"]["url"])
    publish_stages("pretrain", refs, config.corpus.store)
    return refs


def split_argv(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(the flow's own flags, Megatron's flags after `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def add_pretrain_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=CorpusConfig().store, help="artifact store URL")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help=f"training processes (default: ${NPROC_PER_NODE_ENV}, else {DEFAULT_NPROC_PER_NODE})",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the training job")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (0 hosts the rendezvous)")
    parser.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous on node 0")
    parser.add_argument(
        "--launcher", choices=("torchrun", "slurm"), default="torchrun", help="slurm: submit an sbatch job"
    )
    parser.add_argument(
        "--rebuild",
        type=_rebuild_flag,
        default=(),
        metavar="STAGE[,STAGE]",
        help="build these stages again although committed, and every stage after them",
    )
    parser.add_argument(
        "--reuse-across-code-changes",
        action="store_true",
        help="take the artifacts built by earlier code for the same settings instead of rebuilding",
    )
    parser.epilog = (
        "Megatron flags after `--` override the small GPT defaults (flows/pretrain.py: SMALL_GPT_ARGS)."
    )


def _rebuild_flag(value: str) -> tuple[str, ...]:
    try:
        return rebuild_stages(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def pretrain_config(args: argparse.Namespace, megatron: list[str]) -> PretrainFlowConfig:
    return PretrainFlowConfig(
        corpus=CorpusConfig(
            store=args.store, rebuild=args.rebuild, reuse_across_code_changes=args.reuse_across_code_changes
        ),
        model=getattr(args, "model", "gpt"),
        megatron_args=(*SMALL_GPT_ARGS, *megatron),
        nproc_per_node=args.nproc_per_node,
        launch=LaunchParams(
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            launcher=args.launcher,
        ),
    )


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="gpt",
        help=f"model family to pretrain: {', '.join(corpus_families())}, or pkg.module:ATTR (default: gpt)",
    )


def check_model_flag(parser: argparse.ArgumentParser, flag: str, model: str | None) -> None:
    """Exit with a usage error naming `--<flag>` when `model` is not a family that pretrains on a corpus."""
    try:
        if model is not None:
            pretrain_family(model)
    except ValueError as error:
        parser.error(f"--{flag}: {error}")


def parse(argv: list[str] | None) -> PretrainFlowConfig:
    own, megatron = split_argv(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pretrain_flags(parser)
    add_model_flag(parser)
    args = parser.parse_args(own)
    check_model_flag(parser, "model", args.model)
    return pretrain_config(args, megatron)


@command_line
def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    runner = make_task_runner(config.corpus.task_runner, config.corpus.workers, config.corpus.cluster_address)
    with prefect_api():
        refs = pretrain_flow.with_options(task_runner=runner)(config)
    print(f"trained run: {refs['pretrain']['url']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
