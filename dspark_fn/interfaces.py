"""The two interfaces a model family implements: ``TargetAdapter`` (how to run
a target) and ``DraftArch`` (how to build and run a draft backbone). The
round kernels call families only through them; the families and their
registries live in ``targets/`` and ``drafts/``, so importing these loads none."""

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class TargetAdapter:
    """How to run one target family.

    spec_from_config(config) -> spec   hashable static description with at least
                                       ``vocab_size``, ``hidden_size``, ``num_layers``
    init_kv(spec, batch, capacity, dtype)  per-layer fixed-capacity KV buffers in the
                                       target's activation dtype
    forward(spec, params, kv, tokens, start, taps) -> (hidden, features, kv)
        runs ``tokens [B, L]`` at positions ``start[b] + i``; ``hidden`` is the
        final-normed output, ``features`` the concatenated raw outputs of the
        decoder layers listed in ``taps`` (``[B, L, len(taps) * d]``).
    logits(spec, params, hidden) -> [..., V]
    load_params(directory) -> params   optional; without it the tree is mlx-lm's
    shard_tensor(spec, params, ranks) -> (spec, params)
        optional: this rank's share of a tensor-parallel target (``sharding.py``);
        the spec counts the rank's own heads
    tensor_splits(config) -> {what: count}
        with ``shard_tensor``: the counts it divides by the number of ranks,
        so a split that cannot work is refused before any weight is read
    prompt_forward(spec, params, kv, tokens, start, taps, first, end)
        optional: ``forward`` for prefill chunks of prompts spanning positions
        ``first[b] .. end[b] - 1``, for families whose state depends on how
        the prompt was split into calls (DeepSeek-V4's pooled windows) or
        that must not advance over the chunk's padding (recurrent layers)

    A family with recurrent layers keeps their state in ``kv`` as a dict per
    layer (``cache.py``): ``forward`` leaves it pending (the round settles it
    on the accepted tokens), ``prompt_forward`` committed after ``end``.
    """

    spec_from_config: Callable
    init_kv: Callable
    forward: Callable
    logits: Callable
    load_params: Callable | None = None
    prompt_forward: Callable | None = None
    shard_tensor: Callable | None = None
    tensor_splits: Callable | None = None


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
