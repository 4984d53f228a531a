"""The driver: rows that enter and leave a batch between rounds (``Decoder``)
and the generation loop over it (``generate``), one host synchronisation a round."""

import dataclasses
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .cache import Cache
from .copying import Copy, CopyIndex
from .costs import verify_policy
from .rounds import (
    verify_unchecked,
    check_writes,
    as_rows,
    capacity_for,
    grow_cache,
    init_cache,
    insert,
    no_proposal,
    place_rows,
    prefill,
    propose,
    undrafted,
)
from .sampling import GREEDY, Sampling, batch_sampling
from .schedule import CostCurve, SlotRates, VerifyPolicy
from .types import Copies, Event, Params, Proposal, Step, TokenLogProbs, TokenScore

PROPOSALS = ("auto", "draft", "copy")  # where a row's proposal comes from: chosen per row and round, or one source
TOP_LOG_PROBS = 20  # the most likely tokens a round scores when a row asks for log-probabilities (OpenAI's limit)


def _truncate(tokens: list, stop_tokens, budget: int) -> tuple[list, bool]:
    """Cut at the first stop token (kept) and at the token budget."""
    for i, token in enumerate(tokens[:budget]):
        if token in stop_tokens:
            return tokens[: i + 1], True
    return tokens[:budget], len(tokens) >= budget


def _initial_capacity(rows: list, max_new_tokens: int, widest: int, capacity: int) -> None:
    """A fixed ``capacity`` must hold the whole generation."""
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens + widest > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens + verify width "
            f"{widest} exceeds the cache capacity {capacity}"
        )


def _gathered(array: mx.array, index: mx.array, batch: int) -> mx.array:
    """Rows ``index`` of ``array`` first, then zero rows up to ``batch``."""
    padding = mx.zeros((batch - index.size, *array.shape[1:]), array.dtype)
    return mx.concatenate([array[index], padding]) if index.size else padding


def _sigmoid(logits: mx.array) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * np.array(logits.astype(mx.float32))))  # without overflow


def token_scores(scored: TokenLogProbs, rows: list, counts: list, tops: list) -> list:
    """Per row of ``rows``: its first ``counts[i]`` scored tokens (a ``TokenScore``
    each, with ``tops[i]`` most likely alternatives), or None where ``tops[i]`` is."""
    values, ids, top_values = (np.array(a) for a in scored)
    return [
        None if top is None else [
            TokenScore(float(value), list(zip(i[:top].tolist(), v[:top].tolist())))
            for value, i, v in zip(values[row, :count], ids[row, :count], top_values[row, :count])
        ]
        for row, count, top in zip(rows, counts, tops)
    ]


def _copy_tokens(copies: list, slots: int) -> mx.array:
    """``[B, slots]``: each row's copy, zero-padded."""
    tokens = np.zeros((len(copies), slots), np.int32)
    for row, copy in enumerate(copies):
        tokens[row, : min(slots, len(copy.tokens))] = copy.tokens[:slots]
    return mx.array(tokens)


class Decoder:
    """The driver between rounds: a batch of ``batch`` rows, each a sequence
    that enters with ``insert`` (or all at once with ``start``), advances one
    round per ``step`` and leaves with ``release``. The cache grows in
    ``capacity_for`` buckets unless fixed.

    ``proposals`` says where each row's proposal comes from: "draft" (the
    DSpark draft), "copy" (the continuation of the latest earlier
    occurrence of the row's ending, ``copying.CopyIndex``; no draft pass)
    or "auto": under the "auto" width, each round, each row the source
    expected to keep more tokens per second (the gate weighs the rates
    ``SlotRates`` measures per source, match length and slot, and the
    costs); a fixed width drafts and verifies that width every round, so
    there "auto" is the draft.

    With the draft alone the verify of round r and the draft of round r + 1
    are evaluated together (one host synchronisation a round) and round
    r + 1's width is planned from that draft's own confidences. With copies
    round r + 1's sources are chosen once round r's tokens are known (its
    copies need them) and the draft runs only when some row takes it: a
    round of copies costs no draft pass, a drafting round one more
    synchronisation."""

    def __init__(self, params: Params, batch: int, *, width="auto", capacity: int | None = None,
                 confidence_threshold: float = 0.0, costs: CostCurve | None = None, seed: int = 0,
                 cost_sampling=GREEDY, proposals: str = "auto"):
        if proposals not in PROPOSALS:
            raise ValueError(f"proposals must be one of {', '.join(PROPOSALS)}, got {proposals!r}")
        self.params = params
        self._policy_options = dict(
            width=width, sampling=cost_sampling, confidence_threshold=confidence_threshold, costs=costs
        )
        self.policies = {batch: verify_policy(params, batch_size=batch, **self._policy_options)}
        self.proposals = proposals
        policy = self.policies[batch]
        auto_width = policy.costs is not None  # a fixed width drafts every round
        self.copying = policy.max_width > 1 and (proposals == "copy" or (proposals == "auto" and auto_width))
        self.growing = capacity is None
        self.cache = init_cache(params, batch, capacity or capacity_for(1), seed)
        self.rates = SlotRates.start(self.policies[batch].max_width - 1)
        self.gate = self.policies[batch].gate(self.rates)
        self.tokens = mx.zeros((batch,), mx.int32)
        self.sampling = [GREEDY] * batch
        self.active = np.zeros(batch, bool)
        self.fresh = np.zeros(batch, bool)
        self.committed = np.zeros(batch, int)
        self.proposal = None
        self.indices: list = [None] * batch  # each row's CopyIndex (when copying)
        self.scoring: list = [None] * batch  # each row's asked number of most likely tokens, or None

    @property
    def batch(self) -> int:
        return len(self.active)

    @property
    def policy(self) -> VerifyPolicy:
        """The policy of the running batch size (cost curves are per size)."""
        return self.policies[self.batch]

    @property
    def slots(self) -> int:
        """The most tokens a row proposes in a round."""
        return self.policy.max_width - 1

    def _index(self, rows: Sequence[int], prompts: list, first_tokens: list) -> None:
        """Each new row's copy index: its prompt and first token (when copying)."""
        for row, prompt, token in zip(rows, prompts, first_tokens):
            self.indices[row] = CopyIndex(list(prompt) + [token]) if self.copying else None

    def ensure_capacity(self, slots: int) -> None:
        """Grow to hold ``slots`` positions (a fixed cache refuses to write past its end)."""
        if slots > self.cache.capacity:
            if not self.growing:
                raise ValueError(f"{slots} positions exceed the fixed cache capacity {self.cache.capacity}")
            self.cache = grow_cache(self.params, self.cache, capacity_for(slots))

    def start(self, prompts: list, sampling=GREEDY) -> list[int]:
        """Prefill every row at once (batched); returns each row's first token."""
        settings = [sampling] * self.batch if isinstance(sampling, Sampling) else list(sampling)
        self.cache, self.tokens = prefill(self.params, self.cache, prompts, sampling=settings, grow=self.growing)
        self.sampling, self.active[:], self.fresh[:] = settings, True, False
        self.committed = np.array([len(p) for p in prompts])
        self.proposal = self._next_proposal()
        mx.eval(self.tokens, self.proposal)
        self._index(range(self.batch), prompts, self.tokens.tolist())
        return self.tokens.tolist()

    def insert(self, rows: Sequence[int], prompts: list, *, sampling=GREEDY, seeds: Sequence[int] = (),
               prefix: Cache | None = None, top_log_probs: int | None = None):
        """New sequences in the free rows ``rows`` between rounds (prefilled
        together); returns their first tokens. ``prefix``: see ``insert``.
        With ``top_log_probs`` (0..20) these rows' tokens are scored, this
        round's and every later one's (``Step.log_probs``): it returns
        ``(first tokens, a TokenScore each)``."""
        settings = [sampling] * len(rows) if isinstance(sampling, Sampling) else list(sampling)
        self.cache, tokens, *scored = insert(
            self.params, self.cache, rows, prompts, sampling=settings, seeds=seeds, prefix=prefix, grow=self.growing,
            top_log_probs=None if top_log_probs is None else TOP_LOG_PROBS,
        )
        self.tokens[mx.array(list(rows))] = tokens
        for row, prompt, setting in zip(rows, prompts, settings):
            self.sampling[row], self.active[row], self.fresh[row] = setting, True, True
            self.committed[row] = len(prompt)
            self.scoring[row] = top_log_probs
        self._index(rows, prompts, tokens.tolist())
        if top_log_probs is None:
            return tokens.tolist()
        first = TokenLogProbs(*(a[:, None] for a in scored[0]))  # one position a row
        scores = token_scores(first, list(range(len(rows))), [1] * len(rows), [top_log_probs] * len(rows))
        return tokens.tolist(), [row[0] for row in scores]

    def reset_policy(self) -> None:
        """Forget the measured rates and the gate's state: a sequence that
        runs alone from here follows the same decisions, so its seeded
        samples repeat."""
        self.rates = SlotRates.start(self.slots)
        self.gate = self.policy.gate(self.rates)

    def release(self, row: int) -> None:
        """Free ``row``: it commits nothing more and its slots are reused."""
        self.active[row] = False
        self.committed[row] = 0
        self.indices[row] = None
        self.scoring[row] = None
        self.cache = self.cache._replace(length=mx.where(mx.arange(self.batch) == row, 0, self.cache.length))

    def resize(self, batch: int) -> dict[int, int]:
        """Move the active rows, in order, to the front of a batch of ``batch``
        rows, the rest free; returns old row -> new row. Kernels and cost
        curves are per batch size, so a server runs only as many rows as it
        has requests (each size compiles once)."""
        live = np.flatnonzero(self.active)
        if len(live) > batch:
            raise ValueError(f"{len(live)} active rows do not fit in a batch of {batch}")
        if batch not in self.policies:
            self.policies[batch] = verify_policy(self.params, batch_size=batch, **self._policy_options)
        if self.gate is not None:  # what it measured of the draft holds at any batch size; the costs do not
            self.gate = dataclasses.replace(self.gate, costs=self.policies[batch].costs)
        index = mx.array(live.tolist(), mx.int32)
        cache = init_cache(self.params, batch, self.cache.capacity)
        if len(live):
            cache = place_rows(cache, range(len(live)), tree_map(lambda a: a[index], self.cache))
        self.cache = cache
        self.tokens = _gathered(self.tokens, index, batch)
        if self.proposal is not None:
            self.proposal = Proposal(*(_gathered(a, index, batch) for a in self.proposal))
        pad = batch - len(live)
        self.sampling = [self.sampling[r] for r in live] + [GREEDY] * pad
        self.active = np.concatenate([self.active[live], np.zeros(pad, bool)])
        self.fresh = np.concatenate([self.fresh[live], np.zeros(pad, bool)])
        self.committed = np.concatenate([self.committed[live], np.zeros(pad, int)])
        self.indices = [self.indices[r] for r in live] + [None] * pad
        self.scoring = [self.scoring[r] for r in live] + [None] * pad
        self._check_lengths()
        return {int(old): new for new, old in enumerate(live)}

    def _check_lengths(self) -> None:
        """The host plans every write from ``committed``: it must be the
        cache's own length, row by row (a row longer on the device than
        counted would be written past the slots made for it)."""
        lengths = np.array(self.cache.length)
        wrong = np.flatnonzero(lengths != self.committed)
        if wrong.size:
            row = int(wrong[0])
            raise ValueError(
                f"cache row {row} holds length {lengths[row]} but the decoder counts {self.committed[row]} "
                f"committed positions (capacity {self.cache.capacity})"
            )

    def row_cache(self, row: int) -> Cache:
        """Row ``row`` as a one-row cache (e.g. to keep a conversation's prefix)."""
        return tree_map(lambda a: a[row : row + 1], self.cache)

    def _next_proposal(self):
        """The draft evaluated with the verify before it (drafts alone only)."""
        if self.copying:
            return None
        drafting = self.policy.max_width > 1 and (self.gate is None or self.gate.draft_next())
        return propose(self.params, self.cache, self.tokens, self.sampling) if drafting else None

    def _copies(self, active: np.ndarray) -> list:
        return [
            self.indices[row].lookup(self.slots) if live and self.indices[row] is not None else Copy([], 0)
            for row, live in enumerate(active)
        ]

    def _sources(self, copies: list, active: np.ndarray):
        """The round's draft (None: no draft pass) and the rows that verify their copy."""
        if not self.copying:  # the draft, made with the last verify
            return self.proposal, np.zeros(self.batch, bool)
        matches = np.array([copy.match for copy in copies])
        if self.proposals == "copy":
            drafting, copying = False, matches > 0
        else:
            drafting, copying = self.gate.choose_sources(matches, active)
        drafting = drafting and bool((active & ~copying).any())
        return (propose(self.params, self.cache, self.tokens, self.sampling) if drafting else None), copying & active

    def _plan(self, proposal, copies: list, copying: np.ndarray, drafting: np.ndarray, active: np.ndarray,
              fresh: np.ndarray):
        """Verify width, per-row proposal lengths and the per-slot rates
        planned with: the draft's confidences, or a copy's measured rates."""
        if proposal is None and not copying.any():
            return 1, np.zeros(self.batch, np.int32), None
        confidences = np.zeros((self.batch, self.params.spec.block_size))
        if proposal is not None:
            confidences = _sigmoid(proposal.confidence_logits)
            confidences[fresh] = 0.0
        for row in np.flatnonzero(copying):
            confidences[row, : self.slots] = self.rates.acceptance[copies[row].match]
        proposing = (drafting | copying) if self.copying else None
        width, limits = self.policy.plan(confidences, active, proposing, copying)
        limits[fresh] = 0
        return width, limits, confidences

    def step(self) -> Step:
        """One round over the active rows."""
        active = self.active.copy()
        fresh = np.zeros(self.batch, bool) if self.copying else self.fresh & active  # joined after the draft
        copies = self._copies(active)
        proposal, copying = self._sources(copies, active)
        drafting = np.zeros(self.batch, bool) if proposal is None else active & ~copying & ~fresh
        width, limits, confidences = self._plan(proposal, copies, copying, drafting, active, fresh)
        self.ensure_capacity(int(self.committed[active].max()) + width)
        check_writes(self.committed, width, self.cache.capacity, f"a verify of width {width}")  # every row writes
        rows, mode = batch_sampling(self.sampling, self.batch)
        if width == 1:
            proposal = no_proposal(self.batch)
        elif proposal is None:
            proposal = undrafted(self.params, self.batch, mode)
        copied = Copies(_copy_tokens(copies, width - 1), mx.array(copying)) if copying.any() else None
        scoring = any(self.scoring[r] is not None for r in np.flatnonzero(active))
        self.cache, result = verify_unchecked(
            self.params, self.cache, self.tokens, proposal, width, rows, mode, mx.array(limits), mx.array(active),
            copied, TOP_LOG_PROBS if scoring else None,
        )
        self.tokens = result.next_tokens
        self.proposal = self._next_proposal()
        mx.eval(result, self.proposal, self.cache.length)
        self.committed += np.array(result.count)
        self._check_lengths()  # the lengths came with this round's evaluation: no extra synchronisation
        emitted, counts, accepted = result.emitted.tolist(), result.count.tolist(), result.accepted.tolist()
        drafted, scores = result.drafted.tolist(), result.confidences.tolist()
        live = np.flatnonzero(active).tolist()
        committed = [emitted[r][: counts[r]] for r in live]
        self._learn(live, committed, copies, accepted, limits, drafting, confidences)
        self.fresh[:] = False
        sources = ["" if not limits[r] else "copy" if copying[r] else "draft" for r in live]
        scored = TokenLogProbs(result.log_probs, result.top_ids, result.top_log_probs)
        return Step(
            live,
            committed,
            [accepted[r] for r in live],
            [drafted[r][: limits[r]] for r in live],
            [scores[r][: limits[r]] for r in live],
            width,
            sources,
            token_scores(scored, live, [counts[r] for r in live], [self.scoring[r] for r in live]) if scoring else None,
        )

    def _learn(self, live: list, committed: list, copies: list, accepted: list, limits, drafting, confidences):
        """Index the committed tokens; measure the draft where rows verified it
        and every copy against what was committed."""
        if drafting.any():
            self.rates.observe_drafts(np.array(accepted)[drafting], limits[drafting], confidences[drafting])
        if self.copying:
            self.rates.observe_copies([copies[r].match for r in live], [copies[r].tokens for r in live], committed)
            for row, tokens in zip(live, committed):
                self.indices[row].extend(tokens)


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
    proposals: str = "auto",
) -> Iterator[Event]:
    """DSpark generation for one prompt or a batch of prompts (a list of
    token lists), one ``Event`` per row per step.

    ``width``: "auto" (default: draft only when the measured acceptance and
    costs say it pays, then Algorithm 1 picks the length), an int (fixed) or
    None (block size + 1); with ``confidence_threshold`` each row's draft
    ends at its first slot with a lower confidence. ``proposals``: where
    rows' proposals come from, "auto" (default: under the "auto" width, per
    row and round the draft or a copy of an earlier stretch of the row's
    context, whichever is expected to pay more), "draft" or "copy" (see
    ``Decoder``). ``sampling`` is one ``Sampling`` for every row or one per row; row b draws with its own
    seed (derived from ``seed`` and b). Greedy output equals greedy decoding
    of the target alone, row by row; sampled output is distributed as
    sampling the target alone. Rows that finish stop emitting while the
    others go on. ``capacity`` fixes the cache size; by default the cache
    grows in ``capacity_for`` buckets with the context.
    """
    rows = as_rows(prompt)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    batch = len(rows)
    decoder = Decoder(
        params, batch, width=width, capacity=capacity, confidence_threshold=confidence_threshold, costs=costs,
        seed=seed, cost_sampling=sampling, proposals=proposals,
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
            decoder.release(row)  # its verify writes then land at slot 0, not past a tight capacity
    while not all(done):
        step = decoder.step()
        for i, row in enumerate(step.rows):
            kept, done[row] = _truncate(step.emitted[i], stop_tokens, max_new_tokens - produced[row])
            produced[row] += len(kept)
            yield Event("round", kept, step.accepted[i], step.drafted[i], step.confidences[i], row, step.width,
                        step.sources[i])
            if done[row]:
                decoder.release(row)
