"""The interface every target family implements, and the pieces every family forward ends with."""

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


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


def concat_taps(tapped: dict, taps: tuple):
    """``[B, L, F]``: the tapped layers' outputs in ``taps`` order (None without taps)."""
    return mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None


def output_head(params: dict, tied: bool) -> dict:
    """The module the target's logits come from: its embedding when tied."""
    return params["model"]["embed_tokens"] if tied else params["lm_head"]


def stopping_at_prompt_end(forward: Callable) -> Callable:
    """The ``prompt_forward`` of a family with recurrent layers: its ``forward``
    with ``keep`` set to each row's prompt tokens in the chunk, so the padding
    past a prompt's end never advances a state."""

    def prompt_forward(spec, params, kv, tokens, start, taps, first, end):
        return forward(spec, params, kv, tokens, start, taps, keep=mx.clip(end - start, 0, tokens.shape[1]))

    return prompt_forward
