"""The decode state as data: fixed-capacity KV buffers plus valid lengths,
and the states of recurrent layers.

Slot ``j`` of every buffer holds absolute position ``j``. A write puts rows
at ``start[b] ..`` of each batch row; rollback is just a smaller ``length``:
stale slots are masked out and overwritten by the next write.

A recurrent layer (a convolution window, a delta-net or SSM state) has no
slots: its cache entry is a dict of arrays holding the state after the
committed positions. A forward over ``L`` tokens leaves it *pending*
(``PendingWindow`` / ``PendingStates``: the state after each of the ``L``
tokens), and ``settle`` keeps, row by row, the state after the first
``count[b]`` of them, so rollback stays data here too. Nothing has a shape
that depends on how many draft tokens were accepted.
"""

from typing import Any, NamedTuple

import mlx.core as mx
from mlx.utils import tree_map


class Cache(NamedTuple):
    """Everything that changes while decoding.

    target:  per target layer, ``(keys, values)`` each ``[B, H_kv, capacity, D]``.
    draft:   the draft architecture's context state (per draft layer K/V of the
             committed context rows; its layout belongs to the architecture).
    length:  ``[B] int32``, committed positions per row. The pending anchor
             token (threaded separately as ``tokens``) sits at ``length``.
    seeds:   ``[B] uint32``, each row's random seed: its draws are a pure
             function of its seed and its length (``rng.py``), so a run is
             reproducible and a row's samples do not depend on the others.
    history: ``[B, capacity] int32``, the token at each committed slot: what
             copy proposals are matched in (``copying.py``). Written where
             the K/V are, so rollback by length holds for it too.
    policy:  what the coming rounds verify and what chose it (``policy.Policy``:
             each row's measured acceptance, the learned round costs, the
             next round's proposals prepared with the last verify), host
             data that ``speculate`` reads and returns updated; None until
             the first round makes one. Kernels never see it.
    """

    target: list
    draft: Any
    length: mx.array
    seeds: mx.array
    history: mx.array
    policy: Any = None

    @property
    def capacity(self) -> int:
        return first_slot_buffer((self.target, self.draft)).shape[2]

    @property
    def recurrent(self) -> bool:
        """Whether any target layer keeps a recurrent state (reusable only at the length it was stored at)."""
        return any(is_recurrent(entry) for entry in self.target)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]


def map_arrays(fn, cache: Cache, *others: Cache) -> Cache:
    """``tree_map`` over the arrays of ``cache`` (and of ``others``, caches of
    the same layout); the policy is ``cache``'s, untouched."""
    arrays = tree_map(fn, tuple(cache[:-1]), *[tuple(other[:-1]) for other in others])
    return Cache(*arrays, policy=cache.policy)


def device_state(cache: Cache) -> Cache:
    """The cache as a kernel takes it: its arrays, no policy."""
    return cache._replace(policy=None)


def write_tokens(history: mx.array, tokens: mx.array, start: mx.array) -> mx.array:
    """``history [B, C]`` with ``tokens [B, L]`` at slots ``start[b] + i``."""
    slots = start[:, None] + mx.arange(tokens.shape[1])
    return mx.put_along_axis(history, slots, tokens.astype(history.dtype), axis=1)


def kv_buffers(batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype=mx.float32):
    shape = (batch, num_kv_heads, capacity, head_dim)
    return mx.zeros(shape, dtype), mx.zeros(shape, dtype)


def write_rows(buffer: mx.array, rows: mx.array, start: mx.array) -> mx.array:
    """Write ``rows [B, H, L, D]`` into ``buffer [B, H, C, D]`` at slots ``start[b] + i``."""
    batch, heads, length, dim = rows.shape
    slots = start[:, None] + mx.arange(length)
    index = mx.broadcast_to(slots[:, None, :, None], rows.shape)
    return mx.put_along_axis(buffer, index, rows.astype(buffer.dtype), axis=2)


def positions_from(start: mx.array, length: int) -> mx.array:
    """``[B, L]`` absolute positions ``start[b] + i``."""
    return start[:, None] + mx.arange(length)


def causal_mask(positions: mx.array, capacity: int, window: int | None = None) -> mx.array:
    """``[B, 1, L, capacity]``: slot ``j`` is visible from position ``q`` iff
    ``j <= q`` (and ``j > q - window`` for a sliding window)."""
    slots = mx.arange(capacity)[None, None, None, :]
    query = positions[:, None, :, None]
    visible = slots <= query
    if window is not None:
        visible = visible & (slots > query - window)
    return visible


def span_mask(spans: mx.array, start: mx.array, capacity: int) -> mx.array:
    """``[B, 1, L, capacity]``: slot ``j`` is visible from chunk position ``i``
    when both hold tokens of the same span (``spans [B, L]``, -1 outside any)
    of the chunk written at ``start[b]``: a span that attends to itself whole."""
    length = spans.shape[1]
    index = mx.arange(capacity)[None, :] - start[:, None]
    inside = (index >= 0) & (index < length)
    slot_spans = mx.where(inside, mx.take_along_axis(spans, mx.clip(index, 0, length - 1), axis=1), -1)
    return ((spans[:, :, None] == slot_spans[:, None, :]) & (spans[:, :, None] >= 0))[:, None]


def prefix_mask(length: mx.array, capacity: int, window: int | None = None) -> mx.array:
    """``[B, 1, 1, capacity]``: the first ``length[b]`` slots are visible (only
    the last ``window`` of them with a sliding window)."""
    slots = mx.arange(capacity)[None, None, None, :]
    end = length[:, None, None, None]
    visible = slots < end
    if window is not None:
        visible = visible & (slots >= end - window)
    return visible


def block_slots(length: mx.array, width: int) -> tuple[mx.array, mx.array, mx.array]:
    """Where each of ``width`` draft block slots sits: ``(start [B, W], offset
    [W], block [W])``. ``length [B]``: one block per row, at the row's
    committed length. ``length [B, N]`` (training): ``N`` blocks of ``width //
    N`` slots side by side in each row, block ``n`` at ``length[b, n]``,
    sharing the row's context instead of one copy of it per block."""
    if length.ndim == 1:
        length = length[:, None]
    size = width // length.shape[1]
    slot = mx.arange(width)
    block, offset = slot // size, slot % size
    start = mx.broadcast_to(length, (length.shape[0], width)) if length.shape[1] == 1 else length[:, block]
    return start, offset, block


def block_positions(length: mx.array, width: int) -> mx.array:
    """``[B, W]`` positions of the block slots (``block_slots``): each block's start plus the slot's offset."""
    start, offset, _ = block_slots(length, width)
    return start + offset


def block_mask(length: mx.array, capacity: int, width: int, window: int | None = None,
               causal: bool = False) -> mx.array:
    """``[B, 1, width, capacity + width]`` over ``[context slots ; block slots]``
    for the draft blocks of ``block_slots``: a slot sees the context before its
    block's start and the slots of its own block. Bidirectional: the whole
    block, and only the last ``window`` context slots with a window. Causal:
    its block's earlier slots, and with a window only the positions after
    its own minus ``window``."""
    start, offset, block = block_slots(length, width)
    slots = mx.arange(capacity)[None, None, None, :]
    end = start[:, None, :, None]
    context = slots < end
    inside = block[:, None] == block[None, :]
    if causal:
        if window is not None:
            context = context & (slots > (start + offset)[:, None, :, None] - window)
        earlier = offset[None, :] <= offset[:, None]
        if window is not None:
            earlier = earlier & (offset[None, :] > offset[:, None] - window)
        inside = inside & earlier
    elif window is not None:
        context = context & (slots >= end - window)
    inside = mx.broadcast_to(inside[None, None], (start.shape[0], 1, width, width))
    return mx.concatenate([context, inside], axis=-1)


def is_recurrent(entry) -> bool:
    """A cache entry holding a recurrent layer's state (a dict) rather than slot buffers."""
    return isinstance(entry, dict)


def map_slots(fn, tree, *others):
    """``tree_map`` over the slot buffers of cache trees (slots along axis 2);
    recurrent entries have no slots and come through from ``tree`` as they are."""
    return tree_map(lambda x, *rest: x if is_recurrent(x) else fn(x, *rest), tree, *others, is_leaf=is_recurrent)


def first_slot_buffer(tree) -> mx.array | None:
    """The first array of a cache tree that holds slots (recurrent states
    hold none), found without flattening the whole tree: the capacity is
    read a few times a round, before each write is checked."""
    if isinstance(tree, mx.array):
        return tree
    if isinstance(tree, (list, tuple)):
        return next((found for entry in tree if (found := first_slot_buffer(entry)) is not None), None)
    return None  # a recurrent state (a dict), or no array at all


class PendingWindow(NamedTuple):
    """A convolution window after a forward: the ``size`` previous inputs then the
    call's ``L`` inputs, ``rows [B, size + L, C]``."""

    rows: mx.array
    size: int


class PendingStates(NamedTuple):
    """A recurrent state after a forward: ``history [B, L + 1, ...]``, the state
    before the call and after each of its tokens."""

    history: mx.array


def settle_entry(entry, count: mx.array):
    """The committed state of one pending entry after the first ``count [B]`` tokens of its call."""
    if isinstance(entry, PendingWindow):
        index = count[:, None] + mx.arange(entry.size)
        return mx.take_along_axis(entry.rows, index[..., None], axis=1)
    if isinstance(entry, PendingStates):
        index = count.reshape(-1, *([1] * (entry.history.ndim - 1)))
        return mx.take_along_axis(entry.history, index, axis=1)[:, 0]
    return entry


def settle(layers: list, count: mx.array) -> list:
    """Per target layer: recurrent states settled after ``count [B]`` tokens of the last
    forward (the accepted ones: this is a recurrent layer's rollback); slot buffers as they are."""
    return [
        {name: settle_entry(value, count) for name, value in entry.items()} if is_recurrent(entry) else entry
        for entry in layers
    ]
