"""DSpark drafts published in the ``dflash_config`` layout (the drafts of
hybrid targets such as LFM2.5 and Qwen3.5).

The backbone is the qwen3 draft (``drafts/qwen3.py``). The DSpark settings
sit in a ``dflash_config`` object (a key there wins over the same key at
the top level; the geometry stays at the top level) and choose options the
qwen3 spec carries:

- ``causal`` (at the top level ``dflash_query_causal`` or ``is_causal``):
  causal block attention in every layer (default bidirectional);
- ``layer_types`` (``full_attention`` / ``sliding_attention``, default all
  full) with the window ``swa_window_size`` (top level: ``sliding_window``);
- ``attention_sink_bias``: a learned sink logit per query head
  (``layers.{i}.self_attn.attention_sink_bias``);
- ``sample_from_anchor: false``: the drafts come from the mask slots after
  the anchor, not from the anchor's own slot;
- top level ``rope_is_neox_style: false`` (interleaved RoPE) and
  ``final_logit_softcapping``;
- YaRN RoPE (``rope_type: yarn``): the slow frequencies interpolated, and q
  and k scaled by its attention factor, which loading folds into the
  ``q_norm`` / ``k_norm`` weights (RoPE is linear, so scaling its input
  scales its output).

``block_size`` counts the drafts (``dspark_bonus_anchor: true``: the anchor
too). ``runtime_block_size``, a verify width counting the anchor, makes the
drafted block ``runtime_block_size - 1`` slots. ``block_size_policy`` and
``dflash_initial_block_size`` say how a runtime may vary the verify width
from round to round; here the scheduler picks each round's width (at most
the block + 1) and the draft always runs its whole block.

The checkpoint has no output head and may omit the embedding: the
target's serve. A setting that cannot be honoured exactly raises
``ValueError`` naming the field and its value.
"""

import math
from collections.abc import Mapping

from ..interfaces import DraftArch
from . import qwen3

GEOMETRY = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
BLOCK_SIZE_POLICIES = ("fixed", "adaptive")
ROPE_TYPES = ("default", "linear", "yarn")
# What the layout means when a config leaves them out.
DEFAULT_EPS = 1e-5
DEFAULT_ROPE_THETA = 1e7
DEFAULT_MARKOV_RANK = 256


def is_dflash_layout(config: dict) -> bool:
    """Whether a draft config keeps its DSpark settings in ``dflash_config``
    (a DeepSpec gemma4 draft that carries one keeps its own layout)."""
    return config.get("dflash_config") is not None and "Gemma4DSparkModel" not in (config.get("architectures") or ())


def _name(dflash: Mapping, key: str) -> str:
    return f"dflash_config.{key}" if key in dflash else key


def _bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _flag(settings: dict, dflash: Mapping, key: str, default: bool) -> bool:
    return _bool(settings.get(key, default), _name(dflash, key))


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")
    return value


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(message)


def _causal(config: dict, dflash: Mapping) -> bool:
    if "causal" in dflash:
        return _bool(dflash["causal"], "dflash_config.causal")
    for key in ("dflash_query_causal", "is_causal"):
        if key in config:
            return _bool(config[key], key)
    return False


def _layer_windows(config: dict, dflash: Mapping, layers: int) -> tuple:
    """Per draft layer, its sliding window or ``None`` (full attention)."""
    _refuse("layer_types" in dflash, "dflash_config.layer_types: give layer_types at the top level of the config")
    types = config.get("layer_types") or ["full_attention"] * layers
    _refuse(
        len(types) != layers or any(kind not in LAYER_TYPES for kind in types),
        f"layer_types {types!r} must give one of {', '.join(LAYER_TYPES)} per draft layer ({layers})",
    )
    _refuse(
        bool(dflash.get("use_swa")) and "full_attention" in types,
        f"dflash_config.use_swa {dflash.get('use_swa')!r} with full_attention layers in layer_types {types!r}: "
        f"which layers slide is ambiguous; mark them sliding_attention in layer_types",
    )
    if "sliding_attention" not in types:
        return ()
    if "swa_window_size" in dflash:
        window = _integer(dflash["swa_window_size"], "dflash_config.swa_window_size", 2)
    else:
        window = _integer(config.get("sliding_window"), "sliding_window", 2)
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _rope(config: dict) -> tuple:
    """RoPE parameters as a sorted tuple of items (theta and a default or linear scaling)."""
    scaling = config.get("rope_parameters")
    if isinstance(scaling, Mapping):
        scaling = dict(scaling)
        theta = scaling.pop("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    else:
        scaling = dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta", DEFAULT_ROPE_THETA)
    kind = scaling.get("type") or scaling.get("rope_type", "default")
    _refuse(kind not in ROPE_TYPES,
            f"rope type {kind!r} is not supported in a dflash_config draft; use {' or '.join(ROPE_TYPES)}")
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    _refuse(partial != 1.0, f"partial_rotary_factor {partial!r}: a dflash_config draft rotates whole heads")
    rope = {"rope_theta": float(theta), "rope_type": kind}
    if kind == "linear":
        _refuse("factor" not in scaling, "linear rope scaling needs its factor")
        rope["factor"] = float(scaling["factor"])
    if kind == "yarn":
        rope |= _yarn(scaling)
    return tuple(sorted(rope.items()))


def _yarn(scaling: dict) -> dict:
    """YaRN's frequency settings and its attention factor, read as transformers reads them."""
    _refuse("factor" not in scaling or "original_max_position_embeddings" not in scaling,
            f"rope type 'yarn' needs factor and original_max_position_embeddings, got {sorted(scaling)}")
    _refuse(scaling.get("truncate", True) is not True,
            f"yarn truncate {scaling.get('truncate')!r}: only the rounded correction range is supported")
    factor = float(scaling["factor"])
    yarn = {key: float(scaling[key]) for key in ("beta_fast", "beta_slow") if key in scaling}
    yarn.update(factor=factor, original_max_position_embeddings=float(scaling["original_max_position_embeddings"]))

    def mscale(weight: float) -> float:
        return 0.1 * weight * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        ratio = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if ratio else mscale(1.0)
    return yarn | {"attention_factor": float(attention)}


def _block_size(settings: dict, dflash: Mapping, config: dict) -> int:
    """Draft slots per round: the checkpoint's drafts, or ``runtime_block_size - 1``."""
    _refuse("block_size" not in settings,
            "a dflash_config draft needs block_size (in dflash_config or at the top level)")
    anchor = _bool(config.get("dspark_bonus_anchor", False), "dspark_bonus_anchor")
    drafts = _integer(settings["block_size"], _name(dflash, "block_size"), 2 if anchor else 1) - anchor
    runtime = settings.get("runtime_block_size")
    if runtime is None:
        return drafts
    return _integer(runtime, _name(dflash, "runtime_block_size"), 2, drafts + 1) - 1


def _check_runtime(settings: dict, dflash: Mapping) -> None:
    """Refuse runtime settings this library cannot honour exactly."""
    window = settings.get("draft_window_size")
    _refuse(
        window is not None and not (isinstance(window, int) and window <= 0),
        f"{_name(dflash, 'draft_window_size')} {window!r}: a draft context cut to a window with "
        f"history-dependent slack is not supported; remove it to attend to the whole context",
    )
    policy = settings.get("block_size_policy")
    _refuse(
        policy is not None and policy not in BLOCK_SIZE_POLICIES,
        f"{_name(dflash, 'block_size_policy')} {policy!r} must be one of {', '.join(BLOCK_SIZE_POLICIES)}",
    )


def _check_backbone(config: dict) -> None:
    missing = [key for key in GEOMETRY if key not in config]
    _refuse(bool(missing), f"dflash_config draft config lacks {missing}")
    for key in GEOMETRY:
        _integer(config[key], key, 1)
    act = config.get("hidden_act", "silu")
    _refuse(act != "silu", f"hidden_act {act!r}: a dflash_config draft has a SiLU-gated MLP")
    _refuse(bool(config.get("attention_bias")),
            f"attention_bias {config.get('attention_bias')!r}: dflash_config draft projections have no bias")
    _refuse(config["num_attention_heads"] % config["num_key_value_heads"] != 0,
            f"num_attention_heads {config['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads {config['num_key_value_heads']}")
    _refuse(bool(config.get("draft_vocab_size")),
            f"draft_vocab_size {config.get('draft_vocab_size')!r}: "
            f"a dflash_config draft proposes from the whole vocabulary")


def _target_layer_ids(settings: dict, dflash: Mapping) -> tuple:
    ids = settings.get("target_layer_ids")
    ascending = isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)
    _refuse(
        not ascending or any(a >= b for a, b in zip(ids, ids[1:])),
        f"{_name(dflash, 'target_layer_ids')} {ids!r} must be increasing target layer indices",
    )
    return tuple(ids)


def _num_target_layers(settings: dict, dflash: Mapping) -> int:
    """The target depth the draft was trained on, when given (0: unchecked)."""
    value = settings.get("num_target_layers")
    return 0 if value is None else _integer(value, _name(dflash, "num_target_layers"), 1)


def spec_from_config(config: dict) -> qwen3.Qwen3DraftSpec:
    """The qwen3 draft spec of a ``dflash_config`` draft config."""
    dflash = config["dflash_config"]
    _refuse(not isinstance(dflash, Mapping), f"dflash_config must be an object, got {dflash!r}")
    settings = config | dict(dflash)
    projector = dflash.get("projector_type")
    _refuse(projector not in (None, "dspark"),
            f"dflash_config.projector_type {projector!r}: only DSpark drafts (projector_type 'dspark') load here")
    _check_backbone(config)
    _check_runtime(settings, dflash)
    head_type = settings.get("markov_head_type", "vanilla")
    _refuse(head_type != "vanilla",
            f"{_name(dflash, 'markov_head_type')} {head_type!r} is not supported; use 'vanilla'")
    _refuse("mask_token_id" not in settings, "a dflash_config draft needs mask_token_id")
    layers = config["num_hidden_layers"]
    return qwen3.Qwen3DraftSpec(
        model_type=config.get("model_type", "qwen3"),
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        block_size=_block_size(settings, dflash, config),
        mask_token_id=_integer(settings["mask_token_id"], _name(dflash, "mask_token_id"), 0),
        target_layer_ids=_target_layer_ids(settings, dflash),
        num_target_layers=_num_target_layers(settings, dflash),
        markov_rank=_integer(settings.get("markov_rank", DEFAULT_MARKOV_RANK), _name(dflash, "markov_rank"), 1),
        confidence_head=_flag(settings, dflash, "enable_confidence_head", False),
        confidence_with_markov=_flag(settings, dflash, "confidence_head_with_markov", True),
        confidence_bias=True,
        draft_vocab_size=0,
        num_layers=layers,
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        eps=config.get("rms_norm_eps", DEFAULT_EPS),
        rope=_rope(config),
        intermediate_size=config["intermediate_size"],
        causal=_causal(config, dflash),
        layer_windows=_layer_windows(config, dflash, layers),
        attention_sinks=_flag(settings, dflash, "attention_sink_bias", False),
        sample_from_anchor=_flag(settings, dflash, "sample_from_anchor", True),
        interleaved_rope=not _bool(config.get("rope_is_neox_style", True), "rope_is_neox_style"),
        softcap=config.get("final_logit_softcapping"),
    )


def checkpoint_key(key: str) -> str:
    """Checkpoints of this layout may prefix every key with ``model.``."""
    return key.removeprefix("model.")


def prepare_params(spec: qwen3.Qwen3DraftSpec, params: dict) -> dict:
    """Fold YaRN's attention factor into every layer's q and k norm weights."""
    factor = dict(spec.rope).get("attention_factor", 1.0)
    if factor == 1.0:
        return params
    for layer in params["layers"]:
        attn = layer["self_attn"]
        for norm in ("q_norm", "k_norm"):
            attn[norm] = dict(attn[norm], weight=attn[norm]["weight"] * factor)
    return params


ARCH = DraftArch(
    spec_from_config=spec_from_config,
    checkpoint_shapes=qwen3.checkpoint_shapes,
    init_context=qwen3.init_context,
    extend_context=qwen3.extend_context,
    block_forward=qwen3.block_forward,
    checkpoint_key=checkpoint_key,
    prepare_params=prepare_params,
)
