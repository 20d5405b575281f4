"""What a checkpoint loader yields and a saver writes: one model as whole tensors under our global names.

Every format converts through `ModelWeights` (docs/architecture.md, checkpoints), as Megatron's
tools/checkpoint/convert.py passes a model between its loader and saver: the config says what the model is
(read from the source, so the user never restates it), the tensors are the unsplit weights of a TP1 x PP1
model of its family (`family`: `GPTModel`, `BertModel`, ...) with the vocabulary rows cut to the true vocabulary (a
saver pads them for its layout), and the tokenizer files travel with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing.layout import (
    VOCAB_PARAMS,
    TensorSharding,
    check_layout,
    param_sharding,
    resize_vocab,
)
from megatron_train.distributed.ddp import is_expert_parameter
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import DEFAULT_FAMILY, get_family
from megatron_train.parallel import state
from megatron_train.tokenizer import vocab_size_with_padding

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# _meta_params' results: building even a meta-device model takes a fraction of a second
_META_PARAMS: dict[tuple[str, str, int], dict[str, tuple[TensorSharding, tuple[int, ...], bool]]] = {}


@dataclass
class ModelWeights:
    """A model between a loader and a saver. `config.model.true_vocab_size` is always set and the vocabulary
    tensors have exactly that many rows. The tokenizer is `config.tokenizer` (Megatron's flags) and
    `tokenizer_files`, {file name in a saved folder: source path} of the files those flags name
    (`convert.tokenizer_files`); empty when the source has none here."""

    config: MegatronConfig
    tensors: dict[str, torch.Tensor]
    tokenizer_files: dict[str, str] = field(default_factory=dict)
    iteration: int = 1
    # bos/eos/pad token ids where the source records them (HF config.json; ours keep them in metadata.json)
    token_ids: dict[str, int] = field(default_factory=dict)
    # the model family (what builds the model); a GPT's by default, as checkpoints without a record
    family: ModelFamily = field(default_factory=lambda: get_family(DEFAULT_FAMILY))

    @property
    def true_vocab_size(self) -> int:
        return self.config.model.true_vocab_size


def _meta_params(
    config: MegatronConfig, vocab_size: int, family: ModelFamily, where: str
) -> dict[str, tuple[TensorSharding, tuple[int, ...], bool]]:
    """(TP sharding, shape, whether an MoE expert weight) of each param of the whole model of `family`, read off a model built on the meta
    device (no memory, no process groups): the attributes a training run records in its checkpoint. Remembered
    per (family, model config, vocabulary): a conversion's loader and saver build it once. A loader checks the
    config's layer count against the weights first: the build takes time per layer. A model the config's
    settings cannot build is an error naming `where` (the file the config came from)."""
    key = (family.name, repr(config.model), vocab_size)
    if key not in _META_PARAMS:
        try:
            with torch.device("meta"), state.single_process_view():  # the whole model, also on a rank
                model = family.model_provider(config, vocab_size)
        except (ValueError, TypeError, OverflowError, RuntimeError) as error:  # sizes no tensor can have
            raise ValueError(
                f"{where}: its settings describe no model that can be built ({error})"
            ) from error
        # every tensor a checkpoint holds: the params, and saved buffers (an MoE router's expert bias), replicated
        _META_PARAMS[key] = {
            name: (param_sharding(param), tuple(param.shape), is_expert_parameter(param))
            for name, param in model.state_dict(keep_vars=True).items()
        }
    return _META_PARAMS[key]


def model_shardings(
    config: MegatronConfig, vocab_size: int, family: ModelFamily, where: str = "the converted model"
) -> dict[str, TensorSharding]:
    """How each param of the whole model splits across TP (see `_meta_params`)."""
    params = _meta_params(config, vocab_size, family, where)
    return {name: sharding for name, (sharding, _, _) in params.items()}


def model_shapes(
    config: MegatronConfig, vocab_size: int, family: ModelFamily, where: str = "the converted model"
) -> dict[str, tuple[int, ...]]:
    """Each param's shape in the whole model the config describes (see `_meta_params`)."""
    return {name: shape for name, (_, shape, _) in _meta_params(config, vocab_size, family, where).items()}


def expert_names(
    config: MegatronConfig, vocab_size: int, family: ModelFamily, where: str = "the converted model"
) -> set[str]:
    """The names of the MoE expert weights of the whole model (each holds all of a layer's experts)."""
    return {
        name for name, (_, _, expert) in _meta_params(config, vocab_size, family, where).items() if expert
    }


def check_tensor_names(tensors: dict[str, torch.Tensor], expected: list[str], source: str) -> None:
    """Refuse weights that are not exactly the model's params, naming what is missing or left over."""
    missing, unused = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unused:
        raise ValueError(
            f"{source}: the weights do not match the model its config describes (missing {missing[:5]}, "
            f"unused {unused[:5]}); the config and the weights come from different models"
        )


def trim_vocab(tensors: dict[str, torch.Tensor], true_vocab_size: int) -> dict[str, torch.Tensor]:
    """The vocabulary tensors cut to the true vocabulary (padding rows hold no token); the rest as they are."""
    return {
        name: tensor[:true_vocab_size] if name in VOCAB_PARAMS else tensor for name, tensor in tensors.items()
    }


def padded_vocab_for_layout(weights: ModelWeights, target_tp: int, target_pp: int) -> int:
    """The vocabulary size a saver pads to for `target_tp` (--make-vocab-size-divisible-by x TP), after
    refusing a (TP, PP) layout the model cannot be cut into, naming the setting."""
    config = weights.config
    padded = vocab_size_with_padding(
        weights.true_vocab_size, config.tokenizer.make_vocab_size_divisible_by, target_tp
    )
    check_layout(config.model, weights.family.pipeline, padded, target_tp, target_pp)
    return padded


def padded_size_of(weights: ModelWeights, padded_vocab_size: int) -> int:
    """The bytes of the weights once their vocabulary is padded to `padded_vocab_size` rows: about what a saver
    writes, checked against the target's free space before it starts."""
    total = 0
    for name, tensor in weights.tensors.items():
        numel = tensor.numel()
        if name in VOCAB_PARAMS:  # [vocab, ...]: the padded rows are as wide as the others
            numel = numel // max(tensor.shape[0], 1) * padded_vocab_size
        total += numel * tensor.element_size()
    return total


def pad_vocab(tensors: dict[str, torch.Tensor], padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """The vocabulary tensors padded to `padded_vocab_size` rows, copies of the last row (as Megatron's saver)."""
    return {
        name: resize_vocab(tensor, padded_vocab_size, replicate_last_row=True)
        if name in VOCAB_PARAMS
        else tensor
        for name, tensor in tensors.items()
    }
