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


def _distinct_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts, and for each row the index of its prompt among them."""
    first_seen: dict = {}
    source = [first_seen.setdefault(tuple(r), len(first_seen)) for r in rows]
    return [list(r) for r in first_seen], source


def prefill(params: Params, cache: Cache, prompt, *, sampling=GREEDY, chunk_size: int | None = None):
    """Run the prompt(s) through the target in fixed chunks and seed the draft context.

    ``prompt`` is a token list, a list of token lists (one per batch row, any
    lengths) or an int array. Returns ``(cache, tokens)``: the first generated
    token of each row (argmax, or a draw under the row's ``sampling``), the first anchor.
    A prompt repeated over several rows (n samples of one prompt) is run
    once and its cache rows copied. Chunks hold ``PREFILL_CHUNK`` tokens, or
    the capacity when that is smaller.
    """
    rows = _as_rows(prompt)
    if len(rows) != cache.batch_size:
        raise ValueError(f"{len(rows)} prompts for a cache of batch size {cache.batch_size}")
    vocab = params.spec.target.vocab_size
    if any(not 0 <= t < vocab for r in rows for t in r):
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    chunk_size = chunk_size or min(PREFILL_CHUNK, cache.capacity)
    longest = max(len(r) for r in rows)
    padded_length = math.ceil(longest / chunk_size) * chunk_size
    if padded_length > cache.capacity:
        raise ValueError(
            f"prompt of {longest} tokens does not fit the cache capacity {cache.capacity} "
            f"(prefill pads to {padded_length}); allocate a larger cache or shorten the prompt"
        )
    distinct, source = _distinct_rows(rows)
    state = (cache.target, cache.draft)
    if len(distinct) < len(rows):  # every cache array is batch-major
        state = tree_map(lambda a: a[: len(distinct)], state)
    padded = mx.array([r + [0] * (padded_length - len(r)) for r in distinct], mx.int32)
    last_rows = mx.array([len(r) - 1 for r in distinct], mx.int32)
    kernel = _prefill_kernel(params.spec)
    last_logits = mx.zeros((len(distinct), vocab), mx.float32)
    for begin in range(0, padded_length, chunk_size):
        start = mx.full((len(distinct),), begin, mx.int32)
        chunk = padded[:, begin : begin + chunk_size]
        state, last_logits = kernel(params.target, params.draft, state, chunk, start, last_rows, last_logits)
    if len(distinct) < len(rows):
        index = mx.array(source)
        state, last_logits = tree_map(lambda a: a[index], (state, last_logits))
    lengths = mx.array([len(r) for r in rows], mx.int32)
    sampled_rows, mode = batch_sampling(sampling, len(rows))
    draws = uniforms(cache.seeds, lengths, noise.PREFILL, (vocab,)) if mode.sampled else None
    return Cache(state[0], state[1], lengths, cache.seeds), choose(last_logits, sampled_rows, mode, draws)


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


def _initial_capacity(rows: list, max_new_tokens: int, widest: int, capacity: int | None) -> int:
    """A fixed ``capacity`` must hold the whole generation; by default the
    cache starts at the bucket of the prompt plus one round and grows."""
    longest = max(len(r) for r in rows)
    if capacity is None:
        return capacity_for(max(prefill_slots(longest), longest + widest))
    if longest + max_new_tokens + widest > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens + verify width "
            f"{widest} exceeds the cache capacity {capacity}"
        )
    return capacity


def _round_plan(policy: VerifyPolicy, proposal: Proposal | None, active: np.ndarray):
    """Verify width, per-row proposal lengths and the draft confidences
    ``[B, G]`` (None without a draft: the round is a plain target step)."""
    if proposal is None:
        return 1, np.zeros(len(active), np.int32), None
    confidences = 1 / (1 + np.exp(-np.array(proposal.confidence_logits)))
    return *policy.plan(confidences, active), confidences


def _row_events(result, limits, width, active, produced, done, stop_tokens, max_new_tokens) -> list:
    """One ``Event`` per active row of a finished round; updates ``produced`` and ``done``."""
    emitted, counts = result.emitted.tolist(), result.count.tolist()
    accepted, drafted = result.accepted.tolist(), result.drafted.tolist()
    confidences = result.confidences.tolist()
    events = []
    for row in np.flatnonzero(active).tolist():
        kept, done[row] = _truncate(emitted[row][: counts[row]], stop_tokens, max_new_tokens - produced[row])
        produced[row] += len(kept)
        limit = int(limits[row])
        events.append(
            Event("round", kept, accepted[row], drafted[row][:limit], confidences[row][:limit], row, width)
        )
    return events


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
    seed (derived from ``seed`` and b). Greedy output equals
    greedy decoding of the target alone, row by row; sampled output is
    distributed as sampling the target alone. Rows that finish stop
    emitting while the others go on. ``capacity`` fixes the cache size;
    by default the cache grows in ``capacity_for`` buckets with the context.

    One host synchronisation per round: the verify of round r and the draft
    of round r + 1 are evaluated together, so the host reads round r's
    tokens and round r + 1's confidences at once, then picks the width of
    round r + 1 from its own draft's confidences.
    """
    rows = _as_rows(prompt)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    batch = len(rows)
    rows_sampling, mode = batch_sampling(sampling, batch)
    policy = verify_policy(
        params, width, batch, sampling=sampling, confidence_threshold=confidence_threshold, costs=costs
    )
    growing = capacity is None
    capacity = _initial_capacity(rows, max_new_tokens, policy.max_width, capacity)
    gate = policy.gate()
    stop_tokens = set(stop_tokens)

    def next_proposal(cache, tokens):
        drafting = policy.max_width > 1 and (gate is None or gate.draft_next())
        return propose(params, cache, tokens, sampling) if drafting else None

    cache, tokens = prefill(params, init_cache(params, batch, capacity, seed), rows, sampling=sampling)
    proposal = next_proposal(cache, tokens)
    mx.eval(tokens, proposal)
    committed = np.array([len(r) for r in rows])
    produced, done = [0] * batch, [False] * batch
    for row, token in enumerate(tokens.tolist()):
        emitted, done[row] = _truncate([token], stop_tokens, max_new_tokens)
        produced[row] = len(emitted)
        yield Event("prefill", emitted, 0, [], [], row)
    while not all(done):
        active = ~np.array(done)
        round_width, limits, confidences = _round_plan(policy, proposal, active)
        if growing:
            cache = grow_cache(params, cache, capacity_for(int(committed[active].max()) + round_width))
        cache, result = _verify(
            params, cache, tokens, proposal if confidences is not None else no_proposal(batch), round_width,
            rows_sampling, mode, mx.array(limits), mx.array(active),
        )
        tokens = result.next_tokens
        proposal = next_proposal(cache, tokens)
        mx.eval(result, proposal)
        committed += np.array(result.count.tolist())
        if confidences is not None and gate is not None:
            gate.observe(np.array(result.accepted.tolist())[active], limits[active], confidences[active])
        yield from _row_events(result, limits, round_width, active, produced, done, stop_tokens, max_new_tokens)
