"""The qwen3 DSpark draft (DeepSpec ``Qwen3DSparkModel``).

Context rows are the projected target taps ``hidden_norm(fc(taps))``; they
only provide keys/values (k_norm + RoPE at their own positions) to every
draft layer. The block ``[anchor, mask, ...]`` attends to that context and,
bidirectionally, to itself.

Drafts published in the ``dflash_config`` layout (``drafts/dflash.py``) run
this same backbone with options the spec carries, each defaulting to the
DeepSpec draft: causal block attention, sliding-window layers, a learned
per-head attention sink, drafting from the mask slots only, interleaved
RoPE and a logit softcap.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import block_mask, block_positions, kv_buffers, positions_from, write_rows
from ..interfaces import DraftArch
from ..layers.llama import AttentionFields, attention_fields
from .base import DSparkFields, dspark_fields
from .heads import decoder_layer_shapes, frame_shapes, head_shapes


@dataclass(frozen=True)
class Qwen3DraftSpec(DSparkFields, AttentionFields):
    intermediate_size: int
    causal: bool = False  # block slot k sees block slots <= k (else the whole block)
    layer_windows: tuple = ()  # per layer: a sliding window (int) or None for full attention; () = all full
    attention_sinks: bool = False  # every softmax also spends mass on a learned per-head sink logit
    sample_from_anchor: bool = True  # the anchor's slot drafts the first token (else G mask slots do)
    interleaved_rope: bool = False  # RoPE rotates pairs (x[2i], x[2i+1]) (GPT-J) instead of halves
    softcap: float | None = None


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
        if spec.attention_sinks:
            shapes[f"layers.{i}.self_attn.attention_sink_bias"] = (spec.num_heads,)
    return shapes | head_shapes(spec)


def init_context(spec: Qwen3DraftSpec, batch: int, capacity: int) -> list:
    """Per draft layer, empty context K/V buffers ``[B, H_kv, C, D]``."""
    return [
        kv_buffers(batch, spec.num_kv_heads, capacity, spec.head_dim)
        for _ in range(spec.num_layers)
    ]


def interleaved_rope(x: mx.array, positions: mx.array, inv_freq: mx.array) -> mx.array:
    """Rotary embedding of ``x [B, H, L, D]`` rotating adjacent pairs ``(x[2i], x[2i+1])`` (GPT-J layout)."""
    angles = positions.astype(mx.float32)[:, None, :, None] * inv_freq
    cos, sin = mx.cos(angles), mx.sin(angles)
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def _rotate(spec, x, positions, inv_freq):
    return (interleaved_rope if spec.interleaved_rope else ops.apply_rope)(x, positions, inv_freq)


def _keys(spec, attn, x, positions, inv_freq):
    """Normed, rotated keys ``[B, H_kv, L, D]`` of ``x [B, L, d]`` at ``positions [B, L]``."""
    k = ops.split_heads(ops.linear(attn["k_proj"], x), spec.num_kv_heads)
    k = ops.rms_norm(k, attn["k_norm"]["weight"], spec.eps)
    return _rotate(spec, k, positions, inv_freq)


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


def layer_mask(causal: bool, window: int | None, length, capacity: int, width: int) -> mx.array:
    """``[B, 1, W, C + W]`` over ``[context slots ; block]`` for the blocks of ``length`` (``cache.block_slots``).

    Bidirectional: every slot sees its whole block and the context, only its
    last ``window - 1`` rows in a sliding layer (the anchor's window).
    Causal: slot ``q`` sees earlier block slots and context, only positions
    after ``q - window`` in a sliding layer.
    """
    if not causal and window is not None:
        window = window - 1
    return block_mask(length, capacity, width, window, causal)


def sink_attention(q, k, v, mask: mx.array, scale: float, sinks: mx.array) -> mx.array:
    """Grouped-query attention whose softmax has one more logit per query
    head, ``sinks [H]``, with no value: it takes mass from every key."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped = (q * scale).reshape(batch, kv_heads, group, length, dim)
    scores = grouped @ k[:, :, None].swapaxes(-1, -2)
    scores = mx.where(mask[:, :, None], scores, mx.finfo(scores.dtype).min)
    sink = mx.broadcast_to(sinks.reshape(1, kv_heads, group, 1, 1).astype(scores.dtype), (*scores.shape[:-1], 1))
    weights = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    return (weights @ v[:, :, None]).reshape(batch, heads, length, -1).astype(q.dtype)


def _attend(spec, attn, q, keys, values, mask):
    scale = spec.head_dim**-0.5
    if spec.attention_sinks:
        return sink_attention(q, keys, values, mask, scale, attn["attention_sink_bias"])
    return ops.attention(q, keys, values, mask, scale)


def block_forward(spec: Qwen3DraftSpec, params: dict, state: list, length, block_ids):
    """The blocks ``block_ids [B, W]`` at ``length`` (``[B]``: one block a row at
    ``length[b] + k``; ``[B, N]``: N blocks a row, ``cache.block_slots``):
    ``(base logits [B, W, V'], hidden [B, W, d])``.

    Without ``sample_from_anchor`` each block runs one more mask slot and the
    anchor's own output is dropped: slot ``k`` drafts the token at ``length + k + 1``.
    """
    blocks = length.shape[1] if length.ndim == 2 else 1
    batch = block_ids.shape[0]
    if not spec.sample_from_anchor:
        per_block = block_ids.reshape(batch, blocks, -1)
        extra = mx.full((batch, blocks, 1), spec.mask_token_id, block_ids.dtype)
        block_ids = mx.concatenate([per_block, extra], axis=2).reshape(batch, -1)
    width = block_ids.shape[1]
    capacity = state[0][0].shape[2]
    positions = block_positions(length, width)
    inv_freq = ops.rope_inv_freq(spec.head_dim, dict(spec.rope))
    windows = spec.layer_windows or (None,) * spec.num_layers
    masks = {window: layer_mask(spec.causal, window, length, capacity, width) for window in set(windows)}
    h = ops.embed(params["embed_tokens"], block_ids, spec.hidden_size)
    for layer, (keys, values), window in zip(params["layers"], state, windows):
        attn = layer["self_attn"]
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        q = ops.split_heads(ops.linear(attn["q_proj"], x), spec.num_heads)
        q = _rotate(spec, ops.rms_norm(q, attn["q_norm"]["weight"], spec.eps), positions, inv_freq)
        all_keys = mx.concatenate([keys, _keys(spec, attn, x, positions, inv_freq)], axis=2)
        all_values = mx.concatenate([values, _values(spec, attn, x)], axis=2)
        out = _attend(spec, attn, q, all_keys, all_values, masks[window])
        h = h + ops.linear(attn["o_proj"], ops.merge_heads(out))
        x = ops.rms_norm(h, layer["post_attention_layernorm"]["weight"], spec.eps)
        h = h + ops.glu_mlp(layer["mlp"], x)
    hidden = ops.rms_norm(h, params["norm"]["weight"], spec.eps)
    if not spec.sample_from_anchor:
        hidden = hidden.reshape(batch, blocks, -1, hidden.shape[-1])[:, :, 1:].reshape(batch, -1, hidden.shape[-1])
    return ops.softcap(ops.linear(params["lm_head"], hidden), spec.softcap), hidden


def fresh_config(geometry: dict, layers: int) -> dict:
    """A DeepSpec qwen3 draft config of ``layers`` full-attention layers in a
    target's geometry (``TargetAdapter.draft_geometry``), DSpark keys aside."""
    return dict(
        geometry, model_type="qwen3", architectures=["Qwen3DSparkModel"], hidden_act="silu", attention_bias=False,
        tie_word_embeddings=False, num_hidden_layers=layers, layer_types=["full_attention"] * layers,
    )


ARCH = DraftArch(model_types=("qwen3",), spec_from_config=spec_from_config, checkpoint_shapes=checkpoint_shapes,
                 init_context=init_context, extend_context=extend_context, block_forward=block_forward,
                 fresh_config=fresh_config)
