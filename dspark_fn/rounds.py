"""One speculative round as pure functions over fixed shapes: prefill, insert,
draft, verify, accept and commit.

A round is ``draft_block -> verify -> accept -> commit``. It runs as two
compiled kernels: the draft (one per model pair and sampling mode) and the
verify (one per pair, width and sampling mode). The verify width is static,
acceptance only changes array values (the new ``length``), and each row's
proposal length is data (``limit``), so every kernel compiles once per
capacity bucket and switching among widths never retraces. So is where a
row's proposal comes from: the draft's, or a copy of its own context
(``Copies``, a point mass); a round of copies alone skips the draft kernel.
"""

import math
from collections import Counter
from functools import lru_cache
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from . import rng
from .accept import Verdict, accept
from .cache import Cache, map_slots, settle
from .drafts.heads import DRAFT_VOCAB_KEY, draft_chain
from .rng import row_seeds, uniforms
from .sampling import GREEDY, Mode, RowSampling, batch_sampling, choose, log_probs, token_log_probs
from .targets import activation_dtype
from .types import Copies, PairSpec, Params, Proposal, Round, TokenLogProbs

PREFILL_CHUNK = 64  # the smallest chunk: a prompt pads to a multiple of it
LONG_PREFILL_CHUNK = 256  # long stretches of a prompt go in these (bigger matmuls run faster)
CAPACITY_BUCKET = 256

# Incremented in the Python body of each compiled kernel, i.e. once per trace.
TRACE_COUNTS: Counter = Counter()


def init_cache(params: Params, batch_size: int, capacity: int, seed: int = 0) -> Cache:
    """An empty cache; row b draws with the seed ``rng.row_seeds(seed, B)[b]``."""
    spec = params.spec
    return Cache(
        target=spec.target_adapter.init_kv(spec.target, batch_size, capacity, activation_dtype(params.target)),
        draft=spec.draft_arch.init_context(spec.draft, batch_size, capacity),
        length=mx.zeros((batch_size,), mx.int32),
        seeds=row_seeds(seed, batch_size),
    )


def grow_cache(params: Params, cache: Cache, capacity: int) -> Cache:
    """The same state in buffers of ``capacity`` slots (never smaller).

    Attention reads whole buffers, so ``generate`` starts small and grows
    the cache in ``capacity_for`` buckets as the context does: a round
    costs what its live context costs, and each bucket compiles once.
    """
    if capacity <= cache.capacity:
        return cache
    fresh = init_cache(params, cache.batch_size, capacity)

    def keep(state: mx.array, larger: mx.array) -> mx.array:
        larger[:, :, : state.shape[2]] = state
        return larger

    return Cache(
        map_slots(keep, cache.target, fresh.target),
        map_slots(keep, cache.draft, fresh.draft),
        cache.length,
        cache.seeds,
    )


def draft_block(params: Params, cache: Cache, tokens: mx.array, sampling=GREEDY) -> Proposal:
    """Draft a block after the anchors ``tokens [B]``: the Markov chain picks
    each slot by argmax, or draws it from the row's ``sampling`` distribution
    (one ``Sampling`` for all rows or one per row)."""
    return _draft_block(params, cache, tokens, *batch_sampling(sampling, tokens.shape[0]))


def _draft_block(params: Params, cache: Cache, tokens: mx.array, rows: RowSampling, mode: Mode) -> Proposal:
    spec = params.spec
    batch = tokens.shape[0]
    mask = mx.full((batch, spec.block_size - 1), spec.draft.mask_token_id, tokens.dtype)
    block_ids = mx.concatenate([tokens[:, None], mask], axis=1)
    base, hidden = spec.draft_arch.block_forward(
        spec.draft, params.draft, cache.draft, cache.length, block_ids
    )
    vocab = params.draft.get(DRAFT_VOCAB_KEY)  # target id of each draft-vocabulary entry

    def pick(logits, slot):
        draws = uniforms(cache.seeds, cache.length, rng.DRAFT_SLOT + slot, logits.shape[1:]) if mode.sampled else None
        choice = choose(logits, rows, mode, draws)
        return (choice if vocab is None else vocab[choice]).astype(tokens.dtype)

    drafted, logits, confidence = draft_chain(spec.draft, params.draft, base, hidden, tokens, pick)
    if not mode.sampled:
        return Proposal(drafted, logits, confidence, base, hidden, logits)
    distribution = log_probs(logits, rows, mode)
    if vocab is not None:  # no mass outside the draft vocabulary
        full = mx.full((*distribution.shape[:-1], spec.target.vocab_size), -mx.inf, distribution.dtype)
        full[..., vocab] = distribution
        distribution = full
    return Proposal(drafted, logits, confidence, base, hidden, distribution)


def _idle_rows_unchanged(verdict: Verdict, block: mx.array, active: mx.array) -> Verdict:
    """Rows that finished keep their anchor and emit nothing."""
    return Verdict(
        mx.where(active, verdict.accepted, 0),
        mx.where(active, verdict.next_tokens, block[:, 0]),
        mx.where(active[:, None], verdict.emitted, -1),
    )


def verify_and_commit(
    params: Params,
    cache: Cache,
    block: mx.array,
    draft_log_probs: mx.array | None,
    rows: RowSampling,
    mode: Mode,
    limit: mx.array | None = None,
    active: mx.array | None = None,
) -> tuple[Cache, Verdict]:
    """Run the target on ``block = [anchor, drafts...]``, accept, and commit.

    Every row's K/V and draft context are written; the new ``length`` keeps
    only the anchor and the accepted drafts, which is the whole rollback
    (recurrent layers settle on the state after those same tokens).
    ``limit [B]`` caps each row's accepted drafts; ``active [B]`` rows that
    are False commit nothing. Returns ``(cache, verdict, target logits [B, W, V])``.
    """
    spec = params.spec
    adapter = spec.target_adapter
    hidden, features, target_kv = adapter.forward(
        spec.target, params.target, cache.target, block, cache.length, spec.taps
    )
    logits = adapter.logits(spec.target, params.target, hidden)
    batch, width = block.shape

    def draws():
        return (
            uniforms(cache.seeds, cache.length, rng.ACCEPT, (width - 1,)),
            uniforms(cache.seeds, cache.length, rng.CORRECTION, (logits.shape[-1],)),
        )

    verdict = accept(block, logits, draft_log_probs, rows, mode, draws, limit)
    if active is not None:
        verdict = _idle_rows_unchanged(verdict, block, active)
    draft_state = spec.draft_arch.extend_context(
        spec.draft, params.draft, cache.draft, features, cache.length
    )
    committed = verdict.accepted + 1 if active is None else mx.where(active, verdict.accepted + 1, 0)
    return Cache(settle(target_kv, committed), draft_state, cache.length + committed, cache.seeds), verdict, logits


@lru_cache(maxsize=None)
def _draft_kernel(spec: PairSpec, mode: Mode):
    def draft_(target, draft, cache, tokens, rows):
        TRACE_COUNTS["draft"] += 1
        return tuple(_draft_block(Params(spec, target, draft), Cache(*cache), tokens, RowSampling(*rows), mode))

    return mx.compile(draft_)


def point_mass(tokens: mx.array, vocab_size: int) -> mx.array:
    """Log-probabilities ``[..., V]`` of proposals that are certain: 0 at each
    of ``tokens [...]``, -inf elsewhere. Rejection sampling then keeps a
    copied token with the target's probability of it and otherwise draws
    from the target without it (renormalised): exact, as for any draft."""
    return mx.where(mx.arange(vocab_size) == tokens[..., None], 0.0, -mx.inf)


@lru_cache(maxsize=None)
def _verify_kernel(spec: PairSpec, width: int, mode: Mode, top_log_probs: int | None = None):
    def verify_(target, draft, cache, tokens, drafts, draft_log_probs, confidence_logits, copies, copying, rows,
                limit, active):
        TRACE_COUNTS["verify"] += 1
        proposed = mx.where(copying[:, None], copies, drafts[:, : width - 1])
        block = mx.concatenate([tokens[:, None], proposed], axis=1)
        if mode.sampled:
            copied = point_mass(copies, spec.target.vocab_size)
            draft_log_probs = mx.where(copying[:, None, None], copied, draft_log_probs[:, : width - 1])
        before = Cache(*cache)
        cache, verdict, logits = verify_and_commit(
            Params(spec, target, draft), before, block, draft_log_probs, RowSampling(*rows), mode, limit, active
        )
        batch = tokens.shape[0]
        if top_log_probs is None:
            scored = (mx.zeros((batch, 0)), mx.zeros((batch, 0, 0), mx.int32), mx.zeros((batch, 0, 0)))
        else:
            scored = token_log_probs(logits, verdict.emitted, RowSampling(*rows), mode, top_log_probs)
        result = Round(
            emitted=verdict.emitted,
            count=cache.length - before.length,
            next_tokens=verdict.next_tokens,
            accepted=verdict.accepted,
            drafted=block[:, 1:],
            confidences=mx.where(copying[:, None], 1.0, mx.sigmoid(confidence_logits[:, : width - 1])),
            log_probs=scored[0],
            top_ids=scored[1],
            top_log_probs=scored[2],
        )
        return tuple(cache), tuple(result)

    return mx.compile(verify_)


def check_width(spec: PairSpec, width: int) -> None:
    if not 1 <= width <= spec.block_size + 1:
        raise ValueError(f"verify width {width} must be in 1..{spec.block_size + 1}")


def propose(params: Params, cache: Cache, tokens: mx.array, sampling=GREEDY) -> Proposal:
    """The compiled ``draft_block``."""
    rows, mode = batch_sampling(sampling, tokens.shape[0])
    kernel = _draft_kernel(params.spec, mode)
    return Proposal(*kernel(params.target, params.draft, tuple(cache), tokens, tuple(rows)))


def no_proposal(batch_size: int) -> Proposal:
    """What a width-1 verify (the target alone) reads instead of a draft."""
    empty = mx.zeros((batch_size, 0))
    return Proposal(empty.astype(mx.int32), None, empty, None, None, empty[..., None])


def undrafted(params: Params, batch_size: int, mode: Mode) -> Proposal:
    """What a wider verify reads in a round without a draft pass (every row
    copies or verifies nothing): zeros shaped as the draft's proposal, so
    the round runs the same compiled kernel."""
    slots = params.spec.block_size
    log_probs = mx.zeros((batch_size, slots, params.spec.target.vocab_size) if mode.sampled else (0,))
    return Proposal(mx.zeros((batch_size, slots), mx.int32), None, mx.zeros((batch_size, slots)), None, None, log_probs)


def verify(
    params: Params,
    cache: Cache,
    tokens: mx.array,
    proposal: Proposal,
    width: int,
    *,
    sampling=GREEDY,
    limit: mx.array | None = None,
    active: mx.array | None = None,
    copies: Copies | None = None,
    top_log_probs: int | None = None,
) -> tuple[Cache, Round]:
    """Verify ``width`` tokens (anchor + the first ``width - 1`` drafts of
    ``proposal``), accept at most ``limit[b]`` drafts per row, commit.
    ``copies`` (default none) gives rows their own proposals instead of
    the draft's, each a point mass (certain) under rejection sampling.
    ``top_log_probs`` (K, default none) fills the round's ``log_probs`` and
    its K most likely tokens at every emitted position (``sampling.token_log_probs``),
    from the target logits the verify computed anyway.

    ``active`` (default all) marks the rows still generating; the others
    keep their state. Every row needs ``width`` free slots; a cache without
    them raises ``ValueError`` before anything runs (``grow_cache`` makes room).
    """
    check_width(params.spec, width)
    check_free_slots(cache, width)
    rows, mode = batch_sampling(sampling, tokens.shape[0])
    return verify_unchecked(params, cache, tokens, proposal, width, rows, mode, limit, active, copies, top_log_probs)


def check_free_slots(cache: Cache, width: int) -> None:
    """A verify writes ``width`` rows at every row's length: refuse, before
    anything runs, a cache that lacks the room (reads the lengths: one sync)."""
    free = cache.capacity - np.array(cache.length)
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


def verify_unchecked(params, cache, tokens, proposal, width, rows: RowSampling, mode: Mode, limit=None, active=None,
                     copies: Copies | None = None, top_log_probs: int | None = None):
    """``verify`` without its checks, for the driver: it sizes its cache and
    checks each row's room (``check_writes``) from the lengths it tracks on
    the host, with no read from the device."""
    batch = tokens.shape[0]
    limit = mx.full((batch,), width - 1, mx.int32) if limit is None else limit
    active = mx.ones((batch,), mx.bool_) if active is None else active
    if copies is None:
        copies = Copies(mx.zeros((batch, width - 1), mx.int32), mx.zeros((batch,), mx.bool_))
    # Greedy rules never read the draft's distribution: a fixed stand-in keeps
    # one kernel whatever proposed (the draft's logits, or no draft at all).
    log_probs = proposal.log_probs if mode.sampled else mx.zeros((0,))
    kernel = _verify_kernel(params.spec, width, mode, top_log_probs)
    cache, result = kernel(
        params.target, params.draft, tuple(cache), tokens, proposal.tokens.astype(mx.int32), log_probs,
        proposal.confidence_logits.astype(mx.float32), copies.tokens.astype(mx.int32), copies.rows, tuple(rows),
        limit, active,
    )
    return Cache(*cache), Round(*result)


def speculate(
    params: Params,
    cache: Cache,
    tokens: mx.array,
    *,
    width: int | None = None,
    sampling=GREEDY,
    limit: mx.array | None = None,
    active: mx.array | None = None,
) -> tuple[Cache, Round]:
    """One DSpark round from the anchors ``tokens [B]``: draft, verify ``width``
    tokens (anchor + ``width - 1`` drafts), accept, commit. ``sampling`` is one
    ``Sampling`` for every row or one per row.

    Returns ``(cache, Round)``; ``Round.next_tokens`` are the next anchors.
    Only the room check reads from the device.
    """
    width = params.spec.block_size + 1 if width is None else width
    check_width(params.spec, width)
    proposal = propose(params, cache, tokens, sampling) if width > 1 else no_proposal(tokens.shape[0])
    return verify(params, cache, tokens, proposal, width, sampling=sampling, limit=limit, active=active)


def verify_block(
    params: Params,
    cache: Cache,
    block: mx.array,
    *,
    draft_log_probs: mx.array | None = None,
    sampling=GREEDY,
):
    """Verify a caller-chosen ``block [B, W] = [anchor, proposals...]`` and commit.

    The same verify/accept/commit as ``speculate``, for proposals that do not
    come from the draft (replays, tests, external drafters). Sampling needs
    the proposals' distribution ``draft_log_probs [B, W - 1, V]``.
    """
    batch, width = block.shape
    if draft_log_probs is None:
        if batch_sampling(sampling, batch)[1].sampled:
            raise ValueError("rejection sampling needs draft_log_probs, the distribution the proposals came from")
        draft_log_probs = mx.zeros((batch, width - 1, params.spec.target.vocab_size))
    proposal = Proposal(
        block[:, 1:], None, mx.zeros((batch, width - 1)), None, None, draft_log_probs
    )
    return verify(params, cache, block[:, 0], proposal, width, sampling=sampling)


@lru_cache(maxsize=None)
def _prefill_kernel(spec: PairSpec):
    def chunk(target, draft, cache, tokens, start, first, last_row, last_logits):
        TRACE_COUNTS["prefill"] += 1
        adapter = spec.target_adapter
        target_kv, draft_state = cache
        if adapter.prompt_forward is None:
            hidden, features, target_kv = adapter.forward(spec.target, target, target_kv, tokens, start, spec.taps)
        else:
            hidden, features, target_kv = adapter.prompt_forward(
                spec.target, target, target_kv, tokens, start, spec.taps, first, last_row + 1
            )
        draft_state = spec.draft_arch.extend_context(spec.draft, draft, draft_state, features, start)
        row = last_row - start
        in_chunk = (row >= 0) & (row < tokens.shape[1])
        picked = mx.take_along_axis(hidden, mx.clip(row, 0, tokens.shape[1] - 1)[:, None, None], axis=1)
        logits = adapter.logits(spec.target, target, picked[:, 0])
        last_logits = mx.where(in_chunk[:, None], logits, last_logits)
        return (target_kv, draft_state), last_logits

    return mx.compile(chunk)


def as_rows(prompt) -> list[list[int]]:
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    rows = [list(prompt)] if prompt and isinstance(prompt[0], int) else [list(r) for r in prompt]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("prompt is empty: give at least one token per row")
    return rows


def _distinct_rows(rows: list[list[int]], starts: np.ndarray) -> tuple[list[int], list[int]]:
    """Rows that run: the first of each group of fresh rows (nothing committed)
    with equal prompts, and every row with a committed prefix of its own; and
    for each row the index of the one that runs for it."""
    first_seen: dict = {}
    keys = [tuple(r) if start == 0 else ("prefix", i) for i, (r, start) in enumerate(zip(rows, starts))]
    source = [first_seen.setdefault(key, len(first_seen)) for key in keys]
    return [source.index(i) for i in range(len(first_seen))], source


def chunk_spans(length: int, sizes: tuple) -> list[tuple[int, int]]:
    """``(begin, size)`` of each chunk covering ``length`` (a multiple of the
    smallest size): the largest size that still fits first."""
    spans, begin = [], 0
    while begin < length:
        size = next(size for size in sizes if begin + size <= length)
        spans.append((begin, size))
        begin += size
    return spans


def prefill(params: Params, cache: Cache, prompt, *, sampling=GREEDY, chunk_size: int | None = None,
            grow: bool = False, top_log_probs: int | None = None):
    """Run the prompt(s) through the target in fixed chunks and extend the draft context.

    ``prompt`` is a token list, a list of token lists (one per batch row, any
    lengths) or an int array. Each row continues from its committed length
    (0 in a fresh cache; a cached conversation prefix otherwise). Returns
    ``(cache, tokens)``: the first generated token of each row (argmax, or a
    draw under the row's ``sampling``), the first anchor. Rows that start
    together with the same tokens (n samples of one prompt) are run once and
    their cache rows copied. Chunks hold ``LONG_PREFILL_CHUNK`` tokens while
    that many remain, then ``PREFILL_CHUNK`` (``chunk_size``: all of that
    size), never more than the capacity. With ``grow`` the cache grows in
    ``capacity_for`` buckets as the chunks advance, so each chunk attends
    over the bucket its own end needs, not the whole prompt's (a long
    prompt compiles one chunk kernel per bucket it passes); without, the
    prompt must fit the cache. With ``top_log_probs`` (K) it returns
    ``(cache, tokens, TokenLogProbs)``: the first tokens' log-probabilities
    and the target's K most likely first tokens.
    """
    rows = as_rows(prompt)
    if len(rows) != cache.batch_size:
        raise ValueError(f"{len(rows)} prompts for a cache of batch size {cache.batch_size}")
    vocab = params.spec.target.vocab_size
    if any(not 0 <= t < vocab for r in rows for t in r):
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    sizes = (chunk_size,) if chunk_size else (LONG_PREFILL_CHUNK, PREFILL_CHUNK)
    sizes = tuple(min(size, cache.capacity) for size in sizes)
    starts = np.array(cache.length)
    padded_length = math.ceil(max(len(r) for r in rows) / sizes[-1]) * sizes[-1]
    if not grow and (starts + padded_length).max() > cache.capacity:
        longest = int((starts + np.array([len(r) for r in rows])).max())
        raise ValueError(
            f"prompt of {longest} tokens does not fit the cache capacity {cache.capacity} "
            f"(prefill pads to {int(starts.max()) + padded_length}); allocate a larger cache or shorten the prompt"
        )
    running, source = _distinct_rows(rows, starts)
    state = cache
    if len(running) < len(rows):  # every cache array is batch-major
        state = tree_map(lambda a: a[mx.array(running)], state)
    offsets = mx.array(starts[running], mx.int32)
    padded = mx.array([rows[i] + [0] * (padded_length - len(rows[i])) for i in running], mx.int32)
    last_rows = offsets + mx.array([len(rows[i]) - 1 for i in running], mx.int32)
    kernel = _prefill_kernel(params.spec)
    last_logits = mx.zeros((len(running), vocab), mx.float32)
    for begin, size in chunk_spans(padded_length, sizes):
        if grow:
            state = grow_cache(params, state, capacity_for(int(starts.max()) + begin + size))
        check_writes(starts[running] + begin, size, state.capacity, "prefill chunk", rows=running)
        chunk = padded[:, begin : begin + size]
        (target, draft), last_logits = kernel(
            params.target, params.draft, (state.target, state.draft), chunk, offsets + begin, offsets, last_rows,
            last_logits,
        )
        state = state._replace(target=target, draft=draft)
    if len(running) < len(rows):
        index = mx.array(source)
        state, last_logits = tree_map(lambda a: a[index], (state, last_logits))
    lengths = mx.array(starts + np.array([len(r) for r in rows]), mx.int32)
    sampled_rows, mode = batch_sampling(sampling, len(rows))
    draws = uniforms(cache.seeds, lengths, rng.PREFILL, (vocab,)) if mode.sampled else None
    state, tokens = state._replace(length=lengths, seeds=cache.seeds), choose(last_logits, sampled_rows, mode, draws)
    if top_log_probs is None:
        return state, tokens
    return state, tokens, TokenLogProbs(*token_log_probs(last_logits, tokens, sampled_rows, mode, top_log_probs))


def place_rows(cache: Cache, rows: Sequence[int], part: Cache) -> Cache:
    """``cache`` with its rows ``rows`` replaced by the rows of ``part`` (same
    capacity; every buffer is batch-major)."""
    index = mx.array(list(rows))

    def put(batch: mx.array, new: mx.array) -> mx.array:
        batch[index] = new
        return batch

    return Cache(*(tree_map(put, whole, piece) for whole, piece in zip(cache, part)))


def insert(params: Params, cache: Cache, rows: Sequence[int], prompts, *, sampling=GREEDY, seeds: Sequence[int] = (),
           prefix: Cache | None = None, grow: bool = False, top_log_probs: int | None = None):
    """Prefill new prompts into rows ``rows`` of a running batch, together in
    one batch of their own; the other rows are untouched. Row ``rows[i]``
    draws with seed ``seeds[i]`` (default 0). ``prefix`` (a one-row cache
    holding the first ``prefix.length`` tokens of a single prompt, e.g. a
    cached conversation) is reused: only the rest runs. With ``grow`` the
    new rows prefill in a cache of their own size (see ``prefill``) and the
    batch grows if they need more room; without, they must fit the batch's
    capacity. Returns ``(cache, first tokens)`` (and their ``TokenLogProbs``
    with ``top_log_probs``, as ``prefill``)."""
    prompts = [list(p) for p in prompts]
    check_rows(list(rows), len(prompts), cache.batch_size)
    seeds = list(seeds) or [0] * len(rows)
    part = prefix if prefix is not None else init_cache(params, len(rows), capacity_for(1) if grow else cache.capacity)
    if not grow:
        part = grow_cache(params, part, cache.capacity)
    part = part._replace(seeds=mx.concatenate([row_seeds(seed, 1) for seed in seeds]))
    starts = np.array(part.length)
    part, tokens, *scored = prefill(params, part, [p[start:] for p, start in zip(prompts, starts)], sampling=sampling,
                                    grow=grow, top_log_probs=top_log_probs)
    capacity = max(cache.capacity, part.capacity)
    return (place_rows(grow_cache(params, cache, capacity), rows, grow_cache(params, part, capacity)), tokens, *scored)


def capacity_for(slots: int) -> int:
    """The capacity bucket holding ``slots`` positions: a multiple of a quarter
    of the power of two below it (and of ``CAPACITY_BUCKET``), so buckets waste
    at most a quarter of a buffer and a long generation visits few of them."""
    step = max(CAPACITY_BUCKET, (1 << (max(slots, 1).bit_length() - 1)) // 4)
    return math.ceil(slots / step) * step


def prefill_slots(prompt_length: int) -> int:
    """Slots a prefill writes: the prompt padded to whole chunks."""
    return math.ceil(prompt_length / PREFILL_CHUNK) * PREFILL_CHUNK


