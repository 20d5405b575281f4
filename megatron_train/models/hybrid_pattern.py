"""The layer pattern of a hybrid Mamba model (Megatron's `--hybrid-layer-pattern`, hybrid_layer_allocation.py).

One symbol a layer: `M` a Mamba layer, `*` an attention layer, `-` an MLP layer, `E` an MoE layer (its experts
set by --num-experts and the --moe-* flags); `|` cuts the pattern into pipeline segments, segment i on pipeline
stage i. The layer count is the number of layer symbols. No torch here: the config validates a pattern when it is
parsed.
"""

from __future__ import annotations

MAMBA, ATTENTION, MLP, MOE, PIPE = "M", "*", "-", "E", "|"
LAYER_SYMBOLS = (MAMBA, ATTENTION, MLP, MOE)
# Megatron's symbols this engine does not build, with what is missing (MTP's `/`, GDN, MLA and DSA layers).
_NOT_BUILT = {
    "/": "multi-token prediction (/) is not built in this engine",
    "G": "gated delta net layers (G) are not built in this engine",
    "+": "multi-latent attention layers (+) are not built in this engine",
    "D": "DeepSeek sparse attention layers (D) are not built in this engine",
}


def check_pattern(pattern: str) -> None:
    """Refuse a pattern with a symbol that is not a layer Megatron knows, or one this engine does not build,
    naming the flag, the symbol and its position."""
    if not pattern.replace(PIPE, ""):
        raise ValueError("--hybrid-layer-pattern has no layers: give one symbol (M, *, -, E) per layer")
    for position, symbol in enumerate(pattern):
        if symbol in (*LAYER_SYMBOLS, PIPE):
            continue
        reason = _NOT_BUILT.get(
            symbol, "it is none of M (Mamba), * (attention), - (MLP), E (MoE), | (stage cut)"
        )
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: symbol {symbol!r} at {position}: {reason}")
    if any(not segment for segment in pattern.split(PIPE)):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: a pipeline segment between | has no layers")


def layer_symbols(pattern: str | None, num_layers: int) -> str:
    """The layers, one symbol each, without the stage cuts; no pattern is `num_layers` Mamba layers (Megatron's
    pure Mamba model)."""
    return MAMBA * num_layers if pattern is None else pattern.replace(PIPE, "")


def hybrid_layer_count(pattern: str, num_layers: int | None) -> int:
    """The layer count the pattern gives; a --num-layers that disagrees is refused naming both."""
    check_pattern(pattern)
    count = len(pattern.replace(PIPE, ""))
    if num_layers is not None and num_layers != count:
        raise ValueError(
            f"--num-layers {num_layers} disagrees with --hybrid-layer-pattern {pattern!r}, which has {count} "
            "layers: drop --num-layers (the pattern sets it)"
        )
    return count


def moe_layer_flags(pattern: str) -> list[int]:
    """One 0/1 per layer: 1 where the pattern has an MoE layer (E). A hybrid model's MoE layers are these, not
    --moe-layer-freq's (Megatron's hybrid models take their layers from the pattern alone)."""
    return [int(symbol == MOE) for symbol in pattern.replace(PIPE, "")]


def pipeline_segments(pattern: str | None, num_layers: int) -> list[str]:
    """The layers cut at `|`: one segment per pipeline stage (no pattern: one segment)."""
    return [MAMBA * num_layers] if pattern is None else pattern.split(PIPE)


def segment_range(pattern: str | None, num_layers: int, segment: int) -> range:
    """The global layer numbers of pipeline segment `segment`."""
    segments = pipeline_segments(pattern, num_layers)
    start = sum(len(part) for part in segments[:segment])
    return range(start, start + len(segments[segment]))


def pattern_from_ratios(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """Megatron's pattern for the deprecated --hybrid-attention-ratio / --hybrid-mlp-ratio: attention layers
    spread evenly between Mamba layers, then MLP layers spread evenly over the remaining Mamba layers."""
    if not (0.0 <= attention_ratio <= 1.0 and 0.0 <= mlp_ratio <= 1.0 and attention_ratio + mlp_ratio <= 1.0):
        raise ValueError(
            f"--hybrid-attention-ratio {attention_ratio} and --hybrid-mlp-ratio {mlp_ratio} must lie in [0, 1] "
            "and add up to at most 1"
        )
    attention_count = round(num_layers * attention_ratio)
    mamba_count = num_layers - attention_count
    section = mamba_count / (attention_count + 1)
    layers = [MAMBA] * num_layers
    x = section
    for index in range(num_layers):
        if x < 0.5:
            layers[index] = ATTENTION
            x += section
        else:
            x -= 1
    mlp_count = round(num_layers * mlp_ratio)
    if mlp_count > 0:
        ratio = (mamba_count - mlp_count) / mlp_count
        x = ratio
        for index in range(num_layers):
            if layers[index] == MAMBA:
                if x < 0.5:
                    layers[index] = MLP
                    x += ratio
                else:
                    x -= 1
    return "".join(layers)
