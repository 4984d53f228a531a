"""The driver: rows that enter and leave a batch between rounds (``Decoder``)
and the generation loop over it (``generate``), one host synchronisation a round."""

import dataclasses
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .cache import Cache
from .costs import verify_policy
from .rounds import (
    verify_unchecked,
    as_rows,
    capacity_for,
    grow_cache,
    init_cache,
    insert,
    no_proposal,
    place_rows,
    prefill,
    propose,
)
from .sampling import GREEDY, Sampling, batch_sampling
from .schedule import CostCurve, VerifyPolicy
from .types import Event, Params, Proposal, Step


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


def _round_plan(policy: VerifyPolicy, proposal: Proposal | None, active: np.ndarray, fresh: np.ndarray):
    """Verify width, per-row proposal lengths and the draft confidences
    ``[B, G]`` (None without a draft: the round is a plain target step).
    ``fresh`` rows joined after the proposal was drafted: they verify none of it."""
    if proposal is None:
        return 1, np.zeros(len(active), np.int32), None
    confidences = 0.5 * (1 + np.tanh(0.5 * np.array(proposal.confidence_logits)))  # the sigmoid, without overflow
    confidences[fresh] = 0.0
    width, limits = policy.plan(confidences, active)
    limits[fresh] = 0
    return width, limits, confidences


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
        self._policy_options = dict(
            width=width, sampling=cost_sampling, confidence_threshold=confidence_threshold, costs=costs
        )
        self.policies = {batch: verify_policy(params, batch_size=batch, **self._policy_options)}
        self.growing = capacity is None
        self.cache = init_cache(params, batch, capacity or capacity_for(1), seed)
        self.gate = self.policies[batch].gate()
        self.tokens = mx.zeros((batch,), mx.int32)
        self.sampling = [GREEDY] * batch
        self.active = np.zeros(batch, bool)
        self.fresh = np.zeros(batch, bool)
        self.committed = np.zeros(batch, int)
        self.proposal = None

    @property
    def batch(self) -> int:
        return len(self.active)

    @property
    def policy(self) -> VerifyPolicy:
        """The policy of the running batch size (cost curves are per size)."""
        return self.policies[self.batch]

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
        return self.tokens.tolist()

    def insert(self, rows: Sequence[int], prompts: list, *, sampling=GREEDY, seeds: Sequence[int] = (),
               prefix: Cache | None = None) -> list[int]:
        """New sequences in the free rows ``rows`` between rounds (prefilled
        together); returns their first tokens. ``prefix``: see ``insert``."""
        settings = [sampling] * len(rows) if isinstance(sampling, Sampling) else list(sampling)
        self.cache, tokens = insert(
            self.params, self.cache, rows, prompts, sampling=settings, seeds=seeds, prefix=prefix, grow=self.growing
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
        return {int(old): new for new, old in enumerate(live)}

    def row_cache(self, row: int) -> Cache:
        """Row ``row`` as a one-row cache (e.g. to keep a conversation's prefix)."""
        return tree_map(lambda a: a[row : row + 1], self.cache)

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
        self.cache, result = verify_unchecked(
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
    rows = as_rows(prompt)
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
