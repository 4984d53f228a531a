"""The interface every DSpark draft architecture implements, and the fields all share."""

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class DSparkFields:
    """Config entries DeepSpec adds to every draft, whatever its backbone."""

    model_type: str
    vocab_size: int
    hidden_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple
    num_target_layers: int
    markov_rank: int
    confidence_head: bool
    confidence_with_markov: bool
    confidence_bias: bool
    draft_vocab_size: int  # 0: the draft proposes from the whole vocabulary


def dspark_fields(config: dict) -> dict:
    """The shared fields of a DeepSpec draft config, validated."""
    required = ("block_size", "mask_token_id", "target_layer_ids", "vocab_size", "hidden_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"draft config lacks DSpark keys {missing}: not a DSpark draft checkpoint")
    head_type = config.get("markov_head_type", "vanilla")
    if config.get("markov_rank", 0) and head_type != "vanilla":
        raise ValueError(f"markov_head_type {head_type!r} is not supported; use 'vanilla'")
    fields = {key: config[key] for key in ("model_type", *required)}
    fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
    return fields | dict(
        num_target_layers=config.get("num_target_layers", 0),
        markov_rank=config.get("markov_rank", 0),
        confidence_head=config.get("enable_confidence_head", False),
        confidence_with_markov=config.get("confidence_head_with_markov", False),
        confidence_bias=True,
        draft_vocab_size=config.get("draft_vocab_size") or 0,
    )


@dataclass(frozen=True, kw_only=True)
class DraftArch:
    """How to build and run one draft backbone.

    spec_from_config(config) -> spec        a hashable ``DSparkFields`` subclass
    checkpoint_shapes(spec) -> {key: shape} every tensor of a checkpoint, by its own key
    key_map(key) -> tree key                 dotted path in the parameter tree (default: the key)
                                             (heads always land at ``markov_head``,
                                             ``confidence_head``, ``embed_tokens``, ``lm_head``)
    init_context(spec, batch, capacity)      empty context state
    extend_context(spec, params, state, features, start) -> state
        projects target features ``[B, L, F]`` of positions ``start[b] + i`` and
        writes them as context keys/values
    block_forward(spec, params, state, length, block_ids) -> (base_logits, head_hidden)
        the block at positions ``length[b] + k`` attending to context slots
        ``< length[b]`` and to the whole block; ``head_hidden`` feeds the
        confidence head. With ``length [B, N]`` (training) each row holds N
        blocks side by side sharing its context (``cache.block_slots``,
        ``cache.block_positions``, ``cache.block_mask``)
    prepare_params(spec, tree) -> tree       optional last loading step for layouts a
                                             per-key map cannot reach (stacking experts)
    is_draft_key(key) -> bool                optional: which tensors of the directory are
                                             the draft's, for drafts that ship inside their
                                             target's checkpoint (default: all of them)
    complete_config(config, keys) -> config  optional: facts a release's config leaves to
                                             its checkpoint (V4-DSpark's stage count)
    checkpoint_key(key) -> key               optional: a checkpoint's own spelling of a key
                                             -> the spelling ``checkpoint_shapes`` uses
    """

    spec_from_config: Callable
    checkpoint_shapes: Callable
    init_context: Callable
    extend_context: Callable
    block_forward: Callable
    key_map: Callable = lambda key: key
    prepare_params: Callable | None = None
    is_draft_key: Callable | None = None
    complete_config: Callable | None = None
    checkpoint_key: Callable | None = None
