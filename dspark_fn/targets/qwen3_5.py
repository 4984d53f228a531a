"""The Qwen3.5 family (mlx-lm ``qwen3_5``, ``qwen3_5_moe``) and Qwen3-Next
(``qwen3_next``) as a pure target forward.

Hybrid decoders: every ``full_attention_interval``-th layer is gated
attention, the others gated delta nets (``layers/gated_delta.py``), each
followed by a SwiGLU MLP or a sparse MoE block (softmax top-k routing over
``switch_mlp`` experts, plus a shared expert behind a sigmoid gate).
Qwen3.5 puts the MoE block in every layer of an MoE model; Qwen3-Next in
those that ``decoder_sparse_step`` picks and ``mlp_only_layers`` does not
name. Qwen3-Next fuses its delta nets' input projections; the layer math is
otherwise the same.

mlx-lm builds every Qwen3.5 checkpoint as its multimodal wrapper, the text
model under ``language_model``; ``load_params`` returns that text model's
tree, so a multimodal release (``text_config``, vision weights beside it)
runs as its text model.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .. import ops
from ..cache import causal_mask, kv_buffers, positions_from
from ..interfaces import ImageInputs, ImageSide, Release, TargetAdapter
from ..layers.gated_delta import (
    AttentionGeometry,
    DeltaGeometry,
    delta_state,
    gated_attention,
    gated_delta_net,
)
from ..layers.moe import routed_experts
from .base import decoder_layers, model_fields

# RoPE kinds of the attention layers' rotary part; a text-only mrope (every
# section at the same position) is plain RoPE, as mlx-lm runs it.
ROPE_KINDS = {"default": "default", "mrope": "default", "linear": "linear"}


@dataclass(frozen=True)
class Qwen3_5Spec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    eps: float
    tied: bool
    linear: tuple  # per layer: a gated delta net (else gated attention)
    sparse: tuple  # per layer: a sparse MoE block (else a SwiGLU MLP)
    delta: DeltaGeometry
    attention: AttentionGeometry
    top_k: int
    norm_topk_prob: bool
    mrope_section: tuple | None = None  # multimodal RoPE: how many frequencies follow height and width


def model_args(config: dict) -> dict:
    """The config read with mlx-lm's own defaults (its ``ModelArgs``), the
    fields Qwen3-Next has no default for checked first."""
    if config.get("model_type") == "qwen3_next":
        from mlx_lm.models.qwen3_next import ModelArgs

        required = [f.name for f in dataclasses.fields(ModelArgs)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in config]
        if missing:
            raise ValueError(f"qwen3_next config lacks {', '.join(missing)}")
    else:
        from mlx_lm.models.qwen3_5 import TextModelArgs as ModelArgs
    return vars(ModelArgs.from_dict(config))


def layer_kinds(config: dict, args: dict) -> tuple[tuple, tuple]:
    """Per layer ``(linear, sparse)``: which layers are delta nets and which have MoE blocks."""
    layers, interval = args["num_hidden_layers"], args["full_attention_interval"]
    linear = tuple((i + 1) % interval != 0 for i in range(layers))
    if config.get("model_type") != "qwen3_next":
        return linear, (args["num_experts"] > 0,) * layers
    sparse = tuple(
        args["num_experts"] > 0 and i not in args["mlp_only_layers"] and (i + 1) % args["decoder_sparse_step"] == 0
        for i in range(layers)
    )
    return linear, sparse


def config_problems(config: dict, args: dict) -> list:
    """What in a config this adapter (or mlx-lm) cannot run, in words."""
    problems = []
    layers, interval = args["num_hidden_layers"], args["full_attention_interval"]
    if interval < 1:
        problems.append(f"full_attention_interval {interval} (must be at least 1)")
    elif interval > layers:
        problems.append(f"no full-attention layer (full_attention_interval {interval} > {layers} layers)")
    elif config.get("layer_types"):
        expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if list(config["layer_types"]) != expected:
            problems.append(f"layer_types disagree with full_attention_interval {interval}")
    if args["linear_num_value_heads"] % args["linear_num_key_heads"]:
        problems.append(
            f"linear_num_value_heads {args['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads {args['linear_num_key_heads']}"
        )
    if args["num_attention_heads"] % args["num_key_value_heads"]:
        problems.append(
            f"num_attention_heads {args['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads {args['num_key_value_heads']}"
        )
    if args["num_experts"] > 0 and not 1 <= args["num_experts_per_tok"] <= args["num_experts"]:
        problems.append(f"num_experts_per_tok {args['num_experts_per_tok']} outside 1..{args['num_experts']}")
    kind = rope_kind(args)
    if kind not in ROPE_KINDS:
        problems.append(f"rope type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
    return problems


def rope_kind(args: dict) -> str:
    scaling = args["rope_scaling"] or {}
    return scaling.get("type") or scaling.get("rope_type") or "default"


def attention_geometry(args: dict) -> AttentionGeometry:
    rope = {"rope_type": ROPE_KINDS[rope_kind(args)], "rope_theta": args["rope_theta"]}
    if rope["rope_type"] == "linear":
        rope["factor"] = args["rope_scaling"]["factor"]
    return AttentionGeometry(
        num_heads=args["num_attention_heads"],
        num_kv_heads=args["num_key_value_heads"],
        head_dim=args["head_dim"],
        rotary_dims=int(args["head_dim"] * args["partial_rotary_factor"]),
        rope=tuple(sorted(rope.items())),
    )


def spec_from_config(config: dict) -> Qwen3_5Spec:
    """The target spec of a Qwen3.5 text config or a Qwen3-Next config; what
    cannot run is refused with the reason."""
    args = model_args(config)
    problems = config_problems(config, args)
    if problems:
        raise ValueError(f"unsupported {config.get('model_type')} target: " + "; ".join(problems))
    linear, sparse = layer_kinds(config, args)
    return Qwen3_5Spec(
        **model_fields(config, args),
        eps=args["rms_norm_eps"],
        tied=args["tie_word_embeddings"],
        linear=linear,
        sparse=sparse,
        delta=DeltaGeometry(
            num_k_heads=args["linear_num_key_heads"],
            num_v_heads=args["linear_num_value_heads"],
            head_k_dim=args["linear_key_head_dim"],
            head_v_dim=args["linear_value_head_dim"],
            conv_kernel=args["linear_conv_kernel_dim"],
        ),
        attention=attention_geometry(args),
        top_k=args["num_experts_per_tok"],
        norm_topk_prob=args["norm_topk_prob"],
        mrope_section=mrope_section(args),
    )


def mrope_section(args: dict) -> tuple | None:
    """The multimodal RoPE sections of a VL release's text config (None for text models)."""
    section = (args["rope_scaling"] or {}).get("mrope_section")
    return tuple(section) if section else None


def frequency_axes(section: tuple, frequencies: int) -> mx.array:
    """``[F]``: the axis (0 temporal, 1 height, 2 width) each rotary frequency
    follows under interleaved multimodal RoPE: every third frequency from the
    second follows height, from the third width, ``section[1]`` and
    ``section[2]`` of them; the others time."""
    axes = [0] * frequencies
    for axis in (1, 2):
        for index in range(axis, min(3 * section[axis], frequencies), 3):
            axes[index] = axis
    return mx.array(axes)


def load_params(directory) -> dict:
    """The text model's tree of a checkpoint directory, through mlx-lm's
    loader (its ``sanitize`` maps a release's names and drops its vision
    weights before anything is read)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(directory), lazy=False)
    text = getattr(model, "language_model", model)
    return tree_unflatten(tree_flatten(text.parameters()))


def init_kv(spec: Qwen3_5Spec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per layer: a delta net's ``{"conv", "ssm"}`` state, or an attention
    layer's K/V buffers ``[B, H_kv, C, D]``; with multimodal RoPE a last entry
    ``{"shift": [B]}``, how far each row's positions run from its slots (an
    image takes fewer positions than tokens)."""
    attention = spec.attention
    layers = [
        delta_state(spec.delta, batch, dtype) if linear
        else kv_buffers(batch, attention.num_kv_heads, capacity, attention.head_dim, dtype)
        for linear in spec.linear
    ]
    return layers + [{"shift": mx.zeros((batch,), mx.int32)}] if spec.mrope_section else layers


def sparse_moe(spec: Qwen3_5Spec, p: dict, x: mx.array) -> mx.array:
    """The top-k experts of ``softmax(gate x)`` weighted by their
    probabilities (renormalised with ``norm_topk_prob``), plus the gated shared expert."""
    probs = mx.softmax(ops.linear(p["gate"], x), axis=-1, precise=True)
    experts = mx.argpartition(probs, kth=-spec.top_k, axis=-1)[..., -spec.top_k :]
    weights = mx.take_along_axis(probs, experts, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    routed = routed_experts(p["switch_mlp"], x, experts, weights, 0.0)
    return routed + mx.sigmoid(ops.linear(p["shared_expert_gate"], x)) * ops.glu_mlp(p["shared_expert"], x)


def forward(spec: Qwen3_5Spec, params: dict, kv: list, tokens, start, taps: tuple, keep=None,
            images: ImageInputs | None = None):
    """Run ``tokens [B, L]`` at slots ``start[b] + i``: ``(final-normed
    hidden [B, L, d], taps [B, L, F], kv)``; the delta nets' states pending,
    or committed after ``keep[b]`` tokens when given. A row's positions are
    its slots plus its shift; with ``images`` (a prefill chunk) the image
    features replace the embeddings at image positions, and each token's
    temporal, height and width positions rotate their own frequencies."""
    model = params["model"]
    kv, shift = (kv[:-1], kv[-1]) if spec.mrope_section else (kv, None)
    positions = positions_from(start, tokens.shape[1])
    capacity = kv[spec.linear.index(False)][0].shape[2]
    mask = causal_mask(positions, capacity)
    if shift is not None:
        positions = positions + shift["shift"][:, None]
    h = ops.embed(model["embed_tokens"], tokens, spec.hidden_size)
    if images is not None:
        h = mx.where(images.mask[..., None], images.features.astype(h.dtype), h)
        if shift is not None:
            frequencies = spec.attention.rotary_dims // 2
            axes = frequency_axes(spec.mrope_section, frequencies)
            positions = mx.take(positions[:, None] + images.offsets, axes, axis=1).transpose(0, 2, 1)

    def step(index, layer, entry, h):
        x = ops.rms_norm(h, layer["input_layernorm"]["weight"], spec.eps)
        if spec.linear[index]:
            mixed, entry = gated_delta_net(spec.delta, layer["linear_attn"], x, entry, spec.eps, keep)
        else:
            mixed, keys, values = gated_attention(
                spec.attention, layer["self_attn"], x, *entry, start, positions, mask, spec.eps
            )
            entry = (keys, values)
        h = h + mixed
        x = ops.rms_norm(h, layer["post_attention_layernorm"]["weight"], spec.eps)
        return h + (sparse_moe(spec, layer["mlp"], x) if spec.sparse[index] else ops.glu_mlp(layer["mlp"], x)), entry

    h, features, new_kv = decoder_layers(h, model["layers"], kv, step, taps)
    new_kv = new_kv + [shift] if shift is not None else new_kv
    return ops.rms_norm(h, model["norm"]["weight"], spec.eps), features, new_kv


def prompt_forward(spec: Qwen3_5Spec, params: dict, kv: list, tokens, start, taps: tuple, first, end,
                   images: ImageInputs | None = None):
    """``forward`` over a prefill chunk: states committed at each prompt's
    end, and the chunk holding a prompt's last token adds the shift its
    images leave for the tokens after it."""
    length = tokens.shape[1]
    hidden, features, kv = forward(spec, params, kv, tokens, start, taps, keep=mx.clip(end - start, 0, length),
                                   images=images)
    if images is not None and spec.mrope_section:
        ends_here = (end > start) & (end <= start + length)
        kv = kv[:-1] + [{"shift": kv[-1]["shift"] + mx.where(ends_here, images.shift, 0)}]
    return hidden, features, kv


def image_features(vlm, inputs: dict) -> mx.array:
    """``[N, d]``: mlx-vlm's vision tower (patch merger included) over one prompt's images."""
    features, _ = vlm.vision_tower(inputs["pixel_values"], inputs["image_grid_thw"])
    return features


def image_positions(vlm_config, ids, inputs: dict):
    """``[3, L]``: mlx-vlm's multimodal RoPE positions of a prompt's tokens
    (each image's tokens laid out over time, height and width; the text after
    an image resumes past its largest position). ``get_rope_index`` reads
    only its model's config, so it runs here without the model."""
    from types import SimpleNamespace

    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args({"model_type": vlm_config.model_type})
    ids = mx.array(ids)[None]
    grid = inputs.get("image_grid_thw")
    positions, _ = module.LanguageModel.get_rope_index(SimpleNamespace(config=vlm_config), ids,
                                                       None if grid is None else mx.array(grid))
    return positions[:, 0] if positions.ndim == 3 else mx.broadcast_to(positions, (3, ids.shape[1]))


# The vision tower of the VL releases: ``visual`` as published, ``vision_tower`` as mlx-vlm names it.
TOWERS = ("vision_tower", "visual")


def image_side(module: str) -> ImageSide:
    return ImageSide(module=module, modules=("vision_tower",), features=image_features, positions=image_positions)


ADAPTER = TargetAdapter(
    model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"),
    releases=(Release("qwen3_5", "qwen3_5_text", towers=TOWERS, images=image_side("qwen3_5")),
              Release("qwen3_5_moe", "qwen3_5_moe_text", towers=TOWERS, images=image_side("qwen3_5_moe"))),
    spec_from_config=spec_from_config, init_kv=init_kv, forward=forward, load_params=load_params,
    prompt_forward=prompt_forward,
)
