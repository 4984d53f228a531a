"""The gemma4 text family (mlx-lm ``gemma4_text``) as a pure target forward.

Gemma4 interleaves sliding-window and full-attention layers of different
geometry: full layers use ``global_head_dim``, may read K and V from one
projection (``attention_k_eq_v``) and rotate only part of each head
("proportional" RoPE). Every layer normalises q, k and (without a weight) v,
attends with scale 1, wraps attention and MLP in sandwich norms and ends with
a learned ``layer_scalar``; embeddings are scaled by sqrt(d) and logits are
softcapped. The small models' per-layer token inputs and their KV sharing
between late layers are supported; MoE blocks are not.

The layer pieces here are shared with the gemma4 DSpark draft.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import causal_mask, kv_buffers, positions_from, write_rows
from .base import TargetAdapter

ATTENTION_SCALE = 1.0  # q and k are RMS-normalised per head instead of scaled


@dataclass(frozen=True)
class AttentionGeometry:
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # V is the raw k_proj output (no v_proj)
    rope: tuple  # sorted items of the layer type's rope parameters
    window: int | None  # sliding window; None for full attention


@dataclass(frozen=True)
class Gemma4Spec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    eps: float
    activation: str
    softcap: float | None
    tied: bool
    per_layer_input_size: int
    geometry: tuple  # AttentionGeometry of each layer
    num_kv_layers: int  # layers 0..num_kv_layers-1 own K/V buffers
    kv_source: tuple  # per layer: the buffers its attention reads


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


def kv_sources(layer_types: list, num_kv_layers: int) -> tuple:
    """Layers past ``num_kv_layers`` reuse the K/V of the last owning layer of their type."""
    last_of_type = {kind: i for i, kind in enumerate(layer_types[:num_kv_layers])}
    missing = set(layer_types) - set(last_of_type)
    if missing:
        raise ValueError(f"KV-shared gemma4 layers of type {sorted(missing)} have no layer to share from")
    return tuple(i if i < num_kv_layers else last_of_type[kind] for i, kind in enumerate(layer_types))


def spec_from_config(config: dict) -> Gemma4Spec:
    # The tree is built by mlx-lm from this config, so read it with mlx-lm's
    # own defaults for keys a config may leave out.
    from mlx_lm.models.gemma4_text import ModelArgs

    reject_unsupported(config, "target", per_layer_inputs=True)
    args = vars(ModelArgs.from_dict(config))
    layer_types = list(args["layer_types"])
    num_kv_layers = args["num_hidden_layers"] - args["num_kv_shared_layers"]
    return Gemma4Spec(
        model_type=config["model_type"],
        vocab_size=args["vocab_size"],
        hidden_size=args["hidden_size"],
        num_layers=args["num_hidden_layers"],
        num_heads=args["num_attention_heads"],
        eps=args["rms_norm_eps"],
        activation=config.get("hidden_activation", "gelu_pytorch_tanh"),
        softcap=args["final_logit_softcapping"],
        tied=args["tie_word_embeddings"],
        per_layer_input_size=args["hidden_size_per_layer_input"] or 0,
        geometry=tuple(attention_geometry(args, kind) for kind in layer_types),
        num_kv_layers=num_kv_layers,
        kv_source=kv_sources(layer_types, num_kv_layers),
    )


def init_kv(spec: Gemma4Spec, batch: int, capacity: int, dtype=mx.float32) -> list:
    return [
        kv_buffers(batch, g.num_kv_heads, capacity, g.head_dim, dtype)
        for g in spec.geometry[: spec.num_kv_layers]
    ]


def scaled_embedding(p: dict, ids: mx.array, hidden_size: int) -> mx.array:
    return ops.embed(p, ids, hidden_size) * hidden_size**0.5


def queries(geometry: AttentionGeometry, attn: dict, x, num_heads: int, positions, eps: float):
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


def per_layer_inputs(spec: Gemma4Spec, model: dict, tokens, embedded) -> list:
    """The small models' extra input of every layer: a per-layer token
    embedding mixed with a projection of the (scaled) input embedding."""
    batch, length = tokens.shape
    shape = (batch, length, spec.num_layers, spec.per_layer_input_size)
    looked_up = ops.embed(model["embed_tokens_per_layer"], tokens, spec.num_layers * spec.per_layer_input_size)
    looked_up = looked_up * spec.per_layer_input_size**0.5
    projected = ops.linear(model["per_layer_model_projection"], embedded) * spec.hidden_size**-0.5
    projected = ops.rms_norm(projected.reshape(shape), model["per_layer_projection_norm"]["weight"], spec.eps)
    mixed = (projected + looked_up.reshape(shape)) * 2**-0.5
    return [mixed[:, :, i] for i in range(spec.num_layers)]


def forward(spec: Gemma4Spec, params: dict, kv: list, tokens, start, taps: tuple):
    model = params["model"]
    positions = positions_from(start, tokens.shape[1])
    capacity = kv[0][0].shape[2]
    # Sliding layers mask the whole buffer by window, so rollback and windows
    # shorter than the sequence need no special casing.
    masks = {g.window: causal_mask(positions, capacity, g.window) for g in set(spec.geometry)}
    h = scaled_embedding(model["embed_tokens"], tokens, spec.hidden_size)
    extra = [None] * spec.num_layers
    if spec.per_layer_input_size:
        extra = per_layer_inputs(spec, model, tokens, h)
    kv, tapped = list(kv), {}
    for index, layer in enumerate(model["layers"]):
        geometry, attn = spec.geometry[index], layer["self_attn"]
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        q = queries(geometry, attn, x, spec.num_heads, positions, spec.eps)
        if index < spec.num_kv_layers:
            k, v = keys_values(geometry, attn, x, positions, spec.eps)
            keys, values = kv[index]
            kv[index] = (write_rows(keys, k, start), write_rows(values, v, start))
        keys, values = kv[spec.kv_source[index]]
        attended = ops.attention(q, keys, values, masks[geometry.window], ATTENTION_SCALE)
        h = finish_layer(layer, h, attended, spec.eps, spec.activation, extra[index])
        if index in taps:
            tapped[index] = h
    features = mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return ops.rms_norm(h, model["norm"]["weight"], spec.eps), features, kv


def logits(spec: Gemma4Spec, params: dict, hidden: mx.array) -> mx.array:
    head = params["model"]["embed_tokens"] if spec.tied else params["lm_head"]
    return ops.softcap(ops.linear(head, hidden), spec.softcap)


ADAPTER = TargetAdapter(spec_from_config, init_kv, forward, logits)
