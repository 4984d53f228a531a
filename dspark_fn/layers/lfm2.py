"""LFM2 layer math: the gated short convolution, attention with per-head q/k
RMSNorm, and the feed-forwards (a dense SwiGLU; for lfm2_moe, sigmoid-routed
SwiGLU experts). Pure functions over each module's mlx-lm parameter sub-tree.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import write_rows
from .moe import routed_experts
from .recurrent import convolve


@dataclass(frozen=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


@dataclass(frozen=True)
class Routing:
    top_k: int
    norm_topk_prob: bool
    routed_scaling: float


def short_conv(p: dict, x: mx.array, window: mx.array, keep: mx.array | None):
    """``out(C * conv(B * x))`` of ``x [B, L, d]``, with ``B, C, x`` the three
    thirds of ``in_proj``; the causal depthwise conv continues from ``window``
    (the previous ``K - 1`` gated inputs): ``(out [B, L, d], window entry)``."""
    gate_in, gate_out, inputs = mx.split(ops.linear(p["in_proj"], x), 3, axis=-1)
    conv = p["conv"]
    mixed, window = convolve(window, gate_in * inputs, conv["weight"], conv.get("bias"), keep)
    return ops.linear(p["out_proj"], gate_out * mixed), window


def attention(geometry: AttentionGeometry, p: dict, x, keys, values, start, positions, mask, inv_freq):
    """Self-attention with RMS-normed q and k heads, writing this call's K/V
    into the fixed buffers first: ``(out [B, L, d], keys, values)``."""
    q = ops.split_heads(ops.linear(p["q_proj"], x), geometry.num_heads)
    k = ops.split_heads(ops.linear(p["k_proj"], x), geometry.num_kv_heads)
    v = ops.split_heads(ops.linear(p["v_proj"], x), geometry.num_kv_heads)
    q = ops.apply_rope(ops.rms_norm(q, p["q_layernorm"]["weight"], geometry.eps), positions, inv_freq)
    k = ops.apply_rope(ops.rms_norm(k, p["k_layernorm"]["weight"], geometry.eps), positions, inv_freq)
    keys = write_rows(keys, k, start)
    values = write_rows(values, v, start)
    out = ops.attention(q, keys, values, mask, geometry.head_dim**-0.5)
    return ops.linear(p["out_proj"], ops.merge_heads(out)), keys, values


def dense_feed_forward(p: dict, x: mx.array) -> mx.array:
    """SwiGLU; lfm2 names its projections ``w1`` (gate), ``w3`` (up) and ``w2``
    (down), lfm2_moe's dense layers ``gate_proj``, ``up_proj``, ``down_proj``."""
    if "w1" in p:
        p = {"gate_proj": p["w1"], "up_proj": p["w3"], "down_proj": p["w2"]}
    return ops.glu_mlp(p, x, "silu")


def route(p: dict, x: mx.array, routing: Routing):
    """``(experts [..., k], weights [..., k])``: sigmoid scores of ``gate``;
    ``expert_bias``, when present, steers only which experts are picked."""
    scores = mx.sigmoid(ops.linear(p["gate"], x))
    ranked = scores.astype(mx.float32) + p["expert_bias"] if "expert_bias" in p else scores
    experts = mx.argpartition(-ranked, kth=routing.top_k - 1, axis=-1)[..., : routing.top_k]
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if routing.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
    return experts, (weights * routing.routed_scaling).astype(x.dtype)


def sparse_moe(p: dict, x: mx.array, routing: Routing) -> mx.array:
    """The routed SwiGLU experts (``switch_mlp``, weights stacked ``[E, ...]``), no shared expert."""
    experts, weights = route(p, x, routing)
    return routed_experts(p["switch_mlp"], x, experts, weights, limit=0.0)
