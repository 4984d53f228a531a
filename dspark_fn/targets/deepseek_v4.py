"""The DeepSeek-V4 family (mlx-vlm ``deepseek_v4``) as a pure target forward.

Every block wraps attention and a mixture of experts in hyper-connections
(``dspark_fn.mhc``, ``dspark_fn.moe``). Attention is multi-query over one
shared latent ``kv = kv_norm(wkv x)`` used as both key and value; queries come
from a low-rank projection and are RMS-normalised per head; only the last
``qk_rope_head_dim`` dims rotate (interleaved pairs), and the output's rotated
slice is turned back at the query position; a per-head sink logit joins the
softmax denominator; the output projection is low-rank per head group.

Supported: sliding-window layers (``compress_ratios`` entry 0) with score or
hash routing. Compressed layers (ratio 4 with the sparse indexer, ratio 128)
are rejected: their pooled keys summarise whole windows of committed tokens,
which needs a second, window-indexed buffer per layer and a rollback rule for
partly written windows that this module does not implement. Quantized (FP8 /
FP4) weights must be dequantized first.

Taps are the plain mean over the hyper-connection streams of the tapped
blocks' outputs, as in the reference and mlx-vlm; the last block may be
tapped (V4-Flash's drafter reads layers 40, 41, 42 of 43).

Parameters are mlx-vlm's ``language_model`` sub-tree. The pieces here are
shared with the deepseek_v4 DSpark draft.
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .. import mhc, ops
from ..cache import causal_mask, positions_from, write_rows
from ..moe import MoEConfig, moe
from .base import TargetAdapter


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


@dataclass(frozen=True)
class DeepseekV4Spec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    block: BlockSpec
    window: int
    num_hash_layers: int
    tied: bool
    last_layer_tappable: bool = True


def model_args(config: dict) -> dict:
    """The config read with mlx-vlm's defaults (the tree is built from them)."""
    from mlx_vlm.models.deepseek_v4.config import ModelConfig

    return vars(ModelConfig.from_dict(config))


def block_spec(args: dict) -> BlockSpec:
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
        hyper=mhc.HyperConfig(args["hc_mult"], args["hc_sinkhorn_iters"], args["hc_eps"], args["rms_norm_eps"]),
        moe=MoEConfig(
            top_k=args["num_experts_per_tok"],
            scoring=args["scoring_func"],
            norm_topk_prob=args["norm_topk_prob"],
            routed_scaling=args["routed_scaling_factor"],
            swiglu_limit=args["swiglu_limit"],
        ),
    )


def spec_from_config(config: dict) -> DeepseekV4Spec:
    args = model_args(config)
    compressed = [i for i, ratio in enumerate(args["compress_ratios"]) if ratio]
    if compressed:
        raise ValueError(
            f"unsupported deepseek_v4 target: layers {compressed} are compressed-attention layers "
            f"(compress_ratios {args['compress_ratios']}); only sliding-window layers (ratio 0) are supported"
        )
    if args["vision_n_layers"]:
        raise ValueError("unsupported deepseek_v4 target: vision layers (vision_n_layers > 0)")
    return DeepseekV4Spec(
        model_type=config["model_type"],
        vocab_size=args["vocab_size"],
        hidden_size=args["hidden_size"],
        num_layers=args["num_hidden_layers"],
        block=block_spec(args),
        window=args["sliding_window"],
        num_hash_layers=args["num_hash_layers"],
        tied=args["tie_word_embeddings"],
    )


def load_params(directory) -> dict:
    """The ``language_model`` tree through mlx-vlm's loader, which knows the checkpoint layout."""
    from mlx_vlm.utils import load_model

    model = load_model(Path(directory), lazy=False)
    return tree_unflatten(tree_flatten(model.language_model.parameters()))


def init_kv(spec: DeepseekV4Spec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer one latent buffer ``[B, 1, capacity, head_dim]`` (keys are the values)."""
    return [(mx.zeros((batch, 1, capacity, spec.block.head_dim), dtype),) for _ in range(spec.num_layers)]


# ---- block pieces shared with the draft


def rope_inv_freq(spec: BlockSpec) -> mx.array:
    return spec.rope_theta ** (-mx.arange(0, spec.rope_dim, 2, dtype=mx.float32) / spec.rope_dim)


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


def queries(spec: BlockSpec, attn: dict, x, positions, inv_freq) -> mx.array:
    """``[B, H, L, D]``: low-rank, then RMS-normalised per head without a weight, then rotated."""
    low_rank = ops.rms_norm(ops.linear(attn["wq_a"], x), attn["q_norm"]["weight"], spec.eps)
    q = ops.split_heads(ops.linear(attn["wq_b"], low_rank), spec.num_heads)
    return rotate_tail(ops.rms_norm(q, None, spec.eps), positions, inv_freq)


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
    low_rank = per_group @ attn["wo_a"]["weight"].swapaxes(-1, -2)  # [B, G, L, R]
    return ops.linear(attn["wo_b"], low_rank.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def attend(spec: BlockSpec, attn: dict, q, keys, mask, positions, inv_freq) -> mx.array:
    """Sink attention over the latent rows ``keys`` (also the values), then the output projection."""
    sinks = attn["attn_sink"].astype(q.dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, keys, scale=spec.head_dim**-0.5, mask=mask, sinks=sinks)
    return grouped_output(spec, attn, rotate_tail(out, positions, inv_freq, inverse=True))


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
    return mhc.expand(ops.embed(embed_tokens, tokens, spec.hidden_size), spec.hyper.streams)


def tap(streams: mx.array) -> mx.array:
    """A block's tapped feature: the mean over its hyper-connection streams."""
    return streams.mean(axis=-2)


# ---- the target forward


def forward(spec: DeepseekV4Spec, params: dict, kv: list, tokens, start, taps: tuple):
    model, geometry = params["model"], spec.block
    positions = positions_from(start, tokens.shape[1])
    mask = causal_mask(positions, kv[0][0].shape[2], spec.window)
    inv_freq = rope_inv_freq(geometry)

    def self_attention(layer, buffer):
        def attention(x):
            attn = layer["attn"]
            written = write_rows(buffer, latents(geometry, attn, x, positions, inv_freq), start)
            q = queries(geometry, attn, x, positions, inv_freq)
            return attend(geometry, attn, q, written, mask, positions, inv_freq), written

        return attention

    streams = embedded_streams(geometry, model["embed_tokens"], tokens)
    new_kv, tapped = [], {}
    for index, (layer, (buffer,)) in enumerate(zip(model["layers"], kv)):
        hashed = tokens if index < spec.num_hash_layers else None
        streams, buffer = block(geometry, layer, streams, self_attention(layer, buffer), hashed)
        new_kv.append((buffer,))
        if index in taps:
            tapped[index] = tap(streams)
    features = mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    hidden = ops.rms_norm(mhc.head(model["hc_head"], streams, geometry.hyper), model["norm"]["weight"], spec.block.eps)
    return hidden, features, new_kv


def logits(spec: DeepseekV4Spec, params: dict, hidden: mx.array) -> mx.array:
    head = params["model"]["embed_tokens"] if spec.tied else params["lm_head"]
    return ops.linear(head, hidden)


ADAPTER = TargetAdapter(spec_from_config, init_kv, forward, logits, load_params)
