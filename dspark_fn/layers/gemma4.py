"""Gemma 4 layer math shared by the gemma4 target and its DSpark draft.

Every layer normalises q, k and (without a weight) v, attends with scale 1,
wraps attention and MLP in sandwich norms and ends with a learned
``layer_scalar``; full-attention layers use ``global_head_dim``, may read K
and V from one projection (``attention_k_eq_v``) and rotate only part of each
head ("proportional" RoPE); embeddings are scaled by sqrt(d).
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops

ATTENTION_SCALE = 1.0  # q and k are RMS-normalised per head instead of scaled


@dataclass(frozen=True)
class AttentionGeometry:
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # V is the raw k_proj output (no v_proj)
    rope: tuple  # sorted items of the layer type's rope parameters
    window: int | None  # sliding window; None for full attention


def attention_geometry(config: dict, layer_type: str) -> AttentionGeometry:
    """Head geometry and RoPE of a ``sliding_attention`` or ``full_attention`` layer."""
    full = layer_type == "full_attention"
    k_eq_v = full and bool(config.get("attention_k_eq_v"))
    kv_heads = config["num_key_value_heads"]
    if k_eq_v and config.get("num_global_key_value_heads") is not None:
        kv_heads = config["num_global_key_value_heads"]
    head_dim = (config.get("global_head_dim") or config["head_dim"]) if full else config["head_dim"]
    rope = (config.get("rope_parameters") or {}).get(layer_type)
    if not isinstance(rope, dict):
        raise ValueError(f"gemma4 config lacks rope_parameters[{layer_type!r}]")
    return AttentionGeometry(
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        k_eq_v=k_eq_v,
        rope=tuple(sorted(rope.items())),
        window=None if full else config["sliding_window"],
    )


def reject_unsupported(config: dict, what: str, per_layer_inputs: bool) -> None:
    """Raise for the gemma4 variants this code does not run, saying which."""
    problems = []
    if config.get("enable_moe_block"):
        problems.append("MoE blocks (enable_moe_block)")
    if config.get("use_bidirectional_attention") == "all":
        problems.append("bidirectional attention (an embedding model)")
    per_layer_size = config.get("hidden_size_per_layer_input")
    if per_layer_size and not per_layer_inputs:
        problems.append(f"per-layer inputs (hidden_size_per_layer_input={per_layer_size}, must be 0)")
    if problems:
        raise ValueError(f"gemma4 {what} uses unsupported features: " + "; ".join(problems))


def scaled_embedding(p: dict, ids: mx.array, hidden_size: int) -> mx.array:
    """Token embeddings ``[B, L, d]`` scaled by ``sqrt(d)``."""
    return ops.embed(p, ids, hidden_size) * hidden_size**0.5


def queries(geometry: AttentionGeometry, attn: dict, x, num_heads: int, positions, eps: float):
    """Normed, rotated queries ``[B, H, L, D]`` of ``x [B, L, d]`` at ``positions [B, L]``."""
    q = ops.split_heads(ops.linear(attn["q_proj"], x), num_heads)
    q = ops.rms_norm(q, attn["q_norm"]["weight"], eps)
    return ops.apply_rope(q, positions, ops.rope_inv_freq(geometry.head_dim, dict(geometry.rope)))


def keys_values(geometry: AttentionGeometry, attn: dict, x, positions, eps: float):
    """Normed, rotated keys and weightless-normed values ``[B, H_kv, L, D]``."""
    raw_keys = ops.split_heads(ops.linear(attn["k_proj"], x), geometry.num_kv_heads)
    if geometry.k_eq_v:
        raw_values = raw_keys
    else:
        raw_values = ops.split_heads(ops.linear(attn["v_proj"], x), geometry.num_kv_heads)
    keys = ops.rms_norm(raw_keys, attn["k_norm"]["weight"], eps)
    keys = ops.apply_rope(keys, positions, ops.rope_inv_freq(geometry.head_dim, dict(geometry.rope)))
    return keys, ops.rms_norm(raw_values, None, eps)


def finish_layer(layer: dict, h, attended, eps: float, activation: str, per_layer_input=None):
    """Everything after attention: sandwich-normed residuals, the optional
    per-layer input gate, then ``layer_scalar``. ``attended`` is ``[B, H, L, D]``."""
    out = ops.linear(layer["self_attn"]["o_proj"], ops.merge_heads(attended))
    h = h + ops.rms_norm(out, layer["post_attention_layernorm"]["weight"], eps)
    x = ops.rms_norm(h, layer["pre_feedforward_layernorm"]["weight"], eps)
    mlp = ops.glu_mlp(layer["mlp"], x, activation)
    h = h + ops.rms_norm(mlp, layer["post_feedforward_layernorm"]["weight"], eps)
    if per_layer_input is not None:
        gate = ops.gelu_tanh_glu(ops.linear(layer["per_layer_input_gate"], h), per_layer_input)
        gate = ops.linear(layer["per_layer_projection"], gate)
        h = h + ops.rms_norm(gate, layer["post_per_layer_input_norm"]["weight"], eps)
    return h * layer["layer_scalar"]
