"""The pipeline flow: corpus -> pretrain -> convert -> evaluate, what the `pipeline` deployment in `prefect.yaml`
runs when a corpus refresh announces new token data (`flows.events.TOKENIZED_EVENT`). With a `retro` section
(`{"retro": {}}` for the defaults of `make retro`) the Retro branch runs too, on the same corpus: its database,
index and neighbours, Retro and its GPT baseline, and their report (`flows.retro_flow`).

Every stage is cached, so the corpus part of a triggered run finds the refresh's artifacts when the deployment's
corpus settings are the refresh's. A run given the announced `tokenize_key` checks that before training, and
fails with what to align if the settings differ (it would otherwise train on other data than announced).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.convert import ConvertFlowConfig, convert_flow
from flows.corpus import corpus_flow
from flows.eval import EvalFlowConfig, evaluate_run
from flows.retro_flow import RetroFlowConfig, retro_flow
from stages.convert import ConvertParams


class PipelineConfig(EvalFlowConfig):
    """The eval flow's settings, the format the trained run is converted to (a Hugging Face folder), and the
    Retro branch's settings when it runs (its corpus is `pretrain.corpus`, whatever the section says)."""

    convert: ConvertParams = ConvertParams()
    retro: RetroFlowConfig | None = None


@flow(name="pipeline")
def pipeline_flow(
    config: PipelineConfig = PipelineConfig(), tokenize_key: str | None = None
) -> dict[str, Any]:
    """Raw text to a converted, evaluated model; `tokenize_key`: the token data a refresh announced, when it
    triggered."""
    if tokenize_key is not None:
        tokenize = corpus_flow(config.pretrain.corpus)["tokenize"]
        if tokenize["key"] != tokenize_key:
            raise ValueError(
                f"the refresh announced tokenize artifact {tokenize_key}, but this pipeline's corpus settings give "
                f"{tokenize['key']} ({tokenize['url']}): give the pipeline deployment's config.pretrain.corpus "
                "the corpus-refresh deployment's settings in prefect.yaml"
            )
    refs = convert_flow(ConvertFlowConfig(pretrain=config.pretrain, convert=config.convert))
    refs = evaluate_run("pipeline", refs, config.evaluate, config.pretrain.corpus)
    if config.retro is not None:
        retro = config.retro.model_copy(update={"corpus": config.pretrain.corpus})
        refs = {**retro_flow(retro), **refs}
    return refs
