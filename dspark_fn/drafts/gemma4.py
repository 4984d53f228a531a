"""The gemma4 DSpark draft (DeepSpec ``Gemma4DSparkModel``).

Same scheme as the qwen3 draft (projected target taps give every layer its
context keys/values; the block attends to them and bidirectionally to
itself), built from gemma4 layers with the geometry of the target's
full-attention layers: ``global_head_dim`` heads, K=V without ``v_proj`` when
``attention_k_eq_v``, partial RoPE, scale 1, sandwich norms and
``layer_scalar``. Base logits are softcapped before the Markov bias.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import block_mask, block_positions, kv_buffers, positions_from, write_rows
from ..interfaces import DraftArch
from ..layers import gemma4 as family
from .base import DSparkFields, dspark_fields
from .heads import decoder_layer_shapes, frame_shapes, head_shapes


@dataclass(frozen=True)
class Gemma4DraftSpec(DSparkFields):
    num_layers: int
    num_heads: int
    attention: family.AttentionGeometry
    intermediate_size: int
    eps: float
    activation: str
    softcap: float | None


def spec_from_config(config: dict) -> Gemma4DraftSpec:
    """The draft spec from a DeepSpec gemma4 draft config (full-attention geometry of the target)."""
    family.reject_unsupported(config, "draft", per_layer_inputs=False)
    # Draft layers all use the target's full-attention parameters; the
    # top-level rope keys some draft configs carry are not read.
    return Gemma4DraftSpec(
        **dspark_fields(config),
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        attention=family.attention_geometry(config, "full_attention"),
        intermediate_size=config["intermediate_size"],
        eps=config.get("rms_norm_eps", 1e-6),
        activation=config.get("hidden_activation", "gelu_pytorch_tanh"),
        softcap=config.get("final_logit_softcapping"),
    )


def checkpoint_shapes(spec: Gemma4DraftSpec) -> dict:
    """Every checkpoint tensor ``{key: shape}`` (no ``v_proj`` when K = V)."""
    d, inter = spec.hidden_size, spec.intermediate_size
    attention = spec.attention
    shapes = frame_shapes(spec)
    for i in range(spec.num_layers):
        layer = f"layers.{i}."
        shapes |= decoder_layer_shapes(
            layer, d, spec.num_heads, attention.num_kv_heads, attention.head_dim, inter, not attention.k_eq_v
        )
        shapes |= {
            layer + "pre_feedforward_layernorm.weight": (d,),
            layer + "post_feedforward_layernorm.weight": (d,),
            layer + "layer_scalar": (1,),
        }
    return shapes | head_shapes(spec)


def init_context(spec: Gemma4DraftSpec, batch: int, capacity: int) -> list:
    """Per draft layer, empty context K/V buffers ``[B, H_kv, C, D]``."""
    geometry = spec.attention
    return [
        kv_buffers(batch, geometry.num_kv_heads, capacity, geometry.head_dim)
        for _ in range(spec.num_layers)
    ]


def extend_context(spec: Gemma4DraftSpec, params: dict, state: list, features, start) -> list:
    """Project ``features [B, L, F]`` and write their K/V at positions ``start[b] + i`` in every layer."""
    context = ops.rms_norm(ops.linear(params["fc"], features), params["hidden_norm"]["weight"], spec.eps)
    positions = positions_from(start, features.shape[1])
    new_state = []
    for layer, (keys, values) in zip(params["layers"], state):
        k, v = family.keys_values(spec.attention, layer["self_attn"], context, positions, spec.eps)
        new_state.append((write_rows(keys, k, start), write_rows(values, v, start)))
    return new_state


def block_forward(spec: Gemma4DraftSpec, params: dict, state: list, length, block_ids):
    """The block ``block_ids [B, G]`` at positions ``length[b] + k`` (or N blocks
    a row with ``length [B, N]``): ``(softcapped base logits [B, G, V'], hidden [B, G, d])``."""
    width = block_ids.shape[1]
    capacity = state[0][0].shape[2]
    positions = block_positions(length, width)
    mask = block_mask(length, capacity, width)
    h = family.scaled_embedding(params["embed_tokens"], block_ids, spec.hidden_size)
    for layer, (keys, values) in zip(params["layers"], state):
        attn = layer["self_attn"]
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        q = family.queries(spec.attention, attn, x, spec.num_heads, positions, spec.eps)
        block_keys, block_values = family.keys_values(spec.attention, attn, x, positions, spec.eps)
        all_keys = mx.concatenate([keys, block_keys], axis=2)
        all_values = mx.concatenate([values, block_values], axis=2)
        attended = ops.attention(q, all_keys, all_values, mask, family.ATTENTION_SCALE)
        h = family.finish_layer(layer, h, attended, spec.eps, spec.activation)
    hidden = ops.rms_norm(h, params["norm"]["weight"], spec.eps)
    return ops.softcap(ops.linear(params["lm_head"], hidden), spec.softcap), hidden


# DeepSpec names its Gemma draft after the gemma4_unified release's text model.
ARCH = DraftArch(model_types=("gemma4_text", "gemma4_unified_text"), spec_from_config=spec_from_config,
                 checkpoint_shapes=checkpoint_shapes, init_context=init_context, extend_context=extend_context,
                 block_forward=block_forward)
