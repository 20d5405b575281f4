"""Models, readers and Megatron-LM stand-ins shared by the converter tests (tests/test_convert_*.py)."""

from __future__ import annotations

import argparse
import enum
import logging
import os
import pathlib

import torch
from safetensors import safe_open

from megatron_train.arguments import MegatronConfig
from megatron_train.data.config import DataConfig
from megatron_train.models import GPTModel, TransformerConfig

VOCAB = 100  # padded to 128 (TP1) or 256 (TP2) in our checkpoints, cut back to 100 rows in HF folders


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


# The tiny Llama's MoE layers: 4 experts of top 2 in every layer, a gated shared expert (Qwen2-MoE's).
MOE = dict(
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True,
)  # fmt: skip


def our_llama(
    untied: bool, qkv_bias: bool = False, moe: bool = False, moe_layer_freq: str = "1"
) -> tuple[MegatronConfig, GPTModel]:
    """The tiny GQA Llama; with `qkv_bias` Qwen2's q/k/v biases (--add-qkv-bias), given random values; with `moe`
    its MLPs are MoE layers (`MOE`) where `moe_layer_freq` puts them."""
    model_config = TransformerConfig.llama(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, ffn_hidden_size=64,
        group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=untied,
        add_qkv_bias=qkv_bias, true_vocab_size=VOCAB, **({**MOE, "moe_layer_freq": moe_layer_freq} if moe else {}),
    )  # fmt: skip
    torch.manual_seed(7)
    model = GPTModel(model_config, 128).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_qkv.bias"):
                param.normal_()
    return MegatronConfig(model=model_config, data=DataConfig()), model


def save_word_tokenizer(folder: str) -> None:
    """A real word-level tokenizer.json of VOCAB words `w0 w1 ...` split on whitespace, so its copy can be checked
    byte for byte and prompts written as words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))


def shard_tensors(iteration_dir: str) -> dict[tuple[str, str], torch.Tensor]:
    tensors = {}
    for shard in sorted(os.listdir(iteration_dir)):
        if shard.startswith("mp_rank_"):
            with safe_open(f"{iteration_dir}/{shard}/model.safetensors", framework="pt") as handle:
                tensors |= {(shard, key): handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
                tensors[(shard, "metadata")] = handle.metadata()
    return tensors


LLAMA2_CHAT_TEMPLATE = (  # meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "<|im_start|>",
                 "<|im_end|>"]  # fmt: skip
CHAT_WORDS = ["system", "user", "assistant"] + [f"w{i}" for i in range(VOCAB - len(CHAT_SPECIALS) - 3)]


def save_chat_tokenizer(folder: str, chat_template: str | None) -> None:
    """A Hugging Face tokenizer folder of exactly VOCAB tokens (words split on whitespace, Llama-style <s>/</s>,
    a BOS added in front), with `chat_template` in its tokenizer_config.json."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate(CHAT_SPECIALS + CHAT_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(CHAT_SPECIALS)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


class ModelType(enum.Enum):
    """Megatron's megatron.core.enums.ModelType, which pretrain() puts in args (args.model_type)."""

    encoder_or_decoder = 1


def megatron_args(model: TransformerConfig, tp: int, pp: int, padded: int) -> argparse.Namespace:
    """The args Megatron-LM's pretrain_gpt.py pickles (the model's subset, as Megatron names them)."""
    return argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, kv_channels=model.kv_channels, group_query_attention=True,
        num_query_groups=model.num_query_groups, seq_length=model.seq_length,
        max_position_embeddings=model.seq_length, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, fp16=False,
        bf16=False, params_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        padded_vocab_size=padded, make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1, iteration=20, transformer_impl="transformer_engine", use_mcore_models=True,
        model_type=ModelType.encoder_or_decoder,
        ckpt_format="torch",
    )  # fmt: skip


class WritesFile:
    """Unpickling this would write a file: what a crafted checkpoint could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return pathlib.Path.write_text, (pathlib.Path(self.path), "ran")


def hf_logits(folder: str, tokens: torch.Tensor, caplog) -> torch.Tensor:
    """transformers' logits of a saved folder, asserting it loads with no missing or unused weights and no
    warning (transformers' logger does not propagate: caplog's handler is attached to it)."""
    import transformers

    caplog.clear()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(caplog.handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    finally:
        hf_logger.removeHandler(caplog.handler)
    assert {key: value for key, value in info.items() if value} == {}, info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    with torch.no_grad():
        return model.eval()(tokens).logits
