"""DeepSeek-V4 compressed attention as pure functions over fixed-shape buffers.

A compressed layer (``compress_ratios`` entry ``r`` = 4 or 128) attends to
its sliding window of latent rows and to *pooled* rows: one per whole window
of ``r`` positions, the softmax-gated sum of the window's compressor rows,
RMS-normed and rotated at the window's first position. Ratio-4 pools overlap:
the first half of each pooled row's features is gated over the window before.
Ratio-4 layers attend to the pooled rows their indexer ranks highest for each
query (``index_topk``); ratio-128 layers to every pooled row. A pooled row is
visible from position ``p`` iff its window ends at or before ``p``.

State of one pool: the compressor's raw ``kv`` and ``gate`` rows of every
position (``[B, 1, capacity, width]``) and the pooled rows by window
(``[B, 1, capacity, dim]``, window ``w`` in slot ``w``). Rollback stays data,
as the latent rows do:

- a call writes its raw rows at ``start + i``, then recomputes every window
  it touches from the raw buffer and writes it to its slot (a window still
  missing rows gets a value no position sees, and is rewritten by the call
  that completes it);
- a rejected suffix is never read: its windows end past the committed length,
  so no position that is kept sees them, and the next call starts at the
  committed length, overwrites those raw rows and recomputes the window they
  fall in when accepted tokens complete it.

Overlap follows mlx-vlm 0.7.10: a prompt of more than ``DECODE_BLOCK`` tokens
pools its windows together, and a window then draws the overlap half from the
window before when the same prompt completed that one too; every other window
(the first of a prompt, those completed while decoding or verifying, and all
windows of short prompts, which mlx-vlm runs token by token) pools alone.
"""

import mlx.core as mx

from .. import ops
from ..cache import write_rows
from .deepseek_v4 import rotate_tail

DECODE_BLOCK = 8  # mlx-vlm runs calls of up to 8 tokens one token at a time
NO_OVERLAP = 2**30  # a prompt start past every window: nothing overlaps


def pool_buffers(batch: int, capacity: int, width: int, dim: int, dtype) -> tuple:
    """``(raw kv, raw gate, pooled)`` of one pool, all empty."""
    raw = (batch, 1, capacity, width)
    return mx.zeros(raw, dtype), mx.zeros(raw, dtype), mx.zeros((batch, 1, capacity, dim), dtype)


def touched_windows(start: mx.array, length: int, ratio: int) -> mx.array:
    """``[B, W]`` indices of the windows holding positions ``start[b] .. start[b] + length - 1``
    (``W`` is fixed by ``length``; the last may lie past them)."""
    return start[:, None] // ratio + mx.arange((length - 1) // ratio + 2)


def window_rows(raw: mx.array, windows: mx.array, ratio: int) -> mx.array:
    """``[B, W, ratio, width]``: the raw rows of each window (indices clipped to the buffer)."""
    batch, _, capacity, width = raw.shape
    count = windows.shape[1] * ratio
    slots = mx.clip(windows[..., None] * ratio + mx.arange(ratio), 0, capacity - 1).reshape(batch, 1, count, 1)
    rows = mx.take_along_axis(raw, mx.broadcast_to(slots, (batch, 1, count, width)), axis=2)
    return rows.reshape(batch, windows.shape[1], ratio, width)


def gated_sum(kv: mx.array, gate: mx.array, ape: mx.array) -> mx.array:
    """Non-overlapping pooling: ``sum_i softmax_i(gate + ape) * kv`` over a window's rows."""
    weights = mx.softmax(gate.astype(mx.float32) + ape, axis=-2).astype(kv.dtype)
    return (kv * weights).sum(axis=-2)


def overlapped_sum(kv, gate, previous_kv, previous_gate, ape, overlaps) -> mx.array:
    """Overlapping pooling (width = 2 * dim): one softmax over the window
    before's first halves and this window's second halves; ``overlaps [B, W]``
    False leaves the window before out."""
    half = kv.shape[-1] // 2
    gate = gate + ape.astype(gate.dtype)
    previous_gate = previous_gate + ape.astype(gate.dtype)
    keep = overlaps[..., None, None]
    rows = mx.concatenate([mx.where(keep, previous_kv[..., :half], 0), kv[..., half:]], axis=-2)
    gates = mx.concatenate([mx.where(keep, previous_gate[..., :half], -mx.inf), gate[..., half:]], axis=-2)
    return (rows * mx.softmax(gates, axis=-2, precise=True)).sum(axis=-2)


def compress(pool: dict, state: tuple, x: mx.array, start: mx.array, prompt_first: mx.array | None,
             ratio: int, eps: float, inv_freq: mx.array) -> tuple:
    """One pool after ``x [B, L, d]`` at positions ``start[b] + i``: ``(raw kv, raw gate, pooled)``.

    ``prompt_first [B]`` is the first position of the prompt these tokens
    belong to when a prompt is being prefilled (None while decoding).
    """
    raw_kv, raw_gate, pooled = state
    length = x.shape[1]
    raw_kv = write_rows(raw_kv, ops.linear(pool["wkv"], x)[:, None], start)
    raw_gate = write_rows(raw_gate, ops.linear(pool["wgate"], x)[:, None], start)
    windows = touched_windows(start, length, ratio)
    if raw_kv.shape[-1] == pooled.shape[-1]:
        values = gated_sum(window_rows(raw_kv, windows, ratio), window_rows(raw_gate, windows, ratio), pool["ape"])
    else:  # one gather from the window before the first: each window's predecessor is its neighbour
        spanned = mx.concatenate([windows[:, :1] - 1, windows], axis=1)
        kv, gate = window_rows(raw_kv, spanned, ratio), window_rows(raw_gate, spanned, ratio)
        overlaps = mx.zeros(windows.shape, mx.bool_) if prompt_first is None else windows * ratio > prompt_first[:, None]
        values = overlapped_sum(kv[:, 1:], gate[:, 1:], kv[:, :-1], gate[:, :-1], pool["ape"], overlaps)
    values = ops.rms_norm(values, pool["norm"]["weight"], eps)
    values = rotate_tail(values[:, None], windows * ratio, inv_freq)
    slots = mx.broadcast_to(windows[:, None, :, None], values.shape)
    pooled = mx.put_along_axis(pooled, slots, values.astype(pooled.dtype), axis=2)
    return raw_kv, raw_gate, pooled


def prompt_overlap_start(first: mx.array, end: mx.array) -> mx.array:
    """``[B]`` the prompt start that overlap counts from: none for prompts mlx-vlm runs token by token."""
    return mx.where(end - first > DECODE_BLOCK, first, NO_OVERLAP)


def visible_windows(positions: mx.array, ratio: int, count: int) -> mx.array:
    """``[B, 1, L, count]``: pooled slot ``w`` is visible from position ``p`` iff ``w < (p + 1) // ratio``."""
    return mx.arange(count) < ((positions + 1) // ratio)[:, None, :, None]


def top_windows(indexer: dict, x, residual, pooled, visible, positions, inv_freq, heads: int, topk: int) -> mx.array:
    """``[B, L, k]`` slots of the visible pooled rows the indexer scores highest
    (``k = min(topk, slots)``): ``sum_h w_h(x) relu(q_h . pooled)`` in float32."""
    q = rotate_tail(ops.split_heads(ops.linear(indexer["wq_b"], residual), heads), positions, inv_freq)
    scores = mx.maximum(q.astype(mx.float32) @ pooled.astype(mx.float32).swapaxes(-1, -2), 0) * q.shape[-1] ** -0.5
    weights = ops.linear(indexer["weights_proj"], x).astype(mx.float32) * heads**-0.5  # [B, L, heads]
    scores = (scores * weights.transpose(0, 2, 1)[..., None]).sum(axis=1)
    scores = mx.where(visible[:, 0], scores, -mx.inf)
    k = min(topk, scores.shape[-1])
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def sparse_attention(q, latents, local_mask, pooled, chosen, visible, sinks, scale) -> mx.array:
    """``[B, H, L, D]``: one softmax (with the sink logits) over each query's
    local latent rows and its ``chosen [B, L, k]`` pooled rows (keys are values)."""
    batch, _, length, dim = q.shape
    picked = mx.take_along_axis(pooled[:, 0], chosen.reshape(batch, -1)[..., None], axis=1)
    picked = picked.reshape(batch, length, -1, dim)  # [B, L, k, D]
    picked_visible = mx.take_along_axis(visible[:, 0], chosen, axis=-1)[:, None]
    q = q * scale
    local = mx.where(local_mask, q @ latents.swapaxes(-1, -2), -mx.inf)
    chosen_scores = (q.transpose(0, 2, 1, 3) @ picked.swapaxes(-1, -2)).transpose(0, 2, 1, 3)
    chosen_scores = mx.where(picked_visible, chosen_scores, -mx.inf)
    normalizer = mx.logaddexp(mx.logsumexp(local, -1, keepdims=True), mx.logsumexp(chosen_scores, -1, keepdims=True))
    normalizer = mx.logaddexp(normalizer, sinks[None, :, None, None])
    out = mx.exp(local - normalizer) @ latents
    out = out + (mx.exp(chosen_scores - normalizer).transpose(0, 2, 1, 3) @ picked).transpose(0, 2, 1, 3)
    return out.astype(q.dtype)
