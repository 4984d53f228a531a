"""The two recurrences hybrid targets are made of, over fixed shapes: a causal
depthwise convolution with its window of previous inputs, and a state carried
token by token (delta-net, Mamba-2). Families give the per-token update.

Either returns its cache entry in one of two forms. With ``keep [B]`` (a
prefill chunk, whose prompt ends at a known row) positions ``t >= keep[b]``
leave the state as it was, so padding never enters it and the entry is the
committed state. Without (a verify block, whose accepted length is known only
after the target's logits) it is pending: the state after every position,
for ``cache.settle`` to pick from once acceptance is known.
"""

from typing import Callable

import mlx.core as mx

from ..cache import PendingStates, PendingWindow, settle_entry


def convolve(window: mx.array, x: mx.array, weight: mx.array, bias: mx.array | None, keep: mx.array | None):
    """Causal depthwise convolution of ``x [B, L, C]`` after the previous
    inputs ``window [B, K - 1, C]``, with ``weight [C, K, 1]`` (mlx-lm's
    ``Conv1d`` layout): ``(outputs [B, L, C], entry)``. The sum runs in
    float32 and rounds once, as MLX's convolution does in half precision."""
    size = window.shape[1]
    rows = mx.concatenate([window.astype(x.dtype), x], axis=1)
    taps = weight[:, :, 0].T.astype(mx.float32)  # [K, C]
    length = x.shape[1]
    out = sum(rows[:, k : k + length].astype(mx.float32) * taps[k] for k in range(size + 1))
    if bias is not None:
        out = out + bias.astype(mx.float32)
    out = out.astype(x.dtype)
    pending = PendingWindow(rows, size)
    return out, pending if keep is None else settle_entry(pending, keep).astype(window.dtype)


def scan(update: Callable, state: mx.array, inputs: tuple, keep: mx.array | None):
    """Run ``update(state, *inputs_t) -> (output_t, state)`` over the ``L``
    positions of ``inputs`` (each ``[B, L, ...]``): ``(outputs [B, L, ...], entry)``."""
    length = inputs[0].shape[1]
    history, outputs = [state], []
    for t in range(length):
        out, new = update(state, *(x[:, t] for x in inputs))
        if keep is not None:
            new = mx.where((t < keep).reshape(-1, *([1] * (new.ndim - 1))), new, state)
        outputs.append(out)
        history.append(new)
        state = new
    entry = PendingStates(mx.stack(history, axis=1)) if keep is None else state
    return mx.stack(outputs, axis=1), entry
