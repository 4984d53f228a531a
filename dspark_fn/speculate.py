"""Prefill, one speculative round, and the generation loop.

A round is ``draft_block -> verify -> accept -> commit`` over fixed shapes.
It runs as two compiled kernels: the draft (one per model pair and sampling
settings) and the verify (one per pair, width and sampling settings). The
verify width is static, acceptance only changes array values (the new
``length``), and each row's proposal length is data (``limit``), so every
kernel compiles once and switching among widths never retraces.
"""

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, NamedTuple, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from .cache import Cache
from .drafts.base import DraftArch
from .drafts.heads import DRAFT_VOCAB_KEY, draft_chain
from . import noise
from .noise import row_seeds, uniforms
from .sampling import GREEDY, Mode, RowSampling, Sampling, batch_sampling, choose, log_probs
from .schedule import CostCurve, VerifyPolicy, cached_costs, cost_key, fastest_seconds, monotone, width_buckets
from .targets import activation_dtype
from .targets.base import TargetAdapter
from .verify import Accepted, accept

PREFILL_CHUNK = 64
CAPACITY_BUCKET = 256

# Incremented in the Python body of each compiled kernel, i.e. once per trace.
TRACE_COUNTS: Counter = Counter()


@dataclass(frozen=True)
class PairSpec:
    """Static description of a target/draft pair: everything that is not an array."""

    target_adapter: TargetAdapter
    target: Any
    draft_arch: DraftArch
    draft: Any

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    @property
    def taps(self) -> tuple:
        return self.draft.target_layer_ids


class Params(NamedTuple):
    """Parameter pytrees of the pair plus their static spec."""

    spec: PairSpec
    target: dict
    draft: dict


class Proposal(NamedTuple):
    tokens: mx.array  # [B, G] drafted tokens
    logits: mx.array  # [B, G, V'] Markov-corrected logits over the draft vocabulary (V' = V when full)
    confidence_logits: mx.array  # [B, G]
    base_logits: mx.array  # [B, G, V']
    hidden: mx.array  # [B, G, d] input of the confidence head
    log_probs: mx.array  # [B, G, V] distribution each draft was drawn from (= logits when greedy)


class Round(NamedTuple):
    emitted: mx.array  # [B, W] accepted drafts then the target's token, -1 padded
    count: mx.array  # [B] number of emitted tokens (accepted + 1; 0 for an idle row)
    next_tokens: mx.array  # [B] the next anchor
    accepted: mx.array  # [B]
    drafted: mx.array  # [B, W - 1] the drafts that were verified
    confidences: mx.array  # [B, W - 1]


def init_cache(params: Params, batch_size: int, capacity: int, seed: int = 0) -> Cache:
    """An empty cache; row b draws with the seed ``noise.row_seeds(seed, B)[b]``."""
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

    def keep(larger: mx.array, state: mx.array) -> mx.array:
        larger[:, :, : state.shape[2]] = state  # every buffer holds slots along axis 2
        return larger

    return Cache(
        tree_map(keep, fresh.target, cache.target),
        tree_map(keep, fresh.draft, cache.draft),
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
        draws = uniforms(cache.seeds, cache.length, noise.DRAFT_SLOT + slot, logits.shape[1:]) if mode.sampled else None
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


def _idle_rows_unchanged(verdict: Accepted, block: mx.array, active: mx.array) -> Accepted:
    """Rows that finished keep their anchor and emit nothing."""
    return Accepted(
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
) -> tuple[Cache, Accepted]:
    """Run the target on ``block = [anchor, drafts...]``, accept, and commit.

    Every row's K/V and draft context are written; the new ``length`` keeps
    only the anchor and the accepted drafts, which is the whole rollback.
    ``limit [B]`` caps each row's accepted drafts; ``active [B]`` rows that
    are False commit nothing.
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
            uniforms(cache.seeds, cache.length, noise.ACCEPT, (width - 1,)),
            uniforms(cache.seeds, cache.length, noise.CORRECTION, (logits.shape[-1],)),
        )

    verdict = accept(block, logits, draft_log_probs, rows, mode, draws, limit)
    if active is not None:
        verdict = _idle_rows_unchanged(verdict, block, active)
    draft_state = spec.draft_arch.extend_context(
        spec.draft, params.draft, cache.draft, features, cache.length
    )
    committed = verdict.accepted + 1 if active is None else mx.where(active, verdict.accepted + 1, 0)
    return Cache(target_kv, draft_state, cache.length + committed, cache.seeds), verdict


@lru_cache(maxsize=None)
def _draft_kernel(spec: PairSpec, mode: Mode):
    def draft_(target, draft, cache, tokens, rows):
        TRACE_COUNTS["draft"] += 1
        return tuple(_draft_block(Params(spec, target, draft), Cache(*cache), tokens, RowSampling(*rows), mode))

    return mx.compile(draft_)


@lru_cache(maxsize=None)
def _verify_kernel(spec: PairSpec, width: int, mode: Mode):
    def verify_(target, draft, cache, tokens, drafts, draft_log_probs, confidence_logits, rows, limit, active):
        TRACE_COUNTS["verify"] += 1
        block = mx.concatenate([tokens[:, None], drafts[:, : width - 1]], axis=1)
        before = Cache(*cache)
        cache, verdict = verify_and_commit(
            Params(spec, target, draft), before, block, draft_log_probs, RowSampling(*rows), mode, limit, active
        )
        result = Round(
            emitted=verdict.emitted,
            count=cache.length - before.length,
            next_tokens=verdict.next_tokens,
            accepted=verdict.accepted,
            drafted=block[:, 1:],
            confidences=mx.sigmoid(confidence_logits[:, : width - 1]),
        )
        return tuple(cache), tuple(result)

    return mx.compile(verify_)


def _check_width(spec: PairSpec, width: int) -> None:
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
) -> tuple[Cache, Round]:
    """Verify ``width`` tokens (anchor + the first ``width - 1`` drafts of
    ``proposal``), accept at most ``limit[b]`` drafts per row, commit.

    ``active`` (default all) marks the rows still generating; the others
    keep their state. Every row needs ``width`` free slots; a cache without
    them raises ``ValueError`` before anything runs (``grow_cache`` makes room).
    """
    _check_width(params.spec, width)
    check_free_slots(cache, width)
    return _verify(params, cache, tokens, proposal, width, *batch_sampling(sampling, tokens.shape[0]), limit, active)


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


def _verify(params, cache, tokens, proposal, width, rows: RowSampling, mode: Mode, limit=None, active=None):
    """``verify`` without the checks, for the driver (which sizes its cache itself)."""
    batch = tokens.shape[0]
    limit = mx.full((batch,), width - 1, mx.int32) if limit is None else limit
    active = mx.ones((batch,), mx.bool_) if active is None else active
    kernel = _verify_kernel(params.spec, width, mode)
    cache, result = kernel(
        params.target, params.draft, tuple(cache), tokens,
        proposal.tokens, proposal.log_probs, proposal.confidence_logits, tuple(rows), limit, active,
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
    _check_width(params.spec, width)
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
    def chunk(target, draft, cache, tokens, start, last_row, last_logits):
        TRACE_COUNTS["prefill"] += 1
        adapter = spec.target_adapter
        target_kv, draft_state = cache
        hidden, features, target_kv = adapter.forward(
            spec.target, target, target_kv, tokens, start, spec.taps
        )
        draft_state = spec.draft_arch.extend_context(spec.draft, draft, draft_state, features, start)
        row = last_row - start
        in_chunk = (row >= 0) & (row < tokens.shape[1])
        picked = mx.take_along_axis(hidden, mx.clip(row, 0, tokens.shape[1] - 1)[:, None, None], axis=1)
        logits = adapter.logits(spec.target, target, picked[:, 0])
        last_logits = mx.where(in_chunk[:, None], logits, last_logits)
        return (target_kv, draft_state), last_logits

    return mx.compile(chunk)


def _as_rows(prompt) -> list[list[int]]:
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


def prefill(params: Params, cache: Cache, prompt, *, sampling=GREEDY, chunk_size: int | None = None):
    """Run the prompt(s) through the target in fixed chunks and extend the draft context.

    ``prompt`` is a token list, a list of token lists (one per batch row, any
    lengths) or an int array. Each row continues from its committed length
    (0 in a fresh cache; a cached conversation prefix otherwise). Returns
    ``(cache, tokens)``: the first generated token of each row (argmax, or a
    draw under the row's ``sampling``), the first anchor. Rows that start
    together with the same tokens (n samples of one prompt) are run once and
    their cache rows copied. Chunks hold ``PREFILL_CHUNK`` tokens, or the
    capacity when that is smaller.
    """
    rows = _as_rows(prompt)
    if len(rows) != cache.batch_size:
        raise ValueError(f"{len(rows)} prompts for a cache of batch size {cache.batch_size}")
    vocab = params.spec.target.vocab_size
    if any(not 0 <= t < vocab for r in rows for t in r):
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    chunk_size = chunk_size or min(PREFILL_CHUNK, cache.capacity)
    starts = np.array(cache.length)
    padded_length = math.ceil(max(len(r) for r in rows) / chunk_size) * chunk_size
    if (starts + padded_length).max() > cache.capacity:
        longest = int((starts + np.array([len(r) for r in rows])).max())
        raise ValueError(
            f"prompt of {longest} tokens does not fit the cache capacity {cache.capacity} "
            f"(prefill pads to {int(starts.max()) + padded_length}); allocate a larger cache or shorten the prompt"
        )
    running, source = _distinct_rows(rows, starts)
    state = (cache.target, cache.draft)
    if len(running) < len(rows):  # every cache array is batch-major
        state = tree_map(lambda a: a[mx.array(running)], state)
    offsets = mx.array(starts[running], mx.int32)
    padded = mx.array([rows[i] + [0] * (padded_length - len(rows[i])) for i in running], mx.int32)
    last_rows = offsets + mx.array([len(rows[i]) - 1 for i in running], mx.int32)
    kernel = _prefill_kernel(params.spec)
    last_logits = mx.zeros((len(running), vocab), mx.float32)
    for begin in range(0, padded_length, chunk_size):
        chunk = padded[:, begin : begin + chunk_size]
        state, last_logits = kernel(params.target, params.draft, state, chunk, offsets + begin, last_rows, last_logits)
    if len(running) < len(rows):
        index = mx.array(source)
        state, last_logits = tree_map(lambda a: a[index], (state, last_logits))
    lengths = mx.array(starts + np.array([len(r) for r in rows]), mx.int32)
    sampled_rows, mode = batch_sampling(sampling, len(rows))
    draws = uniforms(cache.seeds, lengths, noise.PREFILL, (vocab,)) if mode.sampled else None
    return Cache(state[0], state[1], lengths, cache.seeds), choose(last_logits, sampled_rows, mode, draws)


def place_rows(cache: Cache, rows: Sequence[int], part: Cache) -> Cache:
    """``cache`` with its rows ``rows`` replaced by the rows of ``part`` (same
    capacity; every buffer is batch-major)."""
    index = mx.array(list(rows))

    def put(batch: mx.array, new: mx.array) -> mx.array:
        batch[index] = new
        return batch

    return Cache(*(tree_map(put, whole, piece) for whole, piece in zip(cache, part)))


def insert(params: Params, cache: Cache, rows: Sequence[int], prompts, *, sampling=GREEDY, seeds: Sequence[int] = (),
           prefix: Cache | None = None):
    """Prefill new prompts into rows ``rows`` of a running batch, together in
    one batch of their own; the other rows are untouched. Row ``rows[i]``
    draws with seed ``seeds[i]`` (default 0). ``prefix`` (a one-row cache of
    this capacity holding the first ``prefix.length`` tokens of a single
    prompt, e.g. a cached conversation) is reused: only the rest runs.
    Returns ``(cache, first tokens)``."""
    prompts = [list(p) for p in prompts]
    seeds = list(seeds) or [0] * len(rows)
    part = prefix if prefix is not None else init_cache(params, len(rows), cache.capacity)
    part = part._replace(seeds=mx.concatenate([row_seeds(seed, 1) for seed in seeds]))
    starts = np.array(part.length)
    part, tokens = prefill(params, part, [p[start:] for p, start in zip(prompts, starts)], sampling=sampling)
    return place_rows(cache, rows, part), tokens


class Event(NamedTuple):
    """What one step of ``generate`` produced for one row (``kind`` is "prefill" or "round")."""

    kind: str
    emitted: list
    accepted: int
    drafted: list  # the proposal this row verified (its first ``limit`` drafts)
    confidences: list
    row: int = 0
    width: int = 0  # verify width of the round (shared by the batch)


def capacity_for(slots: int) -> int:
    """The capacity bucket holding ``slots`` positions: a multiple of a quarter
    of the power of two below it (and of ``CAPACITY_BUCKET``), so buckets waste
    at most a quarter of a buffer and a long generation visits few of them."""
    step = max(CAPACITY_BUCKET, (1 << (max(slots, 1).bit_length() - 1)) // 4)
    return math.ceil(slots / step) * step


def prefill_slots(prompt_length: int) -> int:
    """Slots a prefill writes: the prompt padded to whole chunks."""
    return math.ceil(prompt_length / PREFILL_CHUNK) * PREFILL_CHUNK


def _truncate(tokens: list, stop_tokens, budget: int) -> tuple[list, bool]:
    """Cut at the first stop token (kept) and at the token budget."""
    for i, token in enumerate(tokens[:budget]):
        if token in stop_tokens:
            return tokens[: i + 1], True
    return tokens[:budget], len(tokens) >= budget


COST_CAPACITY = 512  # cost curves are measured at this context (a typical chat turn)


def measure_costs(params: Params, batch_size: int, widths, sampling=GREEDY) -> CostCurve:
    """Time the draft kernel and the verify kernel of each width on this machine."""
    cache = init_cache(params, batch_size, COST_CAPACITY)
    cache = cache._replace(length=mx.full((batch_size,), COST_CAPACITY // 2, mx.int32))
    tokens = mx.zeros((batch_size,), mx.int32)
    proposal = propose(params, cache, tokens, sampling)

    def verify_round(width):
        source = proposal if width > 1 else no_proposal(batch_size)
        return verify(params, cache, tokens, source, width, sampling=sampling)

    runs = {width: lambda width=width: verify_round(width) for width in widths}
    seconds = fastest_seconds(runs | {"draft": lambda: propose(params, cache, tokens, sampling)})
    return CostCurve(seconds.pop("draft"), monotone(seconds))


def model_signature(params: Params) -> str:
    """What a verify costs depends on: both specs and every tensor's shape and
    dtype (so a quantized draft is timed apart from its float original)."""
    tensors = tree_flatten((params.target, params.draft))
    return repr((params.spec.target, params.spec.draft, [(k, v.shape, v.dtype) for k, v in tensors]))


def verify_policy(
    params: Params,
    width,
    batch_size: int,
    *,
    sampling=GREEDY,
    confidence_threshold: float = 0.0,
    costs: CostCurve | None = None,
) -> VerifyPolicy:
    """The policy for ``width`` = an int (fixed), None (the whole block) or
    "auto" (draft only when it pays, then Algorithm 1 over a cost curve:
    ``costs``, else measured on first use and cached per model, device,
    batch size and sampling settings)."""
    spec = params.spec
    if not (width is None or width == "auto" or isinstance(width, int)):
        raise ValueError(f"verify width must be an integer, None or 'auto', got {width!r}")
    auto = width == "auto"
    widest = spec.block_size + 1 if width is None or auto else width
    _check_width(spec, widest)
    buckets = width_buckets(spec.block_size, widest)
    if auto and costs is None:
        key = cost_key(model_signature(params), batch_size, COST_CAPACITY, batch_sampling(sampling, batch_size)[1])
        costs = cached_costs(key, lambda: measure_costs(params, batch_size, buckets, sampling))
    return VerifyPolicy(widest, buckets, confidence_threshold, costs if auto else None)


def _initial_capacity(rows: list, max_new_tokens: int, widest: int, capacity: int) -> None:
    """A fixed ``capacity`` must hold the whole generation."""
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens + widest > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens + verify width "
            f"{widest} exceeds the cache capacity {capacity}"
        )


def _round_plan(policy: VerifyPolicy, proposal: Proposal | None, active: np.ndarray, fresh: np.ndarray):
    """Verify width, per-row proposal lengths and the draft confidences
    ``[B, G]`` (None without a draft: the round is a plain target step).
    ``fresh`` rows joined after the proposal was drafted: they verify none of it."""
    if proposal is None:
        return 1, np.zeros(len(active), np.int32), None
    confidences = 1 / (1 + np.exp(-np.array(proposal.confidence_logits)))
    confidences[fresh] = 0.0
    width, limits = policy.plan(confidences, active)
    limits[fresh] = 0
    return width, limits, confidences


class Step(NamedTuple):
    """What one round of a ``Decoder`` produced, host-side, for its active rows."""

    rows: list  # the rows that took part
    emitted: list  # per row: accepted drafts then the target's token
    accepted: list
    drafted: list  # per row: the drafts it verified
    confidences: list
    width: int


class Decoder:
    """The driver between rounds: a batch of ``batch`` rows, each a sequence
    that enters with ``insert`` (or all at once with ``start``), advances one
    round per ``step`` and leaves with ``release``. One host synchronisation
    a round: the verify of round r and the draft of round r + 1 are evaluated
    together, then round r + 1's width is planned from that draft's own
    confidences. The cache grows in ``capacity_for`` buckets unless fixed."""

    def __init__(self, params: Params, batch: int, *, width="auto", capacity: int | None = None,
                 confidence_threshold: float = 0.0, costs: CostCurve | None = None, seed: int = 0,
                 cost_sampling=GREEDY):
        self.params = params
        self.policy = verify_policy(
            params, width, batch, sampling=cost_sampling, confidence_threshold=confidence_threshold, costs=costs
        )
        self.growing = capacity is None
        self.cache = init_cache(params, batch, capacity or capacity_for(1), seed)
        self.gate = self.policy.gate()
        self.tokens = mx.zeros((batch,), mx.int32)
        self.sampling = [GREEDY] * batch
        self.active = np.zeros(batch, bool)
        self.fresh = np.zeros(batch, bool)
        self.committed = np.zeros(batch, int)
        self.proposal = None

    @property
    def batch(self) -> int:
        return len(self.active)

    def ensure_capacity(self, slots: int) -> None:
        """Grow to hold ``slots`` positions (a fixed cache refuses to write past its end)."""
        if slots > self.cache.capacity:
            if not self.growing:
                raise ValueError(f"{slots} positions exceed the fixed cache capacity {self.cache.capacity}")
            self.cache = grow_cache(self.params, self.cache, capacity_for(slots))

    def room_for_prompt(self, length: int) -> None:
        if self.growing:  # a fixed cache: prefill checks the fit itself
            self.ensure_capacity(max(prefill_slots(length), length + self.policy.max_width))

    def start(self, prompts: list, sampling=GREEDY) -> list[int]:
        """Prefill every row at once (batched); returns each row's first token."""
        settings = [sampling] * self.batch if isinstance(sampling, Sampling) else list(sampling)
        self.room_for_prompt(max(len(p) for p in prompts))
        self.cache, self.tokens = prefill(self.params, self.cache, prompts, sampling=settings)
        self.sampling, self.active[:], self.fresh[:] = settings, True, False
        self.committed = np.array([len(p) for p in prompts])
        self.proposal = self._next_proposal()
        mx.eval(self.tokens, self.proposal)
        return self.tokens.tolist()

    def insert(self, rows: Sequence[int], prompts: list, *, sampling=GREEDY, seeds: Sequence[int] = (),
               prefix: Cache | None = None) -> list[int]:
        """New sequences in the free rows ``rows`` between rounds (prefilled
        together); returns their first tokens. ``prefix``: see ``insert``."""
        settings = [sampling] * len(rows) if isinstance(sampling, Sampling) else list(sampling)
        self.room_for_prompt(max(map(len, prompts)))
        if prefix is not None and prefix.capacity < self.cache.capacity:
            prefix = grow_cache(self.params, prefix, self.cache.capacity)
        self.cache, tokens = insert(
            self.params, self.cache, rows, prompts, sampling=settings, seeds=seeds, prefix=prefix
        )
        self.tokens[mx.array(list(rows))] = tokens
        for row, prompt, setting in zip(rows, prompts, settings):
            self.sampling[row], self.active[row], self.fresh[row] = setting, True, True
            self.committed[row] = len(prompt)
        return tokens.tolist()

    def reset_policy(self) -> None:
        """Forget what the gate learnt: a sequence that runs alone from here
        follows the same drafting decisions, so its seeded samples repeat."""
        self.gate = self.policy.gate()

    def release(self, row: int) -> None:
        """Free ``row``: it commits nothing more and its slots are reused."""
        self.active[row] = False
        self.committed[row] = 0
        self.cache = self.cache._replace(length=mx.where(mx.arange(self.batch) == row, 0, self.cache.length))

    def row_cache(self, row: int) -> Cache:
        """Row ``row`` as a one-row cache (e.g. to keep a conversation's prefix)."""
        return Cache(*(tree_map(lambda a: a[row : row + 1], part) for part in self.cache))

    def _next_proposal(self):
        drafting = self.policy.max_width > 1 and (self.gate is None or self.gate.draft_next())
        return propose(self.params, self.cache, self.tokens, self.sampling) if drafting else None

    def step(self) -> Step:
        """One round over the active rows."""
        active = self.active.copy()
        width, limits, confidences = _round_plan(self.policy, self.proposal, active, self.fresh & active)
        self.ensure_capacity(int(self.committed[active].max()) + width)
        rows, mode = batch_sampling(self.sampling, self.batch)
        proposal = self.proposal if confidences is not None else no_proposal(self.batch)
        self.cache, result = _verify(
            self.params, self.cache, self.tokens, proposal, width, rows, mode, mx.array(limits), mx.array(active)
        )
        self.tokens = result.next_tokens
        self.proposal = self._next_proposal()
        mx.eval(result, self.proposal)
        self.committed += np.array(result.count)
        if confidences is not None and self.gate is not None:
            settled = active & ~self.fresh
            self.gate.observe(np.array(result.accepted)[settled], limits[settled], confidences[settled])
        self.fresh[:] = False
        emitted, counts, accepted = result.emitted.tolist(), result.count.tolist(), result.accepted.tolist()
        drafted, scores = result.drafted.tolist(), result.confidences.tolist()
        live = np.flatnonzero(active).tolist()
        return Step(
            live,
            [emitted[r][: counts[r]] for r in live],
            [accepted[r] for r in live],
            [drafted[r][: limits[r]] for r in live],
            [scores[r][: limits[r]] for r in live],
            width,
        )


def generate(
    params: Params,
    prompt,
    max_new_tokens: int,
    *,
    width: int | str | None = "auto",
    stop_tokens: Sequence[int] = (),
    capacity: int | None = None,
    sampling=GREEDY,
    seed: int = 0,
    confidence_threshold: float = 0.0,
    costs: CostCurve | None = None,
) -> Iterator[Event]:
    """DSpark generation for one prompt or a batch of prompts (a list of
    token lists), one ``Event`` per row per step.

    ``width``: "auto" (default: draft only when the measured acceptance and
    costs say it pays, then Algorithm 1 picks the length), an int (fixed) or
    None (block size + 1); with ``confidence_threshold`` each row's proposal
    ends at its first slot with a lower confidence. ``sampling`` is one
    ``Sampling`` for every row or one per row; row b draws with its own
    seed (derived from ``seed`` and b). Greedy output equals greedy decoding
    of the target alone, row by row; sampled output is distributed as
    sampling the target alone. Rows that finish stop emitting while the
    others go on. ``capacity`` fixes the cache size; by default the cache
    grows in ``capacity_for`` buckets with the context.
    """
    rows = _as_rows(prompt)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    batch = len(rows)
    decoder = Decoder(
        params, batch, width=width, capacity=capacity, confidence_threshold=confidence_threshold, costs=costs,
        seed=seed, cost_sampling=sampling,
    )
    if capacity is not None:
        _initial_capacity(rows, max_new_tokens, decoder.policy.max_width, capacity)
    stop_tokens = set(stop_tokens)
    produced, done = [0] * batch, [False] * batch
    for row, token in enumerate(decoder.start(rows, sampling)):
        emitted, done[row] = _truncate([token], stop_tokens, max_new_tokens)
        produced[row] = len(emitted)
        yield Event("prefill", emitted, 0, [], [], row)
        if done[row]:
            decoder.active[row] = False
    while not all(done):
        step = decoder.step()
        for i, row in enumerate(step.rows):
            kept, done[row] = _truncate(step.emitted[i], stop_tokens, max_new_tokens - produced[row])
            produced[row] += len(kept)
            yield Event("round", kept, step.accepted[i], step.drafted[i], step.confidences[i], row, step.width)
            if done[row]:
                decoder.active[row] = False
