"""The interface every target family implements."""

from typing import Callable, NamedTuple


class TargetAdapter(NamedTuple):
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
    """

    spec_from_config: Callable
    init_kv: Callable
    forward: Callable
    logits: Callable
    load_params: Callable | None = None
