"""The eval flow: corpus -> pretrain -> evaluate, each cached; writes the report (JSON, Markdown, PNG curves).

python -m flows.eval                                       # the whole path on the embedded corpus
python -m flows.eval --wikitext wiki.test.tokens --lambada lambada_test.jsonl -- --train-iters 2000
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
from flows.publish import publish_report, publish_stages
from flows.server import prefect_api
from flows.tasks import make_task_runner, stage_ref
from stages.evaluate import EvaluateParams


class EvalFlowConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    pretrain: PretrainFlowConfig = PretrainFlowConfig()
    evaluate: EvaluateParams = EvaluateParams()


def evaluate_run(
    flow_name: str, refs: dict[str, Any], params: EvaluateParams, corpus: CorpusConfig
) -> dict[str, Any]:
    """The evaluate stage on `refs`' trained run; then the flow's summary, artifact links and report in the UI."""
    inputs = [refs["pretrain"], refs["tokenize"]]
    refs = {**refs, "evaluate": stage_ref("evaluate", dataclasses.asdict(params), inputs, corpus)}
    get_run_logger().info("report: %s/report.md", refs["evaluate"]["url"])
    publish_stages(flow_name, refs, corpus.store)
    publish_report(refs["evaluate"], corpus.store)
    return refs


@flow(name="eval")
def eval_flow(config: EvalFlowConfig = EvalFlowConfig()) -> dict[str, Any]:
    """Everything from raw text to the evaluation report; returns every stage's artifact reference."""
    return evaluate_run("eval", pretrain_flow(config.pretrain), config.evaluate, config.pretrain.corpus)


def parse(argv: list[str] | None) -> EvalFlowConfig:
    own, megatron = split_argv(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pretrain_flags(parser)
    parser.add_argument("--wikitext", default=None, help="a WikiText-103 wiki.test.tokens file to score")
    parser.add_argument("--lambada", default=None, help="a LAMBADA lambada_test.jsonl file to score")
    args = parser.parse_args(own)
    return EvalFlowConfig(
        pretrain=pretrain_config(args, megatron),
        evaluate=EvaluateParams(wikitext_path=args.wikitext, lambada_path=args.lambada),
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
