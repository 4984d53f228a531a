"""The qwen3 DSpark draft (DeepSpec ``Qwen3DSparkModel``).

Context rows are the projected target taps ``hidden_norm(fc(taps))``; they
only provide keys/values (k_norm + RoPE at their own positions) to every
draft layer. The block ``[anchor, mask, ...]`` attends to that context and,
bidirectionally, to itself.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import block_mask, kv_buffers, positions_from, write_rows
from ..layers.llama import AttentionFields, attention_fields
from .base import DraftArch, DSparkFields, dspark_fields
from .heads import decoder_layer_shapes, frame_shapes, head_shapes


@dataclass(frozen=True)
class Qwen3DraftSpec(DSparkFields, AttentionFields):
    intermediate_size: int


def spec_from_config(config: dict) -> Qwen3DraftSpec:
    """The draft spec from a DeepSpec qwen3 draft config."""
    fields = dspark_fields(config) | attention_fields(config)
    return Qwen3DraftSpec(**fields, intermediate_size=config["intermediate_size"])


def checkpoint_shapes(spec: Qwen3DraftSpec) -> dict:
    """Every checkpoint tensor ``{key: shape}`` of the draft."""
    shapes = frame_shapes(spec)
    for i in range(spec.num_layers):
        shapes |= decoder_layer_shapes(
            f"layers.{i}.", spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
        )
    return shapes | head_shapes(spec)


def init_context(spec: Qwen3DraftSpec, batch: int, capacity: int) -> list:
    """Per draft layer, empty context K/V buffers ``[B, H_kv, C, D]``."""
    return [
        kv_buffers(batch, spec.num_kv_heads, capacity, spec.head_dim)
        for _ in range(spec.num_layers)
    ]


def _keys(spec, attn, x, positions, inv_freq):
    """Normed, rotated keys ``[B, H_kv, L, D]`` of ``x [B, L, d]`` at ``positions [B, L]``."""
    k = ops.split_heads(ops.linear(attn["k_proj"], x), spec.num_kv_heads)
    k = ops.rms_norm(k, attn["k_norm"]["weight"], spec.eps)
    return ops.apply_rope(k, positions, inv_freq)


def _values(spec, attn, x):
    """Values ``[B, H_kv, L, D]`` of ``x [B, L, d]``."""
    return ops.split_heads(ops.linear(attn["v_proj"], x), spec.num_kv_heads)


def extend_context(spec: Qwen3DraftSpec, params: dict, state: list, features, start) -> list:
    """Project ``features [B, L, F]`` to context rows and write their K/V at positions ``start[b] + i`` in every layer."""
    context = ops.rms_norm(ops.linear(params["fc"], features), params["hidden_norm"]["weight"], spec.eps)
    positions = positions_from(start, features.shape[1])
    inv_freq = ops.rope_inv_freq(spec.head_dim, dict(spec.rope))
    new_state = []
    for layer, (keys, values) in zip(params["layers"], state):
        attn = layer["self_attn"]
        keys = write_rows(keys, _keys(spec, attn, context, positions, inv_freq), start)
        values = write_rows(values, _values(spec, attn, context), start)
        new_state.append((keys, values))
    return new_state


def block_forward(spec: Qwen3DraftSpec, params: dict, state: list, length, block_ids):
    """The block ``block_ids [B, G]`` at positions ``length[b] + k``: ``(base logits [B, G, V'], hidden [B, G, d])``."""
    width = block_ids.shape[1]
    capacity = state[0][0].shape[2]
    positions = positions_from(length, width)
    inv_freq = ops.rope_inv_freq(spec.head_dim, dict(spec.rope))
    mask = block_mask(length, capacity, width)
    h = ops.embed(params["embed_tokens"], block_ids, spec.hidden_size)
    for layer, (keys, values) in zip(params["layers"], state):
        attn = layer["self_attn"]
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        q = ops.split_heads(ops.linear(attn["q_proj"], x), spec.num_heads)
        q = ops.apply_rope(ops.rms_norm(q, attn["q_norm"]["weight"], spec.eps), positions, inv_freq)
        all_keys = mx.concatenate([keys, _keys(spec, attn, x, positions, inv_freq)], axis=2)
        all_values = mx.concatenate([values, _values(spec, attn, x)], axis=2)
        out = ops.attention(q, all_keys, all_values, mask, spec.head_dim**-0.5)
        h = h + ops.linear(attn["o_proj"], ops.merge_heads(out))
        x = ops.rms_norm(h, layer["post_attention_layernorm"]["weight"], spec.eps)
        h = h + ops.glu_mlp(layer["mlp"], x)
    hidden = ops.rms_norm(h, params["norm"]["weight"], spec.eps)
    return ops.linear(params["lm_head"], hidden), hidden


ARCH = DraftArch(spec_from_config=spec_from_config, checkpoint_shapes=checkpoint_shapes, init_context=init_context,
                 extend_context=extend_context, block_forward=block_forward)
