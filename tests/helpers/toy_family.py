"""A model family defined outside the project, registered by nothing but its `ModelFamily` record: a causal
convolution language model (no attention), trained, saved, loaded, served and converted through the project's
entry points with `--model-family tests.helpers.toy_family:TOY` (tests/test_toy_family.py).

The model uses the shared language-model pieces (`models.language_module`: the vocab-parallel embedding, the tied
output layer and the one LM loss), so it splits over tensor parallelism like every family, and the GPT family's
data and forward step; its own are the mixer, its terms and its layouts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_train.arguments import MegatronConfig
from megatron_train.families.family import (
    InferenceHooks,
    Layouts,
    ModelFamily,
    PipelineSplit,
)
from megatron_train.families.gpt import datasets_provider, forward_step
from megatron_train.models.config import TransformerConfig
from megatron_train.models.language_module import LanguageModelEmbedding, LanguageModule, build_output_layer
from megatron_train.models.norms import build_norm
from megatron_train.models.terms import (
    ModelTerms,
    WeightTerm,
    embedding_terms,
    norm_parameters,
    output_layer_terms,
)
from megatron_train.parallel.state import ProcessGroupCollection

KERNEL = 4  # each position mixes itself and the 3 before it


class ToyModel(LanguageModule):
    """Embedding -> GELU(causal convolution over the last KERNEL positions) + residual -> norm -> the tied output
    layer. One pipeline stage (`vp_stage` is always 0); no KV cache: generation reruns the whole text."""

    model_type = "toy"
    supports_kv_cache = False

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        vp_stage: int = 0,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config, vocab_size, pre_process, post_process, pg_collection=pg_collection)
        tp_group = self.pg_collection.tp
        self.embedding = LanguageModelEmbedding(
            config, vocab_size, sequence_parallel, init_seed, tp_group=tp_group
        )
        self.mixer = nn.Conv1d(config.hidden_size, config.hidden_size, KERNEL, dtype=config.params_dtype)
        self.final_norm = build_norm(config, sequence_parallel)
        self.output_layer = build_output_layer(
            config, vocab_size, True, sequence_parallel, init_seed, tp_group=tp_group
        )

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """The schedules' hook: one stage, so never an input tensor."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: None = None,
    ) -> torch.Tensor:
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        mixed = self.mixer(F.pad(hidden.permute(1, 2, 0), (KERNEL - 1, 0)))  # [b, h, s], causal
        hidden = self.final_norm(hidden + F.gelu(mixed.permute(2, 0, 1)))
        return self.language_model_output(hidden, labels)


def toy_terms(config: MegatronConfig, padded_vocab_size: int) -> ModelTerms:
    model, seq, hidden = config.model, config.model.seq_length, config.model.hidden_size
    mixer = (
        WeightTerm("mixer", KERNEL * hidden * hidden, seq),
        WeightTerm("mixer bias and norm", hidden + norm_parameters(model)),
    )
    return (
        embedding_terms(model, padded_vocab_size)
        + ModelTerms(mixer)
        + output_layer_terms(model, padded_vocab_size, seq)
    )


TOY = ModelFamily(
    name="toy",
    model_class=ToyModel,
    terms=toy_terms,
    layouts=Layouts(
        frozenset({"tensor"}), {"pipeline": "the toy model is one stage: drop --pipeline-model-parallel-size"}
    ),
    pipeline=PipelineSplit(("embedding.",), ("mixer.", "final_norm.", "output_layer."), layer_stacks=()),
    forward_step=functools.partial(forward_step, inputs=()),
    datasets_provider=datasets_provider,
    per_token_loss=True,
    corpus="document",
    inference=InferenceHooks(),
)
