"""Models and readers shared by the converter tests (tests/test_convert_*.py)."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from megatron_train.arguments import MegatronConfig
from megatron_train.data.config import DataConfig
from megatron_train.models import GPTModel, TransformerConfig

VOCAB = 100  # padded to 128 (TP1) or 256 (TP2) in our checkpoints, cut back to 100 rows in HF folders


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def our_llama(untied: bool, qkv_bias: bool = False) -> tuple[MegatronConfig, GPTModel]:
    """The tiny GQA Llama; with `qkv_bias` Qwen2's q/k/v biases (--add-qkv-bias), given random values."""
    model_config = TransformerConfig.llama(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, ffn_hidden_size=64,
        group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=untied,
        add_qkv_bias=qkv_bias, true_vocab_size=VOCAB,
    )  # fmt: skip
    torch.manual_seed(7)
    model = GPTModel(model_config, 128).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_qkv.bias"):
                param.normal_()
    return MegatronConfig(model=model_config, data=DataConfig()), model


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
