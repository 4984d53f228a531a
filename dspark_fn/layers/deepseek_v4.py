"""DeepSeek-V4 block math shared by the deepseek_v4 target and its DSpark draft.

Every block wraps attention and a mixture of experts in hyper-connections
(``layers/mhc.py``, ``layers/moe.py``). Attention is multi-query over one
shared latent ``kv = kv_norm(wkv x)`` used as both key and value; queries come
from a low-rank projection and are RMS-normalised per head; only the last
``qk_rope_head_dim`` dims rotate (interleaved pairs), and the output's rotated
slice is turned back at the query position; a per-head sink logit joins the
softmax denominator; the output projection is low-rank per head group.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..optional import require_vlm
from . import mhc
from .moe import MoEConfig, moe


@dataclass(frozen=True)
class BlockSpec:
    """Geometry of one V4 block, shared by target layers and draft stages."""

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int  # the last rope_dim dims of each head rotate
    rope_theta: float
    groups: int  # o_groups of the low-rank output projection
    eps: float
    hyper: mhc.HyperConfig
    moe: MoEConfig


def model_args(config: dict) -> dict:
    """The config read with mlx-vlm's defaults (the tree is built from them)."""
    require_vlm("a deepseek_v4 model")
    from mlx_vlm.models.deepseek_v4.config import ModelConfig

    return vars(ModelConfig.from_dict(config))


def block_spec(args: dict) -> BlockSpec:
    """The ``BlockSpec`` of mlx-vlm model args (one shared K=V latent only)."""
    if args["num_key_value_heads"] != 1:
        raise ValueError(
            f"deepseek_v4 attention has one shared K=V latent, got num_key_value_heads={args['num_key_value_heads']}"
        )
    return BlockSpec(
        hidden_size=args["hidden_size"],
        num_heads=args["num_attention_heads"],
        head_dim=args["head_dim"],
        rope_dim=args["qk_rope_head_dim"],
        rope_theta=float(args["rope_theta"]),
        groups=args["o_groups"],
        eps=args["rms_norm_eps"],
        hyper=mhc.HyperConfig(streams=args["hc_mult"], sinkhorn_iters=args["hc_sinkhorn_iters"], eps=args["hc_eps"],
                              norm_eps=args["rms_norm_eps"]),
        moe=MoEConfig(top_k=args["num_experts_per_tok"], scoring=args["scoring_func"],
                      norm_topk_prob=args["norm_topk_prob"], routed_scaling=args["routed_scaling_factor"],
                      swiglu_limit=args["swiglu_limit"]),
    )


def rope_inv_freq(spec: BlockSpec, rope: dict | None = None) -> mx.array:
    """Inverse frequencies ``[rope_dim / 2]`` of the rotated tail: plain at
    ``rope_theta`` (sliding-window layers), or from a rope dict (compressed
    layers: ``compress_rope_theta`` with the config's scaling)."""
    return ops.rope_inv_freq(spec.rope_dim, rope or {"rope_theta": spec.rope_theta})


def rotate_tail(x: mx.array, positions: mx.array, inv_freq: mx.array, inverse: bool = False) -> mx.array:
    """Rotate interleaved pairs of the last ``2 * len(inv_freq)`` dims of
    ``x [B, H, L, D]`` at ``positions [B, L]``; ``inverse`` turns them back."""
    rotated_dims = 2 * inv_freq.shape[0]
    angles = positions.astype(mx.float32)[:, None, :, None] * inv_freq
    if inverse:
        angles = -angles
    cos, sin = mx.cos(angles), mx.sin(angles)
    kept, tail = x[..., :-rotated_dims], x[..., -rotated_dims:]
    pairs = tail.reshape(*tail.shape[:-1], rotated_dims // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = mx.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return mx.concatenate([kept, turned.reshape(tail.shape).astype(x.dtype)], axis=-1)


def query_residual(spec: BlockSpec, attn: dict, x) -> mx.array:
    """The normed low-rank query ``[B, L, q_lora_rank]`` (the indexer reads it too)."""
    return ops.rms_norm(ops.linear(attn["wq_a"], x), attn["q_norm"]["weight"], spec.eps)


def query_heads(spec: BlockSpec, attn: dict, residual, positions, inv_freq) -> mx.array:
    """``[B, H, L, D]`` from the low-rank query: RMS-normalised per head without a weight, then rotated."""
    q = ops.split_heads(ops.linear(attn["wq_b"], residual), spec.num_heads)
    return rotate_tail(ops.rms_norm(q, None, spec.eps), positions, inv_freq)


def queries(spec: BlockSpec, attn: dict, x, positions, inv_freq) -> mx.array:
    """``[B, H, L, D]`` queries of ``x``."""
    return query_heads(spec, attn, query_residual(spec, attn, x), positions, inv_freq)


def latents(spec: BlockSpec, attn: dict, x, positions, inv_freq) -> mx.array:
    """The shared key/value rows ``[B, 1, L, D]``."""
    kv = ops.rms_norm(ops.linear(attn["wkv"], x), attn["kv_norm"]["weight"], spec.eps)
    return rotate_tail(kv[:, None], positions, inv_freq)


def grouped_output(spec: BlockSpec, attn: dict, out: mx.array) -> mx.array:
    """``wo_b(concat_g wo_a[g](heads of group g))`` for ``out [B, H, L, D]``."""
    batch, heads, length, dim = out.shape
    groups = spec.groups
    per_group = out.reshape(batch, groups, heads // groups, length, dim).transpose(0, 1, 3, 2, 4)
    per_group = per_group.reshape(batch, groups, length, -1)
    low_rank = ops.grouped_linear(attn["wo_a"], per_group)  # [B, G, L, R]
    return ops.linear(attn["wo_b"], low_rank.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def attention_output(spec: BlockSpec, attn: dict, out, positions, inv_freq) -> mx.array:
    """``[B, L, d]``: the heads' rotated tail turned back at the query position, then the output projection."""
    return grouped_output(spec, attn, rotate_tail(out, positions, inv_freq, inverse=True))


def attend(spec: BlockSpec, attn: dict, q, keys, mask, positions, inv_freq) -> mx.array:
    """Sink attention over the latent rows ``keys`` (also the values), then the output projection."""
    sinks = attn["attn_sink"].astype(q.dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, keys, scale=spec.head_dim**-0.5, mask=mask, sinks=sinks)
    return attention_output(spec, attn, out, positions, inv_freq)


def block(spec: BlockSpec, layer: dict, streams, attention, token_ids=None):
    """One hyper-connected block: ``attention(x) -> (y, state)`` then the MoE.

    Returns the new streams ``[B, L, hc, d]`` and the attention's state.
    """
    x, post, comb = mhc.pre_mix(layer["attn_hc"], streams, spec.hyper)
    y, state = attention(ops.rms_norm(x, layer["attn_norm"]["weight"], spec.eps))
    streams = mhc.post_mix(y, streams, post, comb)
    x, post, comb = mhc.pre_mix(layer["ffn_hc"], streams, spec.hyper)
    y = moe(layer["ffn"], ops.rms_norm(x, layer["ffn_norm"]["weight"], spec.eps), spec.moe, token_ids)
    return mhc.post_mix(y, streams, post, comb), state


def embedded_streams(spec: BlockSpec, embed_tokens: dict, tokens) -> mx.array:
    """Token embeddings ``[B, L, d]`` copied to the hyper-connection streams: ``[B, L, hc, d]``."""
    return mhc.expand(ops.embed(embed_tokens, tokens, spec.hidden_size), spec.hyper.streams)
