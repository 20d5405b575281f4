"""The record of one model family (torchtitan's `TrainSpec`): everything the engine, the tools and the stages
need to know of GPT, BERT, T5, Retro or a family defined outside the project, in one place.

Nothing outside a family's own modules decides anything by the family's name: the entry points, the checkpoint
loaders, the converter, the pretrain stage and flow look the record up (`families.registry`) and use its fields.
A field a family leaves None is a capability it lacks, refused by whoever needs it with a line naming the family.
See docs/architecture.md (model families).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from megatron_train.arguments import MegatronConfig
from megatron_train.models.config import TransformerConfig
from megatron_train.models.terms import ModelTerms
from megatron_train.models.transformer import get_layer_range
from megatron_train.parallel.schedules import ForwardStepFunc
from megatron_train.parallel.state import process_groups
from megatron_train.tokenizer import MegatronTokenizer

# model_provider(config, padded_vocab_size, pre_process, post_process, vp_stage): one pipeline stage (or virtual
# stage vp_stage of it); pre_process: it holds the embedding, post_process: the output end (Megatron-Core's hook).
ModelProvider = Callable[..., nn.Module]

# datasets_provider(config, tokenizer, (train, valid, test) sample counts) -> (train, valid, test) datasets
DatasetsProvider = Callable[[MegatronConfig, MegatronTokenizer, tuple[int, int, int]], tuple]
StateDict = dict[str, torch.Tensor]
# The token data a family pretrains on: whole documents (GPT) or documents split into sentences (BERT, T5).
CorpusKind = Literal["document", "sentence"]


def model_build_options(config: MegatronConfig) -> dict[str, Any]:
    """The keyword arguments every family's model classes take from the run: `--sequence-parallel`, with
    `--use-cpu-initialization` the seed each part's weights are drawn from (the same full weights under every
    parallel layout), and the process groups its layers communicate over (`parallel.state.process_groups()`)."""
    return {
        "sequence_parallel": config.parallel.sequence_parallel,
        "init_seed": config.training.seed if config.training.use_cpu_initialization else None,
        "pg_collection": process_groups(),
    }


@dataclass(frozen=True)
class ParallelDimension:
    """One way to split a model over ranks, as the flags give it: `size(config)` above 1 means the run uses it;
    `sized`: the flag's value is that size (a refusal shows it), not a switch or another setting."""

    name: str
    flag: str
    size: Callable[[MegatronConfig], int]
    sized: bool = True


# Every dimension a family must declare (`Layouts.supported`) or is refused along. Data parallelism and the
# distributed optimizer split no model and apply to every family.
PARALLEL_DIMENSIONS = (
    ParallelDimension(
        "tensor", "--tensor-model-parallel-size", lambda c: c.parallel.tensor_model_parallel_size
    ),
    ParallelDimension(
        "sequence", "--sequence-parallel", lambda c: 2 if c.parallel.sequence_parallel else 1, sized=False
    ),
    ParallelDimension(
        "pipeline", "--pipeline-model-parallel-size", lambda c: c.parallel.pipeline_model_parallel_size
    ),
    ParallelDimension("context", "--context-parallel-size", lambda c: c.parallel.context_parallel_size),
    ParallelDimension(
        "virtual pipeline",
        "--num-layers-per-virtual-pipeline-stage",
        lambda c: 2 if c.parallel.num_layers_per_virtual_pipeline_stage is not None else 1,
        sized=False,
    ),
    # MoE layers' experts split over ranks (`models.moe`); a family whose model has MoE layers declares it
    ParallelDimension(
        "expert", "--expert-model-parallel-size", lambda c: c.parallel.expert_model_parallel_size
    ),
)
ALL_DIMENSIONS = frozenset(dimension.name for dimension in PARALLEL_DIMENSIONS)
# Every dimension a model without MoE layers can be split along.
DENSE_DIMENSIONS = ALL_DIMENSIONS - {"expert"}


@dataclass(frozen=True)
class Layouts:
    """The parallel dimensions a family's model is split along; a run using any other is refused with
    `refusals[dimension]` (the reason and what to use instead), or a line naming the flag."""

    supported: frozenset[str]
    refusals: Mapping[str, str] = field(default_factory=dict)

    def check(self, family: str, config: MegatronConfig) -> None:
        """Raise ValueError naming the first flag that splits the model along a dimension it does not take."""
        for dimension in PARALLEL_DIMENSIONS:
            size = dimension.size(config)
            if size > 1 and dimension.name not in self.supported:
                reason = self.refusals.get(
                    dimension.name, f"the {family} model is not split along {dimension.name} parallelism"
                )
                value = f" {size}" if dimension.sized else ""
                raise ValueError(f"{dimension.flag}{value}: {reason}")


def uniform_layer_range(
    model: TransformerConfig, pp_rank: int, pp_size: int, vp_rank: int = 0, vp_size: int | None = None
) -> range:
    """Megatron's split: every pipeline stage (virtual stage) holds as many consecutive layers as the others, but
    the first and last stages where --num-layers-in-first/last-pipeline-stage fix theirs."""
    return get_layer_range(
        model.num_layers,
        pp_rank,
        pp_size,
        vp_rank,
        vp_size,
        model.num_layers_in_first_pipeline_stage,
        model.num_layers_in_last_pipeline_stage,
    )


@dataclass(frozen=True)
class PipelineSplit:
    """How a family's model is cut into pipeline stages: the global layers a stage (or virtual stage) holds, and
    which tensors outside the layer stacks the first and the last stage hold. Checkpoint names, resharding and the
    converters' savers cut a model with it (`checkpointing.layout.stage_tensor_names`). `layer_stacks`: the
    model's stacks of `<stack>.layers.<i>.` tensors, the first of --num-layers layers (none: a model without
    transformer layers)."""

    first_stage_prefixes: tuple[str, ...]
    last_stage_prefixes: tuple[str, ...]
    layer_range: Callable[[TransformerConfig, int, int, int, int | None], range] = uniform_layer_range
    layer_stacks: tuple[str, ...] = ("decoder",)

    def stage_layers(
        self, model: TransformerConfig, pp_rank: int, pp_size: int, vp_size: int | None = None
    ) -> list[int]:
        """The global layers of pipeline stage `pp_rank`, those of all its virtual stages."""
        return [
            index
            for vp_rank in range(vp_size or 1)
            for index in self.layer_range(model, pp_rank, pp_size, vp_rank, vp_size)
        ]


@dataclass(frozen=True)
class MegatronNames:
    """What Megatron-LM's checkpoint formats (`--loader/--saver megatron|torch_dist`) need of a family: the
    layer stack its layers live in (GPT's `decoder`, BERT's `encoder`), which the older `language_model.*`
    names map to and whose layers torch_dist stacks on a first axis; `renames`: Megatron's names of the family's
    own tensors -> ours, read from its legacy files (the hybrid family's TransformerEngine-fused Mamba norms);
    `torch_dist`: whether its layers are in the torch_dist mapping (None: why not)."""

    layer_stack: str
    renames: Mapping[str, str] = field(default_factory=dict)
    torch_dist: str | None = None


@dataclass(frozen=True)
class HFConversion:
    """A family's Hugging Face mapping (`convert.hf`): the architectures it imports (config.json's `model_type`,
    read by the converter's tables of those architectures), and its export `(model config, our tensors) ->
    (config.json fields, HF tensors)`, which refuses a setting the HF architecture lacks by its flag;
    `auto_class` is the transformers class that loads the export."""

    architectures: tuple[str, ...]
    export: Callable[[TransformerConfig, StateDict], tuple[dict[str, Any], StateDict]]
    auto_class: str


@dataclass(frozen=True)
class InferenceHooks:
    """How the generation server, `tasks.main` and lm-eval serve a family's checkpoint (`inference.checkpoint`).

    `add_flags(parser)`: the tools' flags for this family (Retro's index search settings). `prepare(model,
    tokenizer, args, device)`: the model the tools call (`model(tokens [b, s], position_ids=, kv_cache=)` ->
    logits), from the loaded one; Retro's retrieves its neighbours first. `one_process`: why a checkpoint of the
    family is served by one process only (None: TP x PP ranks may serve it)."""

    add_flags: Callable[[argparse.ArgumentParser], None] | None = None
    prepare: Callable[[nn.Module, MegatronTokenizer, argparse.Namespace, Any], nn.Module] | None = None
    one_process: str | None = None


@dataclass(frozen=True)
class ModelFamily:
    """One model family. `name` is what checkpoints record (`model_type` in metadata.json, the model class's
    `model_type`).

    Training: `model_class` is the model (`GPTModel`, ...): every family's model takes the model config, the
    padded vocabulary, the stage's ends and, as keywords, `vp_stage` and the run's `model_build_options`, plus
    what `model_options(config)` adds (BERT's binary head, Retro's config); `model_provider` builds a stage of it;
    `forward_step(data_iterator, model)` (with `per_token_loss=` when `per_token_loss`, for
    --calculate-per-token-loss) runs a micro-batch; `datasets_provider` builds the data; `mixture_of_experts`: its
    layers take --num-experts (MoE layers, `models.moe`); `layouts` and `check_config` refuse what the family
    cannot do; `prepare_argv` adds flags its files imply (Retro's project);
    `run_model_provider(config)` gives the provider a run uses when it is not `model_provider` (Retro
    retro-fitting from a GPT checkpoint). `entry_module` is its `torchrun -m` entry point.
    Accounting: `terms(config, padded_vocab_size)`, the parameters and FLOPs of one sample.
    Checkpoints: `pipeline` cuts the model into stages; `megatron_names` and `hf` are the converter's.
    Pipeline: `corpus`, the token data the pretrain stage and flow build (None: the family does not pretrain on a
    plain corpus), and `flow_flags`, Megatron flags the flow's small model needs for it; `finetune_data`, the data
    flags of the finetuning command `checkpoint_util` prints after a conversion.
    Serving: `inference` (None: its checkpoints are not served or scored as a language model).
    """

    name: str
    model_class: Callable[..., nn.Module]
    terms: Callable[..., ModelTerms]
    layouts: Layouts
    pipeline: PipelineSplit
    forward_step: ForwardStepFunc
    model_options: Callable[[MegatronConfig], dict[str, Any]] = lambda config: {}
    datasets_provider: DatasetsProvider | None = None
    per_token_loss: bool = False
    mixture_of_experts: bool = False
    check_config: Callable[[MegatronConfig], None] | None = None

    prepare_argv: Callable[[list[str]], list[str]] | None = None
    run_model_provider: Callable[[MegatronConfig], ModelProvider] | None = None
    entry_module: str = "megatron_train.pretrain"
    corpus: CorpusKind | None = None
    flow_flags: tuple[str, ...] = ()
    finetune_data: str = "--data-path <token prefix> [training flags]"
    megatron_names: MegatronNames | None = None
    hf: HFConversion | None = None
    inference: InferenceHooks | None = None

    def model_provider(
        self,
        config: MegatronConfig,
        padded_vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int = 0,
        **options: Any,
    ) -> nn.Module:
        """This rank's pipeline stage (or its model chunk `vp_stage`) of the family's model, with the run's
        options (`model_build_options`: sequence parallelism, the init seed, the process groups), the family's
        (`model_options`) and `options` (a task's: the classifier's `num_classes`). The training loop, the
        checkpoint loaders and the converter all build the model here."""
        return self.model_class(
            config.model,
            padded_vocab_size,
            pre_process,
            post_process,
            vp_stage=vp_stage,
            **model_build_options(config),
            **self.model_options(config),
            **options,
        )

    @property
    def entry(self) -> str:
        """The entry point's name, as errors and Megatron's scripts call it (`pretrain_gpt`, `tasks.main`)."""
        return self.entry_module.removeprefix("megatron_train.")
