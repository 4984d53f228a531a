"""The cache's life outside a round: allocated empty, grown in capacity
buckets, rows placed, gathered, cut out and freed between rounds, and every write a
launch will make checked on the host first.

Attention reads whole buffers, so a generation starts in the smallest
bucket and grows as its context does: a round costs what its live context
costs, and each bucket compiles its kernels once.
"""

import math
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .cache import Cache, map_arrays, map_slots
from .rng import row_seeds
from .targets import activation_dtype
from .types import Params

CAPACITY_BUCKET = 256


def init_cache(params: Params, batch_size: int, capacity: int, seed: int = 0) -> Cache:
    """An empty cache; row b draws with the seed ``rng.row_seeds(seed, B)[b]``.
    Its policy is made by the first round (``policy.Policy``)."""
    spec = params.spec
    return Cache(
        target=spec.target_adapter.init_kv(spec.target, batch_size, capacity,
                                           activation_dtype(spec.target_adapter.layout, params.target)),
        draft=spec.draft_arch.init_context(spec.draft, batch_size, capacity),
        length=mx.zeros((batch_size,), mx.int32),
        seeds=row_seeds(seed, batch_size),
        history=mx.zeros((batch_size, capacity), mx.int32),
    )


def holds_recurrent_states(params: Params) -> bool:
    """Whether the pair's caches keep recurrent states (a hybrid target):
    all of them do, or none, so an empty one tells."""
    return init_cache(params, 1, capacity_for(1)).recurrent


def capacity_for(slots: int) -> int:
    """The capacity bucket holding ``slots`` positions: a multiple of a quarter
    of the power of two below it (and of ``CAPACITY_BUCKET``), so buckets waste
    at most a quarter of a buffer and a long generation visits few of them."""
    step = max(CAPACITY_BUCKET, (1 << (max(slots, 1).bit_length() - 1)) // 4)
    return math.ceil(slots / step) * step


def grow_cache(params: Params, cache: Cache, capacity: int) -> Cache:
    """The same state in buffers of ``capacity`` slots (never smaller)."""
    if capacity <= cache.capacity:
        return cache
    fresh = init_cache(params, cache.batch_size, capacity)

    def keep(state: mx.array, larger: mx.array) -> mx.array:
        larger[:, :, : state.shape[2]] = state
        return larger

    history = mx.concatenate([cache.history, fresh.history[:, cache.capacity :]], axis=1)
    return cache._replace(target=map_slots(keep, cache.target, fresh.target),
                          draft=map_slots(keep, cache.draft, fresh.draft), history=history)


def place_rows(cache: Cache, rows: Sequence[int], part: Cache) -> Cache:
    """``cache`` with its rows ``rows`` replaced by the rows of ``part`` (same
    capacity; every buffer is batch-major). The policy is ``cache``'s, the
    new sequences at the batch's rates (``Policy.entered``); a row's
    prepared proposals no longer match its anchor, so the next round
    prepares that row's afresh."""
    index = mx.array(list(rows))

    def put(batch: mx.array, new: mx.array) -> mx.array:
        batch[index] = new
        return batch

    placed = map_arrays(put, cache, part)
    return placed if cache.policy is None else placed._replace(policy=cache.policy.entered(list(rows)))


def take_rows(tree, rows: Sequence[int], batch: int):
    """Rows ``rows`` of every (batch-major) array of ``tree``, in that order,
    then zero rows up to ``batch``: a batch's state moved into another size.
    Zero rows are free rows (length 0; an insert overwrites them whole). A
    ``Cache``'s policy moves its rows alike (``Policy.take``)."""
    index = mx.array(list(rows), mx.int32)

    def take(array: mx.array) -> mx.array:
        padding = mx.zeros((batch - index.size, *array.shape[1:]), array.dtype)
        return mx.concatenate([array[index], padding]) if index.size else padding

    if isinstance(tree, Cache):
        taken = map_arrays(take, tree)
        return taken._replace(policy=None if tree.policy is None else tree.policy.take(list(rows), batch))
    return tree_map(take, tree)


def row_cache(cache: Cache, row: int, length: int, states: list | None = None) -> Cache:
    """Row ``row`` as a one-row cache holding its first ``length`` positions,
    in buffers of its own cut to the bucket of ``length`` (a slice of the
    batch's buffers would keep all of them alive). ``states``: per target
    layer, a recurrent entry of the whole batch (None for a layer of slots)
    whose row ``row`` replaces the row's present state, e.g. the state it
    had at ``length`` before a round committed more."""
    one = take_rows(cache._replace(policy=None), [row], 1)
    if states is not None:
        one = one._replace(target=[entry if state is None else take_rows(state, [row], 1)
                                   for entry, state in zip(one.target, states)])
    cut = lambda buffer: buffer[:, :, : capacity_for(length)]  # noqa: E731
    one = one._replace(target=map_slots(cut, one.target), draft=map_slots(cut, one.draft),
                       length=mx.array([length], mx.int32), history=one.history[:, : capacity_for(length)])
    return map_arrays(mx.contiguous, one)


def free_row(cache: Cache, row: int) -> Cache:
    """``cache`` with ``row`` holding nothing: its slots are reused."""
    return cache._replace(length=mx.where(mx.arange(cache.batch_size) == row, 0, cache.length))


def check_free_slots(capacity: int, lengths: np.ndarray, width: int) -> None:
    """A verify writes ``width`` rows at every row's length: refuse, before
    anything runs, a cache of ``capacity`` slots whose rows at ``lengths``
    lack the room."""
    free = capacity - np.asarray(lengths)
    short = np.flatnonzero(free < width)
    if short.size:
        raise ValueError(
            f"cache row(s) {short.tolist()} have {free[short].tolist()} free slot(s) but a verify of width "
            f"{width} writes {width}; grow the cache first (dspark_fn.grow_cache(params, cache, capacity)) "
            f"or allocate a larger one"
        )


def check_writes(starts, count: int, capacity: int, launch: str, rows: Sequence[int] | None = None) -> None:
    """Refuse, on the host and before ``launch`` runs, a write of ``count``
    slots at ``starts[i]`` (cache row ``rows[i]``, default ``i``) that ends
    past ``capacity``: a write out of bounds corrupts memory instead of
    failing, so an internal inconsistency must stop here."""
    starts = np.asarray(starts)
    over = np.flatnonzero(starts + count > capacity)
    if over.size:
        i = int(over[0])
        row = i if rows is None else rows[i]
        raise ValueError(
            f"{launch}: cache row {row} at length {int(starts[i])} would write {count} slots past the capacity "
            f"{capacity}"
        )


def check_rows(rows: Sequence[int], count: int, batch: int) -> None:
    """``rows`` must name ``count`` distinct rows of a batch of ``batch``
    (a scatter to a row outside the buffers writes out of bounds)."""
    if len(rows) != count or len(set(rows)) != len(rows):
        raise ValueError(f"{count} prompts need {count} distinct rows, got {list(rows)}")
    outside = [row for row in rows if not 0 <= row < batch]
    if outside:
        raise ValueError(f"row {outside[0]} is not a row of the batch of {batch}")
