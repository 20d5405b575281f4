"""The eval flow: corpus -> pretrain -> evaluate, each cached; writes the report (JSON, Markdown, PNG curves).

python -m flows.eval                                       # the whole path on the embedded corpus
python -m flows.eval --wikitext wiki.test.tokens --lambada lambada_test.jsonl -- --train-iters 2000
python -m flows.eval --model hybrid --baseline gpt          # a hybrid Mamba model beside the GPT of the same flags
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
from flows.pretrain import (
    PretrainFlowConfig,
    add_model_flag,
    add_pretrain_flags,
    check_model_flag,
    pretrain_config,
    pretrain_flow,
    split_argv,
)
from flows.publish import publish_report, publish_stages
from flows.server import prefect_api
from flows.tasks import make_task_runner, stage_ref
from stages.evaluate import EvaluateParams


class EvalFlowConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    pretrain: PretrainFlowConfig = PretrainFlowConfig()
    evaluate: EvaluateParams = EvaluateParams()
    baseline: str | None = (
        None  # a model family trained with the same flags and data, reported beside the model
    )


def evaluate_run(
    flow_name: str,
    refs: dict[str, Any],
    params: EvaluateParams,
    corpus: CorpusConfig,
    baseline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The evaluate stage on `refs`' trained run (beside the `baseline` run's pretrain artifact, when given); then
    the flow's summary, artifact links and report in the UI."""
    inputs = [refs["pretrain"], refs["tokenize"], *([baseline] if baseline is not None else [])]
    refs = {**refs, "evaluate": stage_ref("evaluate", dataclasses.asdict(params), inputs, corpus)}
    get_run_logger().info("report: %s/report.md", refs["evaluate"]["url"])
    publish_stages(flow_name, refs, corpus.store)
    publish_report(refs["evaluate"], corpus.store)
    return refs


@flow(name="eval")
def eval_flow(config: EvalFlowConfig = EvalFlowConfig()) -> dict[str, Any]:
    """Everything from raw text to the evaluation report; returns every stage's artifact reference."""
    refs = pretrain_flow(config.pretrain)
    baseline = None
    if config.baseline is not None and config.baseline != config.pretrain.model:
        baseline_refs = pretrain_flow(config.pretrain.model_copy(update={"model": config.baseline}))
        if baseline_refs["tokenize"]["url"] != refs["tokenize"]["url"]:
            raise ValueError(
                f"--baseline {config.baseline} trains on other token data than --model {config.pretrain.model} "
                "(sentence-split or another tokenizer): pick a baseline of the same corpus kind"
            )
        baseline = baseline_refs["pretrain"]
    return evaluate_run("eval", refs, config.evaluate, config.pretrain.corpus, baseline)


def parse(argv: list[str] | None) -> EvalFlowConfig:
    own, megatron = split_argv(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pretrain_flags(parser)
    parser.add_argument("--wikitext", default=None, help="a WikiText-103 wiki.test.tokens file to score")
    parser.add_argument("--lambada", default=None, help="a LAMBADA lambada_test.jsonl file to score")
    add_model_flag(parser)
    parser.add_argument(
        "--baseline",
        default=None,
        help="a model family to train with the same flags and data and report beside --model (e.g. gpt)",
    )
    args = parser.parse_args(own)
    for flag in ("model", "baseline"):
        check_model_flag(parser, flag, getattr(args, flag))
    return EvalFlowConfig(
        pretrain=pretrain_config(args, megatron),
        evaluate=EvaluateParams(wikitext_path=args.wikitext, lambada_path=args.lambada),
        baseline=args.baseline,
    )


def run_eval(config: EvalFlowConfig) -> dict[str, Any]:
    corpus = config.pretrain.corpus
    runner = make_task_runner(corpus.task_runner, corpus.workers, corpus.cluster_address)
    return eval_flow.with_options(task_runner=runner)(config)


@command_line
def main(argv: list[str] | None = None) -> int:
    with prefect_api():
        refs = run_eval(parse(argv))
    print(f"report: {refs['evaluate']['url']}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
