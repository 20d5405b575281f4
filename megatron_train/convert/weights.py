"""What a checkpoint loader yields and a saver writes: one model as whole tensors under our global names.

Every format converts through `ModelWeights` (docs/architecture.md, checkpoints), as Megatron's
tools/checkpoint/convert.py passes a model between its loader and saver: the config says what the model is
(read from the source, so the user never restates it), the tensors are the unsplit weights of a TP1 x PP1
`GPTModel` (or `BertModel`, `model_type`) with the vocabulary rows cut to the true vocabulary (a saver pads them for its layout), and the
tokenizer files travel with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing.inference import build_saved_model
from megatron_train.checkpointing.layout import VOCAB_PARAMS, TensorSharding, check_layout, resize_vocab
from megatron_train.parallel import state
from megatron_train.tokenizer import vocab_size_with_padding

# A Hugging Face tokenizer's files, any of which a model folder may hold.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# model_shardings' results: building even a meta-device model takes a fraction of a second
_SHARDINGS: dict[tuple[str, str, int], dict[str, TensorSharding]] = {}


def tokenizer_files_in(folder: str) -> dict[str, str]:
    """{file name: path} of the tokenizer files `folder` holds."""
    return {
        name: os.path.join(folder, name)
        for name in TOKENIZER_FILES
        if os.path.exists(os.path.join(folder, name))
    }


@dataclass
class ModelWeights:
    """A model between a loader and a saver. `config.model.true_vocab_size` is always set and the vocabulary
    tensors have exactly that many rows. `tokenizer_files`: file name in the saved folder -> source path."""

    config: MegatronConfig
    tensors: dict[str, torch.Tensor]
    tokenizer_files: dict[str, str] = field(default_factory=dict)
    iteration: int = 1
    # bos/eos/pad token ids where the source records them (HF config.json; ours keep them in metadata.json)
    token_ids: dict[str, int] = field(default_factory=dict)
    model_type: str = "gpt"  # the family, as checkpoints record it: "gpt" or "bert"

    @property
    def true_vocab_size(self) -> int:
        return self.config.model.true_vocab_size


def model_shardings(
    config: MegatronConfig, vocab_size: int, model_type: str = "gpt"
) -> dict[str, TensorSharding]:
    """How each param of the whole model (`gpt` or `bert`) splits across TP, read off a model built on the meta
    device (no memory, no process groups): the same attributes a training run records in its checkpoint.
    Remembered per (family, model config, vocabulary): a conversion's loader and saver build it once."""
    key = (model_type, repr(config.model), vocab_size)
    if key not in _SHARDINGS:
        with torch.device("meta"), state.single_process_view():  # the whole model, also on a rank of a layout
            model = build_saved_model(model_type, config, vocab_size, "the converted model")
        _SHARDINGS[key] = {
            name: TensorSharding(
                int(param.partition_dim) if getattr(param, "tensor_model_parallel", False) else -1,
                int(getattr(param, "partition_stride", 1)),
            )
            for name, param in model.named_parameters()
        }
    return dict(_SHARDINGS[key])


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
    check_layout(config.model, padded, target_tp, target_pp)
    return padded


def pad_vocab(tensors: dict[str, torch.Tensor], padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """The vocabulary tensors padded to `padded_vocab_size` rows, copies of the last row (as Megatron's saver)."""
    return {
        name: resize_vocab(tensor, padded_vocab_size, replicate_last_row=True)
        if name in VOCAB_PARAMS
        else tensor
        for name, tensor in tensors.items()
    }
