"""The convert flow: the pretrain flow's trained run (cached), then the convert stage: a Hugging Face folder.

    python -m flows.convert                                    # the small GPT of `make pretrain`, as HF
    python -m flows.convert --saver megatron -- --num-layers 8  # Megatron flags after `--`, as flows.pretrain

The `convert` deployment in `prefect.yaml` runs it; the pipeline flow runs the same stage between pretraining
and evaluation, so checkpoint conversion is a node of the DAG (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.corpus_plan import CorpusConfig
from flows.failures import command_line
from flows.pretrain import PretrainFlowConfig, add_pretrain_flags, pretrain_config, pretrain_flow, split_argv
from flows.publish import publish_stages
from flows.server import prefect_api
from flows.tasks import make_task_runner, stage_ref
from stages.convert import SAVERS, ConvertParams


class ConvertFlowConfig(BaseModel):
    """The run to train (or find cached) and the format to convert it to."""

    model_config = ConfigDict(frozen=True)

    pretrain: PretrainFlowConfig = PretrainFlowConfig()
    convert: ConvertParams = ConvertParams()


def convert_run(refs: dict[str, Any], params: ConvertParams, corpus: CorpusConfig) -> dict[str, Any]:
    """`refs` with the convert stage's artifact of their trained run (`refs["pretrain"]`) added."""
    converted = stage_ref("convert", dataclasses.asdict(params), [refs["pretrain"]], corpus)
    get_run_logger().info("%s model: %s", params.saver, converted["url"])
    return {**refs, "convert": converted}


@flow(name="convert")
def convert_flow(config: ConvertFlowConfig = ConvertFlowConfig()) -> dict[str, Any]:
    """Corpus and pretrain (cached) -> convert; returns every stage's artifact reference."""
    refs = convert_run(pretrain_flow(config.pretrain), config.convert, config.pretrain.corpus)
    publish_stages("convert", refs, config.pretrain.corpus.store)
    return refs


def parse(argv: list[str] | None) -> ConvertFlowConfig:
    own, megatron = split_argv(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pretrain_flags(parser)
    parser.add_argument("--saver", default=ConvertParams().saver, choices=SAVERS, help="format to write")
    args = parser.parse_args(own)
    return ConvertFlowConfig(
        pretrain=pretrain_config(args, megatron), convert=ConvertParams(saver=args.saver)
    )


@command_line
def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    corpus = config.pretrain.corpus
    runner = make_task_runner(corpus.task_runner, corpus.workers, corpus.cluster_address)
    with prefect_api():
        refs = convert_flow.with_options(task_runner=runner)(config)
    print(f"{config.convert.saver} model: {refs['convert']['url']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
