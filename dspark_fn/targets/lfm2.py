"""The LFM2 family (mlx-lm ``lfm2``, ``lfm2_moe``) as a pure target forward.

LFM2 is a hybrid: most layers mix tokens with a gated short convolution (a
causal depthwise conv over the last ``conv_L_cache`` gated inputs), a few
(``full_attn_idxs``, or the ``full_attention`` entries of ``layer_types``)
with attention whose q and k heads are RMS-normed. Every layer is pre-norm
(``operator_norm``, ``ffn_norm``); the final norm is ``embedding_norm`` and
the logits always come from the embedding (mlx-lm's tree has no head).
LFM2-VL releases (``lfm2-vl``) run their text model and take images
through mlx-vlm's vision side. lfm2_moe replaces the dense feed-forward of
layers ``num_dense_layers ..`` with sigmoid-routed experts.

A convolution layer's cache entry is ``{"conv": [B, K - 1, d]}``, the last
gated inputs (``layers/recurrent.convolve``); attention layers own K/V buffers.
Its layer math lives in ``layers/lfm2.py``.
"""

from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import causal_mask, kv_buffers, positions_from
from ..interfaces import ImageInputs, ImageSide, Release, TargetAdapter, fresh_draft_geometry
from ..layers.lfm2 import AttentionGeometry, Routing, attention, dense_feed_forward, short_conv, sparse_moe
from .base import decoder_layers, stopping_at_prompt_end

LAYER_TYPES = ("full_attention", "conv")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "norm_eps", "conv_L_cache")
MOE_KEYS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "num_dense_layers")


@dataclass(frozen=True)
class Lfm2Spec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    eps: float
    rope_theta: float
    conv_size: int  # the convolution's kernel width (conv_L_cache)
    attention_layers: tuple  # indices of the full-attention layers; the others convolve
    geometry: AttentionGeometry
    num_dense_layers: int  # layers from here on use the routed experts
    routing: Routing | None


def attention_layers(config: dict) -> tuple:
    """The full-attention layer indices, as mlx-lm reads them: ``full_attn_idxs``
    when given, else the ``full_attention`` entries of ``layer_types``."""
    layers = config["num_hidden_layers"]
    if config.get("full_attn_idxs") is not None:
        indices = list(config["full_attn_idxs"])
    elif config.get("layer_types") is not None:
        kinds = list(config["layer_types"])
        unknown = sorted(set(kinds) - set(LAYER_TYPES))
        if unknown or len(kinds) != layers:
            raise ValueError(
                f"lfm2 layer_types must give one of {LAYER_TYPES} for each of the {layers} layers "
                f"(got {len(kinds)} entries{', unknown ' + str(unknown) if unknown else ''})"
            )
        indices = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    else:
        raise ValueError("lfm2 config names no attention layers: give full_attn_idxs or layer_types")
    outside = [i for i in indices if not 0 <= i < layers]
    if outside:
        raise ValueError(f"lfm2 full_attn_idxs {outside} outside the {layers} layers")
    if not indices:
        raise ValueError("lfm2 config has no full-attention layer (mlx-lm's lfm2 needs at least one)")
    return tuple(sorted(set(indices)))


def attention_geometry(config: dict) -> AttentionGeometry:
    """Heads as mlx-lm builds them: ``head_dim = hidden_size // num_attention_heads``."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"lfm2 heads do not divide: hidden_size {hidden}, num_attention_heads {heads}, "
            f"num_key_value_heads {kv_heads}"
        )
    return AttentionGeometry(num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, eps=config["norm_eps"])


def rope_theta(config: dict) -> float:
    """The RoPE base; mlx-lm's lfm2 runs plain RoPE, so a scaled variant is refused."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"lfm2 rope_type {kind!r} is not supported (plain RoPE only)")
    return float(rope.get("rope_theta", config.get("rope_theta", 1000000.0)))


def routing(config: dict) -> Routing | None:
    """lfm2_moe's router settings (None for the dense family)."""
    if config["model_type"] != "lfm2_moe":
        return None
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ValueError(f"lfm2_moe num_experts_per_tok {top_k} must be in 1..num_experts ({experts})")
    return Routing(
        top_k=top_k,
        norm_topk_prob=bool(config["norm_topk_prob"]),
        routed_scaling=float(config.get("routed_scaling_factor", 1.0)),
    )


def check_keys(config: dict) -> None:
    required = REQUIRED_KEYS + (MOE_KEYS if config["model_type"] == "lfm2_moe" else ())
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise ValueError(f"{config['model_type']} config lacks {', '.join(missing)}")
    if config["conv_L_cache"] < 1:
        raise ValueError(f"lfm2 conv_L_cache {config['conv_L_cache']} must be at least 1")


def spec_from_config(config: dict) -> Lfm2Spec:
    """The target spec of an lfm2 / lfm2_moe config; unsupported ones are refused with the reason."""
    check_keys(config)
    layers = config["num_hidden_layers"]
    moe = routing(config)
    return Lfm2Spec(
        model_type=config["model_type"],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=layers,
        eps=config["norm_eps"],
        rope_theta=rope_theta(config),
        conv_size=config["conv_L_cache"],
        attention_layers=attention_layers(config),
        geometry=attention_geometry(config),
        num_dense_layers=config["num_dense_layers"] if moe else layers,
        routing=moe,
    )


def init_kv(spec: Lfm2Spec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer: K/V buffers ``[B, H_kv, C, D]`` (attention) or the conv window ``{"conv": [B, K - 1, d]}``."""
    window = (batch, spec.conv_size - 1, spec.hidden_size)
    return [
        kv_buffers(batch, spec.geometry.num_kv_heads, capacity, spec.geometry.head_dim, dtype)
        if index in spec.attention_layers
        else {"conv": mx.zeros(window, dtype)}
        for index in range(spec.num_layers)
    ]


def feed_forward(spec: Lfm2Spec, index: int, p: dict, x: mx.array) -> mx.array:
    if index < spec.num_dense_layers:
        return dense_feed_forward(p, x)
    return sparse_moe(p, x, spec.routing)


def forward(spec: Lfm2Spec, params: dict, kv: list, tokens, start, taps: tuple, keep=None,
            images: ImageInputs | None = None):
    """Run ``tokens [B, L]`` at positions ``start[b] + i``: ``(final-normed hidden [B, L, d], taps [B, L, F], kv)``.

    Without ``keep`` the conv windows come back pending (``cache.settle`` keeps
    the accepted tokens'); with ``keep [B]`` only each row's first ``keep[b]``
    tokens advance them. With ``images`` (a prefill chunk) the image features
    replace the embeddings at image positions.
    """
    model = params["model"]
    positions = positions_from(start, tokens.shape[1])
    mask = causal_mask(positions, kv[spec.attention_layers[0]][0].shape[2])
    inv_freq = ops.rope_inv_freq(spec.geometry.head_dim, {"rope_theta": spec.rope_theta})
    h = ops.embed(model["embed_tokens"], tokens, spec.hidden_size)
    if images is not None:
        h = mx.where(images.mask[..., None], images.features.astype(h.dtype), h)

    def step(index, layer, entry, h):
        x = ops.rms_norm(h, layer["operator_norm"]["weight"], spec.eps)
        if index in spec.attention_layers:
            mixed, keys, values = attention(
                spec.geometry, layer["self_attn"], x, *entry, start, positions, mask, inv_freq
            )
            entry = (keys, values)
        else:
            mixed, window = short_conv(layer["conv"], x, entry["conv"], keep)
            entry = {"conv": window}
        h = h + mixed
        ffn = feed_forward(spec, index, layer["feed_forward"], ops.rms_norm(h, layer["ffn_norm"]["weight"], spec.eps))
        return h + ffn, entry

    h, features, new_kv = decoder_layers(h, model["layers"], kv, step, taps)
    return ops.rms_norm(h, model["embedding_norm"]["weight"], spec.eps), features, new_kv


def draft_geometry(config: dict) -> dict:
    """What a fresh draft copies: lfm2 names its dense feed-forward width ``block_ff_dim``."""
    width = config.get("intermediate_size") or config["block_ff_dim"]
    return fresh_draft_geometry({**config, "intermediate_size": width})


def image_features(vlm, inputs: dict) -> mx.array:
    """``[N, d]``: mlx-vlm's SigLIP2 tower, pixel unshuffle and projector over
    one prompt's images (every tile of each, in the order their tokens come)."""
    views = vlm.encode_images(inputs["pixel_values"], spatial_shapes=inputs["spatial_shapes"],
                              pixel_attention_mask=inputs["pixel_attention_mask"])
    return mx.concatenate(list(views), axis=0)


ADAPTER = TargetAdapter(
    model_types=("lfm2", "lfm2_moe"),
    releases=(Release("lfm2-vl", "lfm2", images=ImageSide(module="lfm2_vl", modules=(
        "vision_tower", "multi_modal_projector"), features=image_features)),),
    spec_from_config=spec_from_config, init_kv=init_kv, forward=forward,
    prompt_forward=stopping_at_prompt_end(forward), draft_geometry=draft_geometry,
)
