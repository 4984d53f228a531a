"""The DeepSeek-V4 DSpark draft: the ``mtp.{i}`` stages of a V4-DSpark checkpoint.

Each stage is a V4 block (``layers/deepseek_v4.py``: hyper-connections,
low-rank-query attention over one shared K=V latent with a sink, a mixture of
experts). The target's taps, ``main_norm(main_proj(taps))``, become each
stage's context latents (its own ``wkv``/``kv_norm``, rotated at their
positions). The block ``[anchor, noise, ...]`` at positions ``length + k``,
copied into every hyper-connection stream, attends to the context and,
bidirectionally, to its own latents; ``hc_head`` then collapses the streams
and ``norm`` + the target's ``lm_head`` give the base logits.

Where the sources disagree, this module follows the official V4 inference
code (as quoted by its ports) rather than mlx-vlm:

* Context window: a block sees exactly the last ``sliding_window`` committed
  positions (``length - W <= j < length``). mlx-vlm keeps every row of its
  first update (the whole prompt) and after a multi-row update up to
  ``W - 1 + S`` rows; both rules agree while the context fits the window.
  With fixed buffers the window is only a mask, so rollback stays "set
  ``length``".
* Taps: the mean over the hyper-connection streams of each tapped target
  block's OUTPUT (V4; the V4.1 code reads the attention input instead).
* Queries are RMS-normalised per head without a weight, as in every V4 attention.
* Confidence: ``sigmoid(proj([x ; markov_w1[prev]]))`` with no bias, where ``x``
  is the PRE-norm ``hc_head`` output (``block_forward`` returns it as the head
  hidden); mlx-vlm drops this head.

Loading: a V4-DSpark checkpoint's own ``config.json`` (``model_type``
``deepseek_v4`` with ``dspark_block_size``, ``dspark_noise_token_id``,
``dspark_target_layer_ids``, ``dspark_markov_rank``; the stage count is
the number of ``mtp.{i}`` stages stored, which the released configs'
``num_nextn_predict_layers`` understates). The draft is the ``mtp.*`` tensors of the
directory, so the released checkpoint is both target and draft directory.
FP8/FP4 tensors (with ``.scale`` companions) stay quantized
(``microscaling.py``). The embedding and output head come from the target.
"""

import re
from dataclasses import dataclass

import mlx.core as mx

from .. import ops
from ..cache import block_mask, block_positions, positions_from, write_rows
from ..interfaces import DraftArch
from ..layers import deepseek_v4 as family
from ..layers import mhc
from .base import DSparkFields, dspark_fields
from .heads import DRAFT_VOCAB_KEY, head_shapes

DSPARK_KEYS = {
    "dspark_block_size": "block_size",
    "dspark_noise_token_id": "mask_token_id",
    "dspark_target_layer_ids": "target_layer_ids",
    "dspark_markov_rank": "markov_rank",
}
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class DeepseekV4DraftSpec(DSparkFields):
    num_stages: int
    block: family.BlockSpec
    window: int
    q_lora_rank: int
    o_lora_rank: int
    num_experts: int
    expert_width: int
    shared_width: int


def spec_from_config(config: dict) -> DeepseekV4DraftSpec:
    """The draft spec from a V4 config carrying the ``dspark_*`` keys (mlx-vlm defaults for the rest)."""
    missing = [key for key in DSPARK_KEYS if key not in config]
    if missing:
        raise ValueError(f"deepseek_v4 config lacks {missing}: not a DSpark checkpoint")
    args = family.model_args(config)
    renamed = {new: config[old] for old, new in DSPARK_KEYS.items()}
    fields = dspark_fields({**config, **renamed, "num_target_layers": args["num_hidden_layers"]})
    # V4 always carries the bias-free confidence head over [x ; Markov embedding].
    fields.update(confidence_head=True, confidence_with_markov=True, confidence_bias=False)
    return DeepseekV4DraftSpec(
        **fields,
        num_stages=config.get("n_mtp_layers", args["num_nextn_predict_layers"]),
        block=family.block_spec(args),
        window=args["sliding_window"],
        q_lora_rank=args["q_lora_rank"],
        o_lora_rank=args["o_lora_rank"],
        num_experts=args["n_routed_experts"],
        expert_width=args["moe_intermediate_size"],
        shared_width=args["moe_intermediate_size"] * args["n_shared_experts"],
    )


def _stage_shapes(spec: DeepseekV4DraftSpec) -> dict:
    """Checkpoint shapes of one ``mtp.{i}`` stage, keys relative to the stage."""
    g = spec.block
    d, heads_width, hc = spec.hidden_size, g.num_heads * g.head_dim, g.hyper.streams
    mix = (2 + hc) * hc
    shapes = {
        "attn.wq_a.weight": (spec.q_lora_rank, d),
        "attn.q_norm.weight": (spec.q_lora_rank,),
        "attn.wq_b.weight": (heads_width, spec.q_lora_rank),
        "attn.wkv.weight": (g.head_dim, d),
        "attn.kv_norm.weight": (g.head_dim,),
        "attn.wo_a.weight": (g.groups * spec.o_lora_rank, heads_width // g.groups),
        "attn.wo_b.weight": (d, g.groups * spec.o_lora_rank),
        "attn.attn_sink": (g.num_heads,),
        "attn_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "ffn.gate.weight": (spec.num_experts, d),
        "ffn.gate.bias": (spec.num_experts,),
        "ffn.shared_experts.w1.weight": (spec.shared_width, d),
        "ffn.shared_experts.w3.weight": (spec.shared_width, d),
        "ffn.shared_experts.w2.weight": (d, spec.shared_width),
    }
    for sublayer in ("attn", "ffn"):
        shapes |= {
            f"hc_{sublayer}_fn": (mix, hc * d),
            f"hc_{sublayer}_base": (mix,),
            f"hc_{sublayer}_scale": (3,),
        }
    for e in range(spec.num_experts):
        shapes |= {
            f"ffn.experts.{e}.w1.weight": (spec.expert_width, d),
            f"ffn.experts.{e}.w3.weight": (spec.expert_width, d),
            f"ffn.experts.{e}.w2.weight": (d, spec.expert_width),
        }
    return shapes


def checkpoint_shapes(spec: DeepseekV4DraftSpec) -> dict:
    """Every checkpoint tensor ``{key: shape}`` of the three-stage draft (heads on the last stage)."""
    d, hc, last = spec.hidden_size, spec.block.hyper.streams, spec.num_stages - 1
    shapes = {
        "embed_tokens.weight": (spec.vocab_size, d),
        "lm_head.weight": (spec.vocab_size, d),
        "mtp.0.main_proj.weight": (d, len(spec.target_layer_ids) * d),
        "mtp.0.main_norm.weight": (d,),
        f"mtp.{last}.norm.weight": (d,),
        f"mtp.{last}.hc_head_fn": (hc, hc * d),
        f"mtp.{last}.hc_head_base": (hc,),
        f"mtp.{last}.hc_head_scale": (1,),
    }
    for i in range(spec.num_stages):
        shapes |= {f"mtp.{i}.{key}": shape for key, shape in _stage_shapes(spec).items()}
    return shapes | {f"mtp.{last}.{key}": shape for key, shape in head_shapes(spec).items()}


STAGE_RENAMES = (
    (re.compile(r"hc_(attn|ffn)_(fn|base|scale)$"), r"\1_hc.\2"),
    (re.compile(r"hc_head_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"ffn\.gate\.bias$"), "ffn.gate.e_score_correction_bias"),
    (re.compile(r"(experts\.\d+|shared_experts)\.(w[123])\."), lambda m: f"{m[1]}.{EXPERT_PROJECTIONS[m[2]]}."),
)


def key_map(key: str) -> str:
    """``mtp.{i}.<name>`` -> ``stages.{i}.<mlx-vlm name>``; the last stage's heads -> top level."""
    match = re.match(r"mtp\.(\d+)\.(.+)$", key)
    if not match:
        return key
    stage, name = match.groups()
    if name.startswith(("markov_head.", "confidence_head.", DRAFT_VOCAB_KEY)):
        return name
    for pattern, replacement in STAGE_RENAMES:
        name = pattern.sub(replacement, name)
    return f"stages.{stage}.{name}"


def prepare_params(spec: DeepseekV4DraftSpec, params: dict) -> dict:
    """Stack the per-expert tensors into ``switch_mlp`` ``[E, ...]`` and split
    ``wo_a`` into its groups ``[G, R, in]``: the layout the V4 block reads."""
    stages = []
    for stage in params["stages"]:
        ffn = {key: value for key, value in stage["ffn"].items() if key != "experts"}
        experts = stage["ffn"]["experts"]
        ffn["switch_mlp"] = {
            name: {part: mx.stack([expert[name][part] for expert in experts]) for part in experts[0][name]}
            for name in EXPERT_PROJECTIONS.values()
        }
        wo_a = {part: value.reshape(spec.block.groups, -1, value.shape[-1])
                for part, value in stage["attn"]["wo_a"].items()}
        attn = {**stage["attn"], "wo_a": wo_a}
        stages.append({**stage, "ffn": ffn, "attn": attn})
    return {**params, "stages": stages}


def init_context(spec: DeepseekV4DraftSpec, batch: int, capacity: int) -> list:
    """Per stage the context latents ``[B, 1, capacity, head_dim]``."""
    return [mx.zeros((batch, 1, capacity, spec.block.head_dim), mx.float32) for _ in range(spec.num_stages)]


def extend_context(spec: DeepseekV4DraftSpec, params: dict, state: list, features, start) -> list:
    """Write the context latents of ``features [B, L, F]`` at positions ``start[b] + i`` into every stage's buffer."""
    first = params["stages"][0]
    context = ops.rms_norm(ops.linear(first["main_proj"], features), first["main_norm"]["weight"], spec.block.eps)
    positions = positions_from(start, features.shape[1])
    inv_freq = family.rope_inv_freq(spec.block)
    return [
        write_rows(buffer, family.latents(spec.block, stage["attn"], context, positions, inv_freq), start)
        for stage, buffer in zip(params["stages"], state)
    ]


def context_attention(geometry: family.BlockSpec, attn: dict, context, mask, positions, inv_freq):
    """A stage's attention: block queries over its context latents and, bidirectionally, the block's own."""

    def attention(x):
        keys = mx.concatenate([context, family.latents(geometry, attn, x, positions, inv_freq)], axis=2)
        q = family.queries(geometry, attn, x, positions, inv_freq)
        return family.attend(geometry, attn, q, keys, mask, positions, inv_freq), None

    return attention


def block_forward(spec: DeepseekV4DraftSpec, params: dict, state: list, length, block_ids):
    """The block ``block_ids [B, G]`` through the stages (or N blocks a row with
    ``length [B, N]``): ``(base logits [B, G, V'], pre-norm hc_head output [B, G, d])``."""
    width = block_ids.shape[1]
    geometry, capacity = spec.block, state[0].shape[2]
    positions = block_positions(length, width)
    inv_freq = family.rope_inv_freq(geometry)
    mask = block_mask(length, capacity, width, spec.window)
    streams = family.embedded_streams(geometry, params["embed_tokens"], block_ids)
    for stage, context in zip(params["stages"], state):
        attention = context_attention(geometry, stage["attn"], context, mask, positions, inv_freq)
        streams, _ = family.block(geometry, stage, streams, attention)
    last = params["stages"][-1]
    head_hidden = mhc.head(last["hc_head"], streams, geometry.hyper)
    hidden = ops.rms_norm(head_hidden, last["norm"]["weight"], geometry.eps)
    return ops.linear(params["lm_head"], hidden), head_hidden


def is_draft_key(key: str) -> bool:
    """The draft's tensors in a whole V4-DSpark checkpoint: its ``mtp.*`` stages."""
    return key.startswith("mtp.")


def complete_config(config: dict, keys) -> dict:
    """The stage count from the checkpoint: the released configs keep a legacy
    ``num_nextn_predict_layers`` of 1 beside three ``mtp.*`` stages."""
    stages = {int(match[1]) for key in keys if (match := re.match(r"mtp\.(\d+)\.", key))}
    return {**config, "n_mtp_layers": len(stages)} if stages else config


ARCH = DraftArch(model_types=("deepseek_v4",), spec_from_config=spec_from_config, checkpoint_shapes=checkpoint_shapes,
                 init_context=init_context, extend_context=extend_context, block_forward=block_forward, key_map=key_map,
                 prepare_params=prepare_params, is_draft_key=is_draft_key,
                 complete_config=complete_config)
