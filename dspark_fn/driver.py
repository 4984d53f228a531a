"""The driver: rows that enter and leave a batch between rounds (``Decoder``)
and the generation loop over it (``generate``), one host synchronisation a round.

A row owns its life: its ``Row`` holds its sampling settings, its committed
length, its budget and stop tokens, whether it asked for log-probabilities
and its copy index. Every step (a round, or the prefill of new rows) cuts
each row's tokens by the row's own rule (``Row.cut``) and says which rows
ended and why (``Step.finished``); a row that ended is freed before the next
round. ``generate``, the server's engine and the trainer's answering read
steps; none of them cuts tokens or counts a budget of its own.
"""

import dataclasses
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from .buffers import capacity_for, check_writes, free_row, grow_cache, init_cache, take_rows
from .cache import Cache
from .copying import Copy, CopyIndex
from .costs import verify_policy
from .prefilling import as_rows, insert, prefill
from .rounds import no_proposal, propose, undrafted, verify
from .sampling import GREEDY, Sampling, batch_sampling
from .schedule import CostCurve, SlotRates, VerifyPolicy
from .types import Copies, Event, Params, Step, TokenLogProbs, TokenScore, prompt_ids

PROPOSALS = ("auto", "draft", "copy")  # where a row's proposal comes from: chosen per row and round, or one source
TOP_LOG_PROBS = 20  # the most likely tokens a round scores when a row asks for log-probabilities (OpenAI's limit)


@dataclasses.dataclass
class Row:
    """One sequence of a batch, from the prefill that brings it in to its end."""

    sampling: Sampling
    committed: int  # positions its cache row holds
    budget: int | None = None  # tokens it may still emit (None: until released)
    stop_tokens: frozenset = frozenset()  # a token that ends it (kept)
    scoring: int | None = None  # most likely alternatives to list with each token's log-probability, or None
    index: CopyIndex | None = None  # its committed n-grams, when rows propose copies
    fresh: bool = True  # it joined after the pending draft was made, so that draft does not cover it
    finish: str | None = None  # "stop" or "length" once it ended

    def cut(self, tokens: list) -> list:
        """Its share of ``tokens``: up to its first stop token (kept) and its
        budget; counts them against the budget and notes why it ended."""
        kept = tokens if self.budget is None else tokens[: self.budget]
        stop = next((i for i, token in enumerate(kept) if token in self.stop_tokens), None)
        if stop is not None:
            kept, self.finish = kept[: stop + 1], "stop"
        if self.budget is not None:
            self.budget -= len(kept)
            if self.finish is None and self.budget <= 0:
                self.finish = "length"
        return kept


def _initial_capacity(rows: list, max_new_tokens: int, widest: int, capacity: int) -> None:
    """A fixed ``capacity`` must hold the whole generation."""
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens + widest > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens + verify width "
            f"{widest} exceeds the cache capacity {capacity}"
        )


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
    round per ``step`` until its stop token or budget (or ``release``). The
    cache grows in ``capacity_for`` buckets unless fixed.

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
        self.rows: list[Row | None] = [None] * batch  # None: a free row
        self.tokens = mx.zeros((batch,), mx.int32)  # each row's anchor
        self.proposal = None  # the draft made with the last verify, for the coming round
        self._sampling = batch_sampling(GREEDY, batch)
        self.rates = SlotRates.start(policy.max_width - 1)
        self.gate = policy.gate(self.rates)

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def policy(self) -> VerifyPolicy:
        """The policy of the running batch size (cost curves are per size)."""
        return self.policies[self.batch]

    @property
    def slots(self) -> int:
        """The most tokens a row proposes in a round."""
        return self.policy.max_width - 1

    @property
    def live(self) -> np.ndarray:
        """``[B]`` the rows still generating."""
        return np.array([row is not None and row.finish is None for row in self.rows])

    @property
    def busy(self) -> bool:
        """Whether a row is still generating (another ``step`` has work)."""
        return bool(self.live.any())

    @property
    def committed(self) -> np.ndarray:
        """``[B]`` the positions each row's cache holds (0 for a free row)."""
        return np.array([row.committed if row is not None else 0 for row in self.rows])

    def ensure_capacity(self, slots: int) -> None:
        """Grow to hold ``slots`` positions (a fixed cache refuses to write past its end)."""
        if slots > self.cache.capacity:
            if not self.growing:
                raise ValueError(f"{slots} positions exceed the fixed cache capacity {self.cache.capacity}")
            self.cache = grow_cache(self.params, self.cache, capacity_for(slots))

    def _enter(self, rows: Sequence[int], prompts: list, settings: list, first: list, *, fresh: bool,
               max_new_tokens: int | None, stop_tokens, top_log_probs: int | None) -> None:
        for row, prompt, setting, token in zip(rows, prompts, settings, first):
            self.rows[row] = Row(sampling=setting, committed=len(prompt), budget=max_new_tokens,
                                 stop_tokens=frozenset(stop_tokens), scoring=top_log_probs, fresh=fresh,
                                 index=CopyIndex(prompt_ids(prompt) + [token]) if self.copying else None)
        self._sampling = batch_sampling([row.sampling if row else GREEDY for row in self.rows], self.batch)

    def _prefilled(self, rows: Sequence[int], first: list, scores: list | None) -> Step:
        """The step of rows that were just prefilled: each one's first token."""
        entered = [self.rows[row] for row in rows]
        return Step(kind="prefill", rows=list(rows), emitted=[row.cut([token]) for row, token in zip(entered, first)],
                    accepted=[0] * len(entered), drafted=[[] for _ in entered], width=0, sources=[""] * len(entered),
                    finished=[row.finish for row in entered], log_probs=scores)

    def start(self, prompts: list, sampling=GREEDY, *, max_new_tokens: int | None = None,
              stop_tokens: Sequence[int] = ()) -> Step:
        """Prefill every row at once (batched), each with its budget of
        ``max_new_tokens`` (default: none) and ``stop_tokens``; returns the
        step of their first tokens."""
        settings = [sampling] * self.batch if isinstance(sampling, Sampling) else list(sampling)
        self.cache, self.tokens = prefill(self.params, self.cache, prompts, sampling=settings, grow=self.growing)
        self._sampling = batch_sampling(settings, self.batch)
        self.proposal = self._next_proposal()
        mx.eval(self.tokens, self.proposal)
        first = self.tokens.tolist()
        self._enter(range(self.batch), prompts, settings, first, fresh=False, max_new_tokens=max_new_tokens,
                    stop_tokens=stop_tokens, top_log_probs=None)
        return self._prefilled(range(self.batch), first, None)

    def insert(self, rows: Sequence[int], prompts: list, *, sampling=GREEDY, seeds: Sequence[int] = (),
               prefix: Cache | None = None, top_log_probs: int | None = None, max_new_tokens: int | None = None,
               stop_tokens: Sequence[int] = ()) -> Step:
        """New sequences in the free rows ``rows`` between rounds (prefilled
        together; a prompt is a token list or an ``ImagePrompt``), each with
        its budget of ``max_new_tokens`` (default: none) and ``stop_tokens``;
        returns the step of their first tokens.
        ``prefix``: see ``insert``. With ``top_log_probs`` (0..20) these rows'
        tokens are scored, these and every later one's (``Step.log_probs``)."""
        settings = [sampling] * len(rows) if isinstance(sampling, Sampling) else list(sampling)
        self.cache, tokens, *scored = insert(
            self.params, self.cache, rows, prompts, sampling=settings, seeds=seeds, prefix=prefix, grow=self.growing,
            top_log_probs=None if top_log_probs is None else TOP_LOG_PROBS,
        )
        self.tokens[mx.array(list(rows))] = tokens
        first = tokens.tolist()
        self._enter(rows, prompts, settings, first, fresh=True, max_new_tokens=max_new_tokens,
                    stop_tokens=stop_tokens, top_log_probs=top_log_probs)
        scores = None
        if top_log_probs is not None:
            one = TokenLogProbs(*(a[:, None] for a in scored[0]))  # one position a row
            scores = token_scores(one, list(range(len(rows))), [1] * len(rows), [top_log_probs] * len(rows))
        return self._prefilled(rows, first, scores)

    def reset_policy(self) -> None:
        """Forget the measured rates and the gate's state: a sequence that
        runs alone from here follows the same decisions, so its seeded
        samples repeat."""
        self.rates = SlotRates.start(self.slots)
        self.gate = self.policy.gate(self.rates)

    def release(self, row: int) -> None:
        """Free ``row``: it commits nothing more and its slots are reused."""
        self.rows[row] = None
        self.cache = free_row(self.cache, row)

    def _release_ended(self) -> None:
        for row, entry in enumerate(self.rows):
            if entry is not None and entry.finish is not None:
                self.release(row)

    def resize(self, batch: int) -> dict[int, int]:
        """Move the live rows, in order, to the front of a batch of ``batch``
        rows, the rest free; returns old row -> new row. Kernels and cost
        curves are per batch size, so a server runs only as many rows as it
        has requests (each size compiles once)."""
        live = np.flatnonzero(self.live).tolist()
        if len(live) > batch:
            raise ValueError(f"{len(live)} active rows do not fit in a batch of {batch}")
        if batch not in self.policies:
            self.policies[batch] = verify_policy(self.params, batch_size=batch, **self._policy_options)
        if self.gate is not None:  # what it measured of the draft holds at any batch size; the costs do not
            self.gate = dataclasses.replace(self.gate, costs=self.policies[batch].costs)
        self.cache, self.tokens = take_rows((self.cache, self.tokens), live, batch)
        if self.proposal is not None:
            self.proposal = take_rows(self.proposal, live, batch)
        self.rows = [self.rows[row] for row in live] + [None] * (batch - len(live))
        self._sampling = batch_sampling([row.sampling if row else GREEDY for row in self.rows], batch)
        self._check_lengths()
        return {old: new for new, old in enumerate(live)}

    def _check_lengths(self) -> None:
        """The host plans every write from the rows' committed counts: each
        must be the cache's own length (a row longer on the device than
        counted would be written past the slots made for it)."""
        lengths, counted = np.array(self.cache.length), self.committed
        wrong = np.flatnonzero(lengths != counted)
        if wrong.size:
            row = int(wrong[0])
            raise ValueError(
                f"cache row {row} holds length {lengths[row]} but the decoder counts {counted[row]} "
                f"committed positions (capacity {self.cache.capacity})"
            )

    def row_cache(self, row: int) -> Cache:
        """Row ``row`` as a one-row cache (e.g. to keep a conversation's prefix)."""
        return take_rows(self.cache, [row], 1)

    def _next_proposal(self):
        """The draft evaluated with the verify before it (drafts alone only)."""
        if self.copying:
            return None
        drafting = self.policy.max_width > 1 and (self.gate is None or self.gate.draft_next())
        return propose(self.params, self.cache, self.tokens, self._sampling) if drafting else None

    def _copies(self, live: np.ndarray) -> list:
        return [
            row.index.lookup(self.slots) if alive and row.index is not None else Copy([], 0)
            for row, alive in zip(self.rows, live)
        ]

    def _sources(self, copies: list, live: np.ndarray):
        """The round's draft (None: no draft pass) and the rows that verify their copy."""
        if not self.copying:  # the draft, made with the last verify
            return self.proposal, np.zeros(self.batch, bool)
        matches = np.array([copy.match for copy in copies])
        if self.proposals == "copy":
            drafting, copying = False, matches > 0
        else:
            drafting, copying = self.gate.choose_sources(matches, live)
        drafting = drafting and bool((live & ~copying).any())
        proposal = propose(self.params, self.cache, self.tokens, self._sampling) if drafting else None
        return proposal, copying & live

    def _plan(self, proposal, copies: list, copying: np.ndarray, drafting: np.ndarray, live: np.ndarray,
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
        width, limits = self.policy.plan(confidences, live, proposing, copying)
        limits[fresh] = 0
        return width, limits, confidences

    def step(self) -> Step:
        """One round over the live rows (rows that ended in the last step are freed first)."""
        self._release_ended()
        live = self.live
        if not live.any():
            raise ValueError("no row is generating: insert a prompt first")
        fresh = np.array([row is not None and row.fresh for row in self.rows]) & live & (not self.copying)
        copies = self._copies(live)
        proposal, copying = self._sources(copies, live)
        drafting = np.zeros(self.batch, bool) if proposal is None else live & ~copying & ~fresh
        width, limits, confidences = self._plan(proposal, copies, copying, drafting, live, fresh)
        committed = self.committed
        self.ensure_capacity(int(committed[live].max()) + width)
        check_writes(committed, width, self.cache.capacity, f"a verify of width {width}")  # every row writes
        if width == 1:
            proposal = no_proposal(self.batch)
        elif proposal is None:
            proposal = undrafted(self.params, self.batch, self._sampling.mode)
        copied = Copies(tokens=_copy_tokens(copies, width - 1), rows=mx.array(copying)) if copying.any() else None
        rows = np.flatnonzero(live).tolist()
        scoring = any(self.rows[row].scoring is not None for row in rows)
        self.cache, result = verify(
            self.params, self.cache, self.tokens, proposal, width, sampling=self._sampling, limit=mx.array(limits),
            active=mx.array(live), copies=copied, top_log_probs=TOP_LOG_PROBS if scoring else None, check_room=False,
        )
        self.tokens = result.next_tokens
        self.proposal = self._next_proposal()
        mx.eval(result, self.proposal, self.cache.length)
        emitted, counts, accepted = result.emitted.tolist(), result.count.tolist(), result.accepted.tolist()
        drafted = result.drafted.tolist()
        for row in rows:
            self.rows[row].committed += counts[row]
        self._check_lengths()  # the lengths came with this round's evaluation: no extra synchronisation
        kept = [emitted[row][: counts[row]] for row in rows]
        self._learn(rows, kept, copies, accepted, limits, drafting, confidences)
        scores = None
        if scoring:
            scores = token_scores(result.scores, rows, [counts[row] for row in rows],
                                  [self.rows[row].scoring for row in rows])
        for entry in self.rows:
            if entry is not None:
                entry.fresh = False
        return Step(
            kind="round", rows=rows, emitted=[self.rows[row].cut(tokens) for row, tokens in zip(rows, kept)],
            accepted=[accepted[row] for row in rows], drafted=[drafted[row][: limits[row]] for row in rows],
            width=width, sources=["" if not limits[row] else "copy" if copying[row] else "draft" for row in rows],
            finished=[self.rows[row].finish for row in rows], log_probs=scores,
        )

    def _learn(self, rows: list, committed: list, copies: list, accepted: list, limits, drafting, confidences):
        """Index the committed tokens; measure the draft where rows verified it
        and every copy against what was committed."""
        if drafting.any():
            self.rates.observe_drafts(np.array(accepted)[drafting], limits[drafting], confidences[drafting])
        if self.copying:
            self.rates.observe_copies([copies[row].match for row in rows], [copies[row].tokens for row in rows],
                                      committed)
            for row, tokens in zip(rows, committed):
                self.rows[row].index.extend(tokens)


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
    token lists; a prompt with images is an ``ImagePrompt``, from
    ``vision.image_prompt``), one ``Event`` per row per step.

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
    decoder = Decoder(
        params, len(rows), width=width, capacity=capacity, confidence_threshold=confidence_threshold, costs=costs,
        seed=seed, cost_sampling=sampling, proposals=proposals,
    )
    if capacity is not None:
        _initial_capacity(rows, max_new_tokens, decoder.policy.max_width, capacity)
    step = decoder.start(rows, sampling, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)
    yield from step.events()
    while decoder.busy:
        yield from decoder.step().events()
