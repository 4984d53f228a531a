"""Prefill, one speculative round, and the generation loop.

A round is ``draft_block -> verify -> accept -> commit`` over fixed shapes:
the verify width is static, acceptance only changes array values (the new
``length``), so each (model pair, width) compiles once and is reused for
every round and every prompt whose capacity falls in the same bucket.
"""

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, NamedTuple, Sequence

import mlx.core as mx

from .cache import Cache
from .drafts.base import DraftArch
from .drafts.heads import draft_chain
from .targets.base import TargetAdapter
from .verify import Accepted, accept_greedy

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
    logits: mx.array  # [B, G, V] Markov-corrected logits
    confidence_logits: mx.array  # [B, G]
    base_logits: mx.array  # [B, G, V]
    hidden: mx.array  # [B, G, d] input of the confidence head


class Round(NamedTuple):
    emitted: mx.array  # [B, W] accepted drafts then the target's token, -1 padded
    count: mx.array  # [B] number of emitted tokens (accepted + 1)
    next_tokens: mx.array  # [B] the next anchor
    accepted: mx.array  # [B]
    drafted: mx.array  # [B, W - 1] the drafts that were verified
    confidences: mx.array  # [B, W - 1]


def init_cache(params: Params, batch_size: int, capacity: int) -> Cache:
    spec = params.spec
    return Cache(
        target=spec.target_adapter.init_kv(spec.target, batch_size, capacity),
        draft=spec.draft_arch.init_context(spec.draft, batch_size, capacity),
        length=mx.zeros((batch_size,), mx.int32),
    )


def draft_block(params: Params, cache: Cache, tokens: mx.array) -> Proposal:
    """Draft a block after the anchors ``tokens [B]`` (greedy Markov chain)."""
    spec = params.spec
    batch = tokens.shape[0]
    mask = mx.full((batch, spec.block_size - 1), spec.draft.mask_token_id, tokens.dtype)
    block_ids = mx.concatenate([tokens[:, None], mask], axis=1)
    base, hidden = spec.draft_arch.block_forward(
        spec.draft, params.draft, cache.draft, cache.length, block_ids
    )
    choose = lambda logits, slot: mx.argmax(logits, axis=-1).astype(tokens.dtype)  # noqa: E731
    drafted, logits, confidence = draft_chain(spec.draft, params.draft, base, hidden, tokens, choose)
    return Proposal(drafted, logits, confidence, base, hidden)


def verify_and_commit(params: Params, cache: Cache, block: mx.array) -> tuple[Cache, Accepted]:
    """Run the target on ``block = [anchor, drafts...]``, accept, and commit.

    Every row's K/V and draft context are written; the new ``length`` keeps
    only the anchor and the accepted drafts, which is the whole rollback.
    """
    spec = params.spec
    adapter = spec.target_adapter
    hidden, features, target_kv = adapter.forward(
        spec.target, params.target, cache.target, block, cache.length, spec.taps
    )
    verdict = accept_greedy(block, adapter.logits(spec.target, params.target, hidden))
    draft_state = spec.draft_arch.extend_context(
        spec.draft, params.draft, cache.draft, features, cache.length
    )
    return Cache(target_kv, draft_state, cache.length + verdict.accepted + 1), verdict


def _round_result(verdict: Accepted, block: mx.array, confidences: mx.array) -> Round:
    return Round(
        emitted=verdict.emitted,
        count=verdict.accepted + 1,
        next_tokens=verdict.next_tokens,
        accepted=verdict.accepted,
        drafted=block[:, 1:],
        confidences=confidences,
    )


@lru_cache(maxsize=None)
def _round_kernel(spec: PairSpec, width: int):
    def round_(target, draft, cache, tokens):
        TRACE_COUNTS["round"] += 1
        params, cache = Params(spec, target, draft), Cache(*cache)
        if width > 1:
            proposal = draft_block(params, cache, tokens)
            drafts = proposal.tokens[:, : width - 1]
            confidences = mx.sigmoid(proposal.confidence_logits[:, : width - 1])
        else:
            drafts = mx.zeros((tokens.shape[0], 0), tokens.dtype)
            confidences = mx.zeros((tokens.shape[0], 0), mx.float32)
        block = mx.concatenate([tokens[:, None], drafts], axis=1)
        cache, verdict = verify_and_commit(params, cache, block)
        return tuple(cache), tuple(_round_result(verdict, block, confidences))

    return mx.compile(round_)


@lru_cache(maxsize=None)
def _verify_kernel(spec: PairSpec):
    def verify_(target, draft, cache, block):
        TRACE_COUNTS["verify"] += 1
        cache, verdict = verify_and_commit(Params(spec, target, draft), Cache(*cache), block)
        confidences = mx.zeros(block[:, 1:].shape, mx.float32)
        return tuple(cache), tuple(_round_result(verdict, block, confidences))

    return mx.compile(verify_)


@lru_cache(maxsize=None)
def _prefill_kernel(spec: PairSpec):
    def chunk(target, draft, cache, tokens, start, last_row, last_logits):
        TRACE_COUNTS["prefill"] += 1
        adapter = spec.target_adapter
        target_kv, draft_state, length = cache
        hidden, features, target_kv = adapter.forward(
            spec.target, target, target_kv, tokens, start, spec.taps
        )
        draft_state = spec.draft_arch.extend_context(spec.draft, draft, draft_state, features, start)
        row = last_row - start
        in_chunk = (row >= 0) & (row < tokens.shape[1])
        picked = mx.take_along_axis(hidden, mx.clip(row, 0, tokens.shape[1] - 1)[:, None, None], axis=1)
        logits = adapter.logits(spec.target, target, picked[:, 0])
        last_logits = mx.where(in_chunk[:, None], logits, last_logits)
        return (target_kv, draft_state, length), last_logits

    return mx.compile(chunk)


def speculate(params: Params, cache: Cache, tokens: mx.array, width: int | None = None):
    """One DSpark round from the anchors ``tokens [B]``: draft, verify ``width``
    tokens (anchor + ``width - 1`` drafts), accept, commit.

    Returns ``(cache, Round)``; ``Round.next_tokens`` are the next anchors.
    The caller must leave ``width`` free slots: ``length + width <= capacity``.
    """
    width = params.spec.block_size + 1 if width is None else width
    if not 1 <= width <= params.spec.block_size + 1:
        raise ValueError(f"verify width {width} must be in 1..{params.spec.block_size + 1}")
    cache, result = _round_kernel(params.spec, width)(params.target, params.draft, tuple(cache), tokens)
    return Cache(*cache), Round(*result)


def verify_block(params: Params, cache: Cache, block: mx.array):
    """Verify a caller-chosen ``block [B, W] = [anchor, proposals...]`` and commit.

    The same verify/accept/commit as ``speculate``, for proposals that do not
    come from the draft (replays, tests, external drafters).
    """
    cache, result = _verify_kernel(params.spec)(params.target, params.draft, tuple(cache), block)
    return Cache(*cache), Round(*result)


def _as_rows(prompt) -> list[list[int]]:
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    rows = [list(prompt)] if prompt and isinstance(prompt[0], int) else [list(r) for r in prompt]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("prompt is empty: give at least one token per row")
    return rows


def prefill(params: Params, cache: Cache, prompt, chunk_size: int = PREFILL_CHUNK):
    """Run the prompt(s) through the target in fixed chunks and seed the draft context.

    ``prompt`` is a token list, a list of token lists (one per batch row, any
    lengths) or an int array. Returns ``(cache, tokens)``: the first generated
    token of each row, which is the first anchor.
    """
    rows = _as_rows(prompt)
    if len(rows) != cache.batch_size:
        raise ValueError(f"{len(rows)} prompts for a cache of batch size {cache.batch_size}")
    vocab = params.spec.target.vocab_size
    if any(not 0 <= t < vocab for r in rows for t in r):
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    longest = max(len(r) for r in rows)
    padded_length = math.ceil(longest / chunk_size) * chunk_size
    if padded_length > cache.capacity:
        raise ValueError(
            f"prompt of {longest} tokens does not fit the cache capacity {cache.capacity} "
            f"(prefill pads to {padded_length}); allocate a larger cache or shorten the prompt"
        )
    padded = mx.array([r + [0] * (padded_length - len(r)) for r in rows], mx.int32)
    lengths = mx.array([len(r) for r in rows], mx.int32)
    kernel = _prefill_kernel(params.spec)
    state = tuple(cache)
    last_logits = mx.zeros((len(rows), vocab), mx.float32)
    for begin in range(0, padded_length, chunk_size):
        start = mx.full((len(rows),), begin, mx.int32)
        chunk = padded[:, begin : begin + chunk_size]
        state, last_logits = kernel(params.target, params.draft, state, chunk, start, lengths - 1, last_logits)
    cache = Cache(state[0], state[1], lengths)
    return cache, mx.argmax(last_logits, axis=-1).astype(mx.int32)


class Event(NamedTuple):
    """What one step of ``generate`` produced (``kind`` is "prefill" or "round")."""

    kind: str
    emitted: list
    accepted: int
    drafted: list
    confidences: list


def capacity_for(prompt_length: int, max_new_tokens: int, width: int) -> int:
    """Smallest capacity bucket that holds the prompt, the new tokens and one verify."""
    need = max(prompt_length + max_new_tokens + width, math.ceil(prompt_length / PREFILL_CHUNK) * PREFILL_CHUNK)
    return math.ceil(need / CAPACITY_BUCKET) * CAPACITY_BUCKET


def _truncate(tokens: list, stop_tokens, budget: int) -> tuple[list, bool]:
    """Cut at the first stop token (kept) and at the token budget."""
    for i, token in enumerate(tokens[:budget]):
        if token in stop_tokens:
            return tokens[: i + 1], True
    return tokens[:budget], len(tokens) >= budget


def generate(
    params: Params,
    prompt: Sequence[int],
    max_new_tokens: int,
    width: int | None = None,
    stop_tokens: Sequence[int] = (),
    capacity: int | None = None,
) -> Iterator[Event]:
    """Greedy DSpark generation for one prompt, one ``Event`` per round.

    Output tokens equal greedy decoding of the target alone. One host
    synchronisation per round.
    """
    prompt = _as_rows(prompt)[0]
    width = params.spec.block_size + 1 if width is None else width
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    capacity = capacity or capacity_for(len(prompt), max_new_tokens, width)
    if len(prompt) + max_new_tokens + width > capacity:
        raise ValueError(
            f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens + verify width "
            f"{width} exceeds the cache capacity {capacity}"
        )
    stop_tokens = set(stop_tokens)
    cache, tokens = prefill(params, init_cache(params, 1, capacity), [prompt])
    first = tokens.tolist()
    emitted, done = _truncate(first, stop_tokens, max_new_tokens)
    yield Event("prefill", emitted, 0, [], [])
    produced = len(emitted)
    while not done:
        cache, result = speculate(params, cache, tokens, width)
        tokens = result.next_tokens
        mx.eval(cache, result)
        count = result.count.item()
        emitted, done = _truncate(result.emitted[0, :count].tolist(), stop_tokens, max_new_tokens - produced)
        produced += len(emitted)
        yield Event(
            "round",
            emitted,
            result.accepted.item(),
            result.drafted[0].tolist(),
            result.confidences[0].tolist(),
        )
