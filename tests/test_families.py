"""The model-family registry (`megatron_train.families`): every family of the project by name, one from outside it
by `pkg.module:ATTR`, the refusals of each, and each family's terms counting exactly the parameters of the model
it builds (what the FLOPs of the logs and a memory planner rest on)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.data.config import DataConfig
from megatron_train.families import checkpoint_family, get_family
from megatron_train.families.registry import BUILTIN_FAMILIES, checkpoint_record
from megatron_train.models.retro_config import RetroConfig
from megatron_train.training.entry import check_family_config
from tests.helpers.tiny import tiny_config, tiny_llama_config

PADDED_VOCAB = 128


def _config(**model) -> MegatronConfig:
    return MegatronConfig(model=tiny_config(**model), data=DataConfig())


def _llama(**model) -> MegatronConfig:
    return MegatronConfig(model=tiny_llama_config(**model), data=DataConfig())


# (family, config, provider options): models of every shape option the terms count differently.
MODELS = {
    "gpt2": ("gpt", _config(), {}),
    "gpt2 post-LN untied": ("gpt", _config(post_ln=True, untie_embeddings_and_output_weights=True), {}),
    "llama": ("gpt", _llama(), {}),
    "qwen2": ("gpt", _llama(add_qkv_bias=True, untie_embeddings_and_output_weights=False), {}),
    "mixtral": ("gpt", _llama(num_experts=4, moe_ffn_hidden_size=16), {}),
    "gpt2 moe layers 1, biased experts, gated shared expert": (
        "gpt",
        _config(
            num_experts=4,
            moe_layer_freq="[0,1]",
            moe_shared_expert_intermediate_size=8,
            moe_shared_expert_gate=True,
        ),
        {},
    ),
    "bert": ("bert", _config(), {}),
    "bert post-LN, no binary head": ("bert", _config(post_ln=True, bert_binary_head=False), {}),
    "t5": ("t5", _config(decoder_seq_length=8, decoder_num_layers=3), {}),
    "t5 relative RMSNorm": (
        "t5",
        _config(decoder_seq_length=8, position_embedding_type="relative", normalization="RMSNorm"),
        {},
    ),
    "retro": (
        "retro",
        dataclasses.replace(
            _config(num_layers=6),
            retro=RetroConfig(retro_add_retriever=True, retro_chunk_length=4, retro_encoder_layers=2),
        ),
        {},
    ),
    "bert classifier": ("bert_classifier", _config(), {"num_classes": 3}),
    "hybrid": (
        "hybrid",
        _config(hybrid_layer_pattern="M-", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8),
        {},
    ),
}


@pytest.mark.parametrize("case", MODELS)
def test_terms_count_every_parameter_of_the_built_model(case):
    name, config, options = MODELS[case]
    family = get_family(name)
    with torch.device("meta"):
        model = family.model_provider(config, PADDED_VOCAB, **options)
    terms = family.terms(config, PADDED_VOCAB, **options)
    assert terms.num_parameters() == sum(p.numel() for p in model.parameters())
    assert terms.flops_per_sample() > 6 * terms.num_parameters()  # every weight multiplies at least a token


def test_t5_stage_holds_every_layer_of_its_longer_stack():
    _, config, _ = MODELS["t5"]  # 2 encoder layers, 3 decoder layers
    assert get_family("t5").pipeline.stage_layers(config.model, 0, 1) == [0, 1, 2]


def test_every_project_family_is_registered_under_its_checkpoint_name():
    for name in BUILTIN_FAMILIES:
        assert get_family(name).name == name
    assert get_family("megatron_train.families.gpt:GPT") is get_family("gpt")
    for bad, message in (
        ("bart", "neither one of this project's"),
        ("no_such_pkg.mod:FAMILY", "cannot import no_such_pkg.mod"),
        (
            "megatron_train.families.gpt:gpt_terms",
            "is a function, not a megatron_train.families.family.ModelFamily",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            get_family(bad)


def test_a_checkpoint_of_a_family_from_outside_the_project_loads_only_when_named():
    """Its metadata names the module; importing it runs code, so the user must name it too."""
    spec = "megatron_train.families.gpt:GPT"  # stands in for a family of another package
    metadata = checkpoint_record("gpt", spec)
    assert metadata == {"model_type": "gpt", "model_family": spec}
    assert checkpoint_record("gpt", "gpt") == {"model_type": "gpt"}
    with pytest.raises(ValueError, match=f"pass --model-family {spec} to do so"):
        checkpoint_family(metadata, None, "ckpt/iter_0000001")
    assert checkpoint_family(metadata, spec, "ckpt/iter_0000001").name == "gpt"
    assert checkpoint_family({}, None, "old").name == "gpt"  # written before the record: GPT's
    with pytest.raises(ValueError, match="--model-family bert, but checkpoint old holds a gpt model"):
        checkpoint_family({}, "bert", "old")


@pytest.mark.parametrize(
    ("name", "flags", "message"),
    [
        (
            "t5",
            ["--pipeline-model-parallel-size", "2", "--decoder-seq-length", "8"],
            "T5's encoder and decoder",
        ),
        ("t5", [], "set --decoder-seq-length"),
        ("bert", ["--calculate-per-token-loss"], "Megatron's BERT loss is per micro-batch"),
        ("retro", ["--pipeline-model-parallel-size", "2", "--retro-add-retriever"], "Retro does not support"),
        ("bert_classifier", ["--pipeline-model-parallel-size", "2"], "finetuning runs without pipeline"),
        (
            "t5",
            ["--decoder-seq-length", "8", "--num-experts", "4"],
            "--num-experts 4: the t5 model has no MoE",
        ),
        ("bert", ["--num-experts", "4"], "--num-experts 4: the bert model has no MoE"),
        (
            "retro",
            ["--num-experts", "4", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2: the retro model is not split along expert parallelism",
        ),
    ],
)
def test_each_family_refuses_what_it_cannot_do_naming_the_flag(tmp_path, name, flags, message):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    argv += ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", *flags]
    config = parse_args(argv, world_size=2)
    with pytest.raises(ValueError, match=message):
        check_family_config(get_family(name), config)
    check_family_config(get_family("gpt"), config)  # GPT takes every layout and the per-token loss
