"""The gemma4 text family (mlx-lm ``gemma4_text``) as a pure target forward.

Gemma4 interleaves sliding-window and full-attention layers of different
geometry: full layers use ``global_head_dim``, may read K and V from one
projection (``attention_k_eq_v``) and rotate only part of each head
("proportional" RoPE). Every layer normalises q, k and (without a weight) v,
attends with scale 1, wraps attention and MLP in sandwich norms and ends with
a learned ``layer_scalar``; embeddings are scaled by sqrt(d) and logits are
softcapped. The small models' per-layer token inputs and their KV sharing
between late layers are supported (a pipeline split keeps a sharing layer on
its source's rank); MoE blocks are not. The multimodal releases (``gemma4``,
``gemma4_unified``) run their text model, and take images through
mlx-vlm's vision side (the prefill's image spans attend both ways).

Its layer math lives in ``layers/gemma4.py``, shared with the gemma4 DSpark draft.
"""

from dataclasses import dataclass, replace

import mlx.core as mx

from .. import ops
from ..cache import causal_mask, kv_buffers, positions_from, span_mask, write_rows
from ..interfaces import ImageInputs, ImageSide, Layout, Release, TargetAdapter
from ..layers.gemma4 import (
    ATTENTION_SCALE,
    AttentionGeometry,
    attention_geometry,
    finish_layer,
    keys_values,
    queries,
    reject_unsupported,
    scaled_embedding,
)
from ..sharding import Ranks, input_columns, output_rows, vocabulary_rows
from .base import decoder_layers, model_fields


LAYOUT = Layout()  # mlx-lm's gemma4_text tree


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
    """The target spec, read with mlx-lm's defaults; unsupported variants are refused with the reason."""
    from mlx_lm.models.gemma4_text import ModelArgs

    reject_unsupported(config, "target", per_layer_inputs=True)
    args = vars(ModelArgs.from_dict(config))
    layer_types = list(args["layer_types"])
    num_kv_layers = args["num_hidden_layers"] - args["num_kv_shared_layers"]
    return Gemma4Spec(
        **model_fields(config, args),
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
    """K/V buffers ``[B, H_kv, C, D]`` for the layers that own them (the others share)."""
    return [
        kv_buffers(batch, g.num_kv_heads, capacity, g.head_dim, dtype)
        for g in spec.geometry[: spec.num_kv_layers]
    ]


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


def forward(spec: Gemma4Spec, params: dict, kv: list, tokens, start, taps: tuple, images: ImageInputs | None = None):
    """Run ``tokens [B, L]`` at positions ``start[b] + i``: ``(final-normed hidden [B, L, d], taps [B, L, F], kv)``.

    With ``images`` (a prefill chunk) the image features replace the
    embeddings at image positions, the per-layer inputs read the pad token
    there, and each image span attends to itself whole (both ways), as the
    release's vision attention does; the chunks never cut a span."""
    model = params["model"]
    positions = positions_from(start, tokens.shape[1])
    capacity = kv[0][0].shape[2]
    # Sliding layers mask the whole buffer by window, so rollback and windows
    # shorter than the sequence need no special casing.
    masks = {g.window: causal_mask(positions, capacity, g.window) for g in set(spec.geometry)}
    h = scaled_embedding(model["embed_tokens"], tokens, spec.hidden_size)
    if images is not None:
        h = mx.where(images.mask[..., None], images.features.astype(h.dtype), h)
        tokens = mx.where(images.mask, 0, tokens)
        spans = span_mask(images.spans, start, capacity)
        masks = {window: mask | spans for window, mask in masks.items()}
    extra = [None] * spec.num_layers
    if spec.per_layer_input_size:
        extra = per_layer_inputs(spec, model, tokens, h)
    kv = list(kv)  # buffers of the first num_kv_layers layers; the later ones read an earlier layer's

    def step(index, layer, state, h):
        geometry, attn = spec.geometry[index], layer["self_attn"]
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        q = queries(geometry, attn, x, spec.num_heads, positions, spec.eps)
        if index < spec.num_kv_layers:
            k, v = keys_values(geometry, attn, x, positions, spec.eps)
            keys, values = kv[index]
            kv[index] = (write_rows(keys, k, start), write_rows(values, v, start))
        keys, values = kv[spec.kv_source[index]]
        attended = ops.attention(q, keys, values, masks[geometry.window], ATTENTION_SCALE)
        return finish_layer(layer, h, attended, spec.eps, spec.activation, extra[index]), None

    h, features, _ = decoder_layers(h, model["layers"], [None] * spec.num_layers, step, taps)
    return ops.rms_norm(h, model["norm"]["weight"], spec.eps), features, kv


def logits(spec: Gemma4Spec, params: dict, hidden: mx.array) -> mx.array:
    """Softcapped output logits ``[..., V]`` of final-normed ``hidden``."""
    return ops.softcap(LAYOUT.logits(spec, params, hidden), spec.softcap)


def pipeline_links(spec: Gemma4Spec) -> tuple:
    """The KV-shared layers and the layers whose keys and values they read."""
    return tuple((index, source) for index, source in enumerate(spec.kv_source) if source != index)


def shard_tensor(spec: Gemma4Spec, params: dict, ranks: Ranks) -> tuple[Gemma4Spec, dict]:
    """This rank's share (``sharding.py``): whole query and key/value heads of
    each layer's geometry, its MLP columns, its stretch of the vocabulary in
    both embeddings; the per-layer input projections stay whole (they are small)."""

    def layer(p: dict, geometry: AttentionGeometry) -> dict:
        attn, mlp = dict(p["self_attn"]), p["mlp"]
        attn["q_proj"] = output_rows(attn["q_proj"], ranks, "query heads", geometry.head_dim)
        for name in ("k_proj", "v_proj"):
            if name in attn:
                attn[name] = output_rows(attn[name], ranks, "key/value heads", geometry.head_dim)
        attn["o_proj"] = input_columns(attn["o_proj"], ranks, "attention output columns")
        mlp = dict(mlp, gate_proj=output_rows(mlp["gate_proj"], ranks, "MLP columns"),
                   up_proj=output_rows(mlp["up_proj"], ranks, "MLP columns"),
                   down_proj=input_columns(mlp["down_proj"], ranks, "MLP columns"))
        return dict(p, self_attn=attn, mlp=mlp)

    model = dict(params["model"])
    model["layers"] = [layer(p, g) for p, g in zip(model["layers"], spec.geometry)]
    for table in ("embed_tokens", "embed_tokens_per_layer"):
        if table in model:
            model[table] = vocabulary_rows(model[table], ranks)
    sharded = dict(params, model=model)
    if not spec.tied:
        sharded["lm_head"] = vocabulary_rows(params["lm_head"], ranks)
    geometry = tuple(replace(g, num_kv_heads=g.num_kv_heads // ranks.size) for g in spec.geometry)
    return replace(spec, num_heads=spec.num_heads // ranks.size, geometry=geometry), sharded


def tensor_splits(config: dict) -> dict:
    """What ``shard_tensor`` divides by the number of ranks, read from the config alone."""
    spec = spec_from_config(config)
    return {"query heads": spec.num_heads, "MLP columns": config["intermediate_size"], "vocabulary rows": spec.vocab_size,
            **{f"key/value heads of {'full' if g.window is None else 'sliding'} layers": g.num_kv_heads
               for g in spec.geometry}}


def image_features(vlm, inputs: dict) -> mx.array:
    """``[N, d]``: mlx-vlm's vision tower (or unified embedder) and projector over one prompt's images."""
    features = vlm.encode_image(inputs["pixel_values"], inputs.get("image_position_ids"))
    return features.reshape(-1, features.shape[-1])


def vision_attention(text_config: dict) -> bool:
    """Whether an image's tokens attend to one another both ways in the prefill."""
    return text_config.get("use_bidirectional_attention") == "vision"


# The multimodal releases' vision and audio towers (mlx-lm's and mlx-vlm's names).
TOWERS = ("vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision", "vision_embedder")

ADAPTER = TargetAdapter(
    model_types=("gemma4_text",),
    releases=(Release("gemma4", "gemma4_text", towers=TOWERS,
                      images=ImageSide(module="gemma4", modules=("vision_tower", "embed_vision"),
                                       features=image_features, bidirectional=vision_attention)),
              Release("gemma4_unified", "gemma4_text", text_config_type="gemma4_unified_text", towers=TOWERS,
                      images=ImageSide(module="gemma4_unified", modules=("vision_embedder", "embed_vision"),
                                       features=image_features, bidirectional=vision_attention))),
    spec_from_config=spec_from_config, init_kv=init_kv, forward=forward,
    layout=LAYOUT, logits=logits,
    shard_tensor=shard_tensor, tensor_splits=tensor_splits, pipeline_links=pipeline_links,
)
