"""The GPT/Llama model in one process: architecture equal to HF GPT-2 and Llama, KV cache, recompute, config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_train.arguments import MegatronConfig, config_to_argv, parse_args
from megatron_train.data.config import DataConfig
from megatron_train.models import GPTModel, KVCache, TransformerConfig
from megatron_train.models.hf_import import gpt2_state_dict_from_hf, llama_state_dict_from_hf
from megatron_train.models.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron_train.models.transformer import get_layer_range, pack_qkv, unpack_qkv
from megatron_train.parallel.random import model_parallel_seed
from tests.helpers.tiny import TINY_MODEL
from tests.helpers.training import tiny_args


@pytest.fixture
def transformers():
    """Hugging Face transformers (a dev dependency): the reference implementations."""
    return pytest.importorskip("transformers")


VOCAB = 128


def gpt2_config(**overrides) -> TransformerConfig:
    return TransformerConfig.gpt2(**{**TINY_MODEL, **overrides})


def llama_config(**overrides) -> TransformerConfig:
    settings = dict(TINY_MODEL, ffn_hidden_size=64, group_query_attention=True, num_query_groups=2)
    return TransformerConfig.llama(**{**settings, **overrides})


def build(config: TransformerConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config, VOCAB)


def tokens(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_matches_hf_gpt2_logits(transformers):
    hf_config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
    )  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    ours = build(gpt2_config()).eval()
    ours.load_state_dict(gpt2_state_dict_from_hf(hf.state_dict(), ours.config), strict=True)
    ids = tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
        loss = ours(ids[:, :-1], labels=ids[:, 1:])
    reference = F.cross_entropy(expected[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(loss, reference.view(2, 15), rtol=1e-5, atol=1e-5)


def _llama_pair(transformers, untied: bool) -> tuple[torch.nn.Module, GPTModel]:
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=not untied,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )  # fmt: skip
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    ours = build(llama_config(rotary_base=500000, untie_embeddings_and_output_weights=untied)).eval()
    ours.load_state_dict(llama_state_dict_from_hf(hf.state_dict(), ours.config), strict=True)
    return hf, ours


@pytest.mark.parametrize("untied", [True, False])
def test_matches_hf_llama_logits_with_rope_gqa_swiglu_rmsnorm(transformers, untied):
    hf, ours = _llama_pair(transformers, untied)
    ids = tokens(seq=24)  # longer than seq_length: RoPE has no position table
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_add_qkv_bias_flag_biases_linear_qkv_only(tmp_path):
    """Megatron's --add-qkv-bias: the QKV projection has a bias even with --disable-bias-linear, nothing else."""
    argv = tiny_args(str(tmp_path), "--train-iters", "1", "--disable-bias-linear", "--add-qkv-bias")
    config = parse_args(argv, world_size=1).model
    assert (config.add_bias_linear, config.add_qkv_bias) == (False, True)
    biases = [name for name, _ in build(config).named_parameters() if name.endswith(".bias")]
    layernorm_biases = [name for name in biases if "norm" in name]
    assert sorted(set(biases) - set(layernorm_biases)) == [
        f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(2)
    ]
    assert "--add-qkv-bias" in config_to_argv(MegatronConfig(model=config, data=DataConfig()))


def test_partial_rotary_rotates_leading_dims_like_hf_and_passes_the_rest(transformers):
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_base=10000)
    positions = torch.arange(6).expand(2, 6)
    cos, sin = rope(positions)
    x = torch.randn(6, 2, 3, 8)
    out = apply_rotary_pos_emb(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)
    hf_apply = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    hf_cos, hf_sin = cos[:, :, 0].transpose(0, 1), sin[:, :, 0].transpose(0, 1)  # [b, s, rot_dim]
    hf_q = x[..., :4].permute(1, 2, 0, 3)  # [b, heads, s, rot_dim]
    expected, _ = hf_apply(hf_q, hf_q, hf_cos, hf_sin)
    torch.testing.assert_close(out[..., :4], expected.permute(2, 0, 1, 3), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[1:, ..., :4], x[1:, ..., :4])  # positions > 0 really rotate


def test_pack_and_unpack_qkv_round_trip_in_grouped_layout():
    q, k, v = (
        torch.arange(8 * 3).view(8, 3),
        100 + torch.arange(4 * 3).view(4, 3),
        200 + torch.arange(12).view(4, 3),
    )
    packed = pack_qkv(q, k, v, num_query_groups=2)  # d = 2: group 0 = [q0 q1 k0 v0] rows of 2
    assert packed[:8].tolist() == [*q[:4].tolist(), *k[:2].tolist(), *v[:2].tolist()]
    for original, restored in zip((q, k, v), unpack_qkv(packed, 2, 4), strict=True):
        assert torch.equal(original, restored)


@pytest.mark.parametrize("make_config", [gpt2_config, llama_config], ids=["gpt2", "llama_gqa"])
def test_kv_cache_decoding_equals_full_sequence_logits(make_config):
    model = build(make_config()).eval()
    ids = tokens(seq=12)
    cache = KVCache(num_layers=2, batch_size=2, max_seq_len=12, num_kv_heads=model.config.num_query_groups_effective,
                    head_dim=model.config.kv_channels, dtype=torch.float32, device="cpu")  # fmt: skip
    with torch.no_grad():
        full = model(ids)
        pieces = [
            model(ids[:, start:end], kv_cache=cache) for start, end in [(0, 5), (5, 8), (8, 9), (9, 12)]
        ]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.seq_len_offset == 12
    with pytest.raises(ValueError, match="KV cache holds"):
        model(ids[:, :1], kv_cache=cache)


RECOMPUTE_MODES = {
    "selective": dict(recompute_activations=True),
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}


def _loss_and_grads(config: TransformerConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build(config).train()
    model_parallel_seed(7)
    ids = tokens()
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.mean().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("make_config", [gpt2_config, llama_config], ids=["gpt2", "llama"])
@pytest.mark.parametrize("mode", list(RECOMPUTE_MODES))
def test_recompute_gives_identical_loss_and_grads_with_dropout(mode, make_config):
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)
    base_loss, base_grads = _loss_and_grads(make_config(**dropout))
    loss, grads = _loss_and_grads(make_config(**dropout, **RECOMPUTE_MODES[mode]))
    torch.testing.assert_close(loss, base_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    no_dropout_loss, _ = _loss_and_grads(make_config())
    assert not torch.allclose(no_dropout_loss, loss)  # dropout was really active


def test_flash_attn_request_on_cpu_raises_instead_of_falling_back():
    with pytest.raises(RuntimeError, match="flash-attn"):
        GPTModel(gpt2_config(use_flash_attn=True), VOCAB)


def test_init_follows_megatron_std_and_scaled_output_projections():
    model = build(TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=16))
    layer = model.decoder.layers[0]
    assert layer.self_attention.linear_qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.mlp.linear_fc2.weight.std().item() == pytest.approx(0.02 / 4.0, rel=0.05)  # sqrt(2 * 8) = 4
    assert layer.self_attention.linear_proj.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert torch.count_nonzero(layer.self_attention.linear_qkv.bias) == 0


def test_config_derives_megatron_defaults():
    config = TransformerConfig(num_layers=2, hidden_size=4096, num_attention_heads=32, seq_length=8)
    assert (config.ffn_hidden_size, config.kv_channels, config.num_query_groups_effective) == (16384, 128, 32)
    swiglu = TransformerConfig.llama(num_layers=2, hidden_size=4096, num_attention_heads=32)
    assert swiglu.ffn_hidden_size == 10880  # int(4 * 4096 * 2 / 3 / 64) * 64
    small = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=32)
    assert TransformerConfig(**small, recompute_activations=True).recompute_granularity == "selective"
    assert TransformerConfig(**small).max_position_embeddings == 32
    with pytest.raises(ValueError, match="need --max-position-embeddings or --seq-length"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(group_query_attention=True, num_query_groups=3), "multiple of --num-query-groups"),
        (dict(recompute_granularity="full"), "recompute-method"),
        (dict(normalization="BatchNorm"), "--normalization"),
        (dict(hidden_size=30), "not divisible by --num-attention-heads"),
        (dict(fp16=True, bf16=True), "mutually exclusive"),
        (dict(hidden_size=16, swiglu=True), "set --ffn-hidden-size explicitly"),
    ],
)
def test_config_rejects_inconsistent_flags(overrides, message):
    settings = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16) | overrides
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**settings)


def test_learned_positions_beyond_the_table_raise_a_clear_error():
    with pytest.raises(ValueError, match="max-position-embeddings 16"):
        build(gpt2_config())(tokens(seq=17))


def test_layer_range_per_pipeline_stage_and_virtual_chunk():
    assert get_layer_range(8) == range(0, 8)
    assert get_layer_range(8, pipeline_rank=1, pipeline_size=2) == range(4, 8)
    # interleaved, 2 stages x 2 chunks of 2 layers: stage 0 holds 0-1 and 4-5, stage 1 holds 2-3 and 6-7
    ranges = {(p, v): get_layer_range(8, p, 2, v, 2) for p in range(2) for v in range(2)}
    assert ranges == {(0, 0): range(0, 2), (1, 0): range(2, 4), (0, 1): range(4, 6), (1, 1): range(6, 8)}
    with pytest.raises(ValueError, match="not divisible"):
        get_layer_range(6, 0, 4)


def test_bf16_params_and_loss_in_fp32():
    model = build(llama_config(bf16=True))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = tokens()
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    assert loss.dtype == torch.float32
    assert 3.5 < loss.mean().item() < 6.0  # about ln(128) = 4.85 for an untrained model


def test_stage_without_embedding_needs_an_input_tensor_and_zeroes_its_tied_output_weight():
    stage = GPTModel(gpt2_config(), VOCAB, pre_process=False, post_process=True)
    assert stage.embedding is None and stage.output_layer.weight.shared_embedding
    assert torch.count_nonzero(stage.output_layer.weight) == 0
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        stage(tokens())
    first = build(gpt2_config()).eval()
    first_stage = GPTModel(gpt2_config(), VOCAB, pre_process=True, post_process=False).eval()
    first_stage.load_state_dict(first.state_dict(), strict=False)
    hidden = first_stage(tokens())
    assert hidden.shape == (16, 2, 32)  # [s, b, h] for the next stage


@pytest.mark.parametrize("llama", [False, True])
def test_document_ids_make_each_document_score_as_if_alone(llama):
    """--reset-attention-mask: a document after an eod gets the per-token losses it gets alone (positions
    restarted too); without the document ids it attends to the first document and scores otherwise."""
    from tests.helpers.tiny import tiny_config, tiny_llama_config

    torch.manual_seed(0)
    config = (tiny_llama_config if llama else tiny_config)(seq_length=16)
    model = GPTModel(config, 64).eval()
    first, second = torch.randint(0, 63, (1, 7)), torch.randint(0, 63, (1, 9))
    eod = torch.tensor([[63]])
    text = torch.cat([first, eod, second], dim=1)  # 17 tokens: 16 inputs and their labels
    tokens, labels = text[:, :-1], text[:, 1:]
    positions = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
    documents = torch.cat([torch.zeros(8), torch.ones(8)]).long().unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions, labels=labels, document_ids=documents)
        alone = model(second[:, :-1], labels=second[:, 1:])
        leaking = model(tokens, positions, labels=labels)
        first_alone = model(text[:, :8], labels=text[:, 1:9])
    torch.testing.assert_close(packed[:, 8:], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[:, :8], first_alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(leaking[:, 8:], alone, atol=1e-4)
