"""How many drafted tokens to verify each round (spec §5 and §7).

A round drafts the whole block, then the host reads the confidences
``c_k`` and picks each row's proposal length ``limit_r`` and the verify
width (a compiled bucket ``>= 1 + max limit_r``); the verify kernel accepts
at most ``limit_r`` drafts per row. Three rules, combinable:

- fixed: ``limit = width - 1``;
- threshold (§5): ``limit_r`` = the first slot with ``c_k < threshold``;
- auto (§7, Algorithm 1): maximise expected tokens per second,
  ``Θ(ℓ) = Σ_r (1 + Σ_{k<=ℓ} a_{r,k}) / cost(bucket(1 + ℓ))`` with prefix
  survival ``a_{r,k} = Π_{i<=k} c_{r,i}`` and the measured round cost of
  each width, admitting slot levels ``ℓ = 1, 2, ...`` in order and stopping
  at the first level that does not improve ``Θ``.

Why auto stays lossless: ``c_k`` is computed from the block hidden state and
the token drafted at slot ``k - 1``, so ``a_{r,k}`` is a function of the
drafts before slot ``k``. Thanks to the early stop, whether slot ``k`` is
verified is decided from ``a_{·,1..k}`` alone, never from ``x_k`` itself
(a global argmax over ``ℓ`` would look at ``a_{k+1}``, which depends on
``x_k``: spec Appendix A). The same holds for the threshold cut. Each row's
decision may also depend on the other rows, which are independent of it.

The verify kernels run one width for the whole batch, so the cost of a
round depends on the width only; candidates that share a slot level share
their cost, which is why the levels (not single tokens) are the greedy
steps. For one row this is exactly the paper's Algorithm 1 (its candidates,
sorted by ``a``, are the slots in order). Rows a bucket rounds up past their
``limit`` verify those extra drafts for free but do not keep them.

Where the decision sits: ``generate`` evaluates the verify of round r and
the draft of round r + 1 together (one host sync per round), then plans
round r + 1 from that draft's own confidences before launching its verify.
So the width follows the current proposal (the paper's Algorithm 1), not a
lagged one, at no extra sync. The round cost is ``draft + verify(width)``.

Whether to draft at all (``DraftGate``, the "auto" policy): a round that
does not draft costs one plain target step, ``verify(1)``, and still writes
the draft's context, so drafting can resume at once. Before launching the
draft of round r + 1 the gate compares, from what rounds up to r - 1 showed,

    max_ℓ (1 + Σ_{k<=ℓ} Π_{i<=k} α_i) / (draft + verify(bucket(ℓ + 1)))   vs   1 / verify(1)

where ``α_k`` is the measured rate at which slot k was accepted when slots
< k were (an average over the first rounds, then an exponential moving
average with weight ``ACCEPTANCE_EMA``), and the costs are the measured
curve. Drafting that pays continues; otherwise the round is plain, and a
probe round drafts again after 1, 2, 4, ... up to ``PROBE_LIMIT`` plain
rounds, so a stretch of easy text is found at a bounded cost. The gate
reads only finished rounds, never the tokens of the round it decides, so
it changes the speed, not the output.

Two proposal sources (``proposals="auto"``): a row may verify a copy of an
earlier stretch of its own context (``copying``) instead of the draft. A
copy costs no draft pass. ``SlotRates`` measures ``α_k`` per source: the
draft's as above, and copies' per length of the ending they matched, each
copy scored against the tokens its row committed whether it was verified
or not. Before a round the gate rates it without the draft pass (rows with
a copy verify it) and with it (each row takes the better of its copy and
the draft), each at its best slot level, and drafts only when that is
faster (or a probe is due). A copy is a function of the committed tokens
and its rates are measured on finished rounds: choosing it never looks at
the round's own draws, and its slots enter Algorithm 1 with survival
``Π_{i<=k} α_i``, which depends on no token of the round. (A fixed width
drafts every round, so it proposes copies only with ``proposals="copy"``.)
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .copying import LONGEST_MATCH

WIDTH_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def width_buckets(block_size: int, fixed: int | None = None) -> tuple:
    """The verify widths compiled for a draft of ``block_size`` (plus ``fixed``)."""
    widest = block_size + 1
    widths = {w for w in WIDTH_LADDER if w <= widest} | {widest}
    if fixed is not None:
        widths.add(fixed)
    return tuple(sorted(widths))


def bucket_for(width: int, buckets: tuple) -> int:
    return next(b for b in buckets if b >= width)


def threshold_lengths(confidences: np.ndarray, threshold: float) -> np.ndarray:
    """``[B]``: number of leading slots with ``c_k >= threshold`` (spec §5)."""
    passed = np.cumprod(confidences >= threshold, axis=1)
    return passed.sum(axis=1)


@dataclass(frozen=True)
class CostCurve:
    """Seconds for one draft block and one verify of each compiled width."""

    draft: float
    verify: dict

    def round_cost(self, width: int) -> float:
        return self.draft + self.verify[width]

    def to_json(self) -> dict:
        return {"draft": self.draft, "verify": {str(w): t for w, t in self.verify.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(data["draft"], {int(w): t for w, t in data["verify"].items()})


def scheduled_length(survival: np.ndarray, costs: CostCurve, buckets: tuple) -> int:
    """Algorithm 1 with its early stop over slot levels: the proposal length ℓ.

    ``survival [B, G]`` holds ``a_{r,k}`` of the rows that take part (zero
    where a row may not go). Level ``k`` is admitted only if it raises
    ``Θ``; the first level that does not ends the search.
    """
    expected = float(survival.shape[0])  # every row emits its target token
    best = expected / costs.round_cost(bucket_for(1, buckets))
    length = 0
    for level in range(1, survival.shape[1] + 1):
        expected += float(survival[:, level - 1].sum())
        value = expected / costs.round_cost(bucket_for(level + 1, buckets))
        if value <= best:
            break
        best, length = value, level
    return length


@dataclass(frozen=True)
class VerifyPolicy:
    """Turns one round's draft confidences into ``(width, limits)``."""

    max_width: int
    buckets: tuple
    threshold: float = 0.0
    costs: CostCurve | None = None  # set: choose the length by Algorithm 1 ("auto")

    def plan(self, confidences: np.ndarray, active: np.ndarray, proposing: np.ndarray | None = None,
             copying: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """``confidences [B, G]`` (sigmoid of the confidence logits; a row that
        verifies a copy holds its slots' measured rates), ``active [B]`` rows
        still generating, ``proposing [B]`` (default all) rows with something
        to verify, ``copying [B]`` (default none) rows verifying a copy (the
        confidence threshold is the draft's) -> verify width and per-row
        proposal lengths."""
        batch, slots = confidences.shape
        limits = np.full(batch, self.max_width - 1)
        if proposing is not None:
            limits = np.where(proposing, limits, 0)
        if self.threshold > 0:
            cut = np.minimum(limits, threshold_lengths(confidences, self.threshold))
            limits = cut if copying is None else np.where(copying, limits, cut)
        if self.costs is not None:
            allowed = np.arange(slots)[None, :] < limits[:, None]
            survival = np.cumprod(confidences, axis=1) * allowed
            length = scheduled_length(survival[active][:, : self.max_width - 1], self.costs, self.buckets)
            limits = np.minimum(limits, length)
        widest = int(limits[active].max()) if active.any() else 0
        return bucket_for(widest + 1, self.buckets), limits.astype(np.int32)

    def gate(self, rates: "SlotRates | None" = None) -> "DraftGate | None":
        """A fresh gate for one generation under "auto" (learning into
        ``rates``, default its own); ``None`` for fixed widths, which draft
        every round (``max_width > 1``) or never."""
        if self.costs is None or self.max_width == 1:
            return None
        return DraftGate.start(self.costs, self.buckets, self.max_width - 1, rates)


ACCEPTANCE_EMA = 0.2
PROBE_LIMIT = 16
DRAFTED = 0  # the draft's row of ``SlotRates``; row n >= 1 holds copies that matched an ending of n tokens


@dataclass
class SlotRates:
    """Measured acceptance of each proposal slot, by kind of proposal: the
    draft (row ``DRAFTED``) and copies by the length of the ending they
    matched (row n; a longer match continues more often). ``alpha_k`` is
    the rate at which slot k was accepted when slots < k were: an average
    over the first observations, then an exponential moving average with
    weight ``ACCEPTANCE_EMA``."""

    acceptance: np.ndarray  # [1 + longest match, G] alpha_k
    observed: np.ndarray  # [1 + longest match, G] observations of slot k

    @classmethod
    def start(cls, slots: int, longest_match: int = LONGEST_MATCH) -> "SlotRates":
        # Untried slots count as always accepted, so the first rounds propose and measure.
        shape = (1 + longest_match, slots)
        return cls(np.ones(shape), np.zeros(shape))

    def learn(self, kind: int, slot: int, outcomes: np.ndarray) -> None:
        """One round's outcomes (accepted or not, or a probability) of ``slot``."""
        if not outcomes.size:
            return
        self.observed[kind, slot] += outcomes.size
        weight = max(ACCEPTANCE_EMA, outcomes.size / self.observed[kind, slot])
        self.acceptance[kind, slot] += weight * (float(outcomes.mean()) - self.acceptance[kind, slot])

    def observe_drafts(self, accepted: np.ndarray, limits: np.ndarray, confidences: np.ndarray) -> None:
        """Rows that verified the draft: row r verified ``limits[r]`` drafts
        and kept ``accepted[r]``. Slot k counts for the rows that reached it
        (every earlier slot accepted): verified, it was accepted or not; left
        unverified by the plan, its draft confidence stands in for the
        outcome (the plan cut it because that confidence was low)."""
        for slot in range(self.acceptance.shape[1]):
            reached = accepted >= slot
            verified = limits > slot
            self.learn(DRAFTED, slot, np.where(verified, accepted > slot, confidences[:, slot])[reached])

    def observe_copies(self, matches: list, copies: list, committed: list) -> None:
        """Score each row's copy (``matches[r]`` tokens matched, 0: none)
        against the tokens the row committed this round, whether the round
        verified it or not. Slot k counts where the copy's first k tokens
        were committed and a committed token stands at slot k; the outcome is
        whether it is the copied one. Given that prefix the committed token
        is distributed as the target's (the rounds are lossless), so this is
        the acceptance of the copy as a point-mass proposal, and copies stay
        measured through rounds that verified the draft."""
        outcomes: dict = {}
        for match, copy, tokens in zip(matches, copies, committed):
            if not match:
                continue
            for slot, (copied, token) in enumerate(zip(copy, tokens)):
                outcomes.setdefault((match, slot), []).append(copied == token)
                if copied != token:
                    break
        for (match, slot), kept in outcomes.items():
            self.learn(match, slot, np.array(kept))

    def gains(self, kinds: np.ndarray, slots: int) -> np.ndarray:
        """``[R, slots + 1]``: expected accepted proposals of each row's kind
        when it verifies its first ``l`` slots (column l)."""
        survival = np.cumprod(self.acceptance[np.asarray(kinds, int), :slots], axis=1)
        return np.concatenate([np.zeros((len(survival), 1)), np.cumsum(survival, axis=1)], axis=1)


class SourceSpeeds(NamedTuple):
    """Tokens per second predicted for the coming round with and without the
    draft pass, and the rows that would verify their copy if it drafts."""

    drafting: float
    without: float
    copying: np.ndarray  # [B]


def source_speeds(rates: SlotRates, matches: np.ndarray, active: np.ndarray, costs: CostCurve,
                  buckets: tuple, slots: int) -> SourceSpeeds:
    """Without the draft pass every row that has a copy may verify it; with
    it each row takes the better of its copy and the draft. Both are rated
    at every slot level ``l`` (one verify width for the batch) as
    ``sum_r (1 + gain_r(l)) / cost(l)``, from the measured rates alone."""
    copy = rates.gains(matches, slots) * (matches > 0)[:, None]
    draft = rates.gains([DRAFTED], slots)[0]
    verify = np.array([costs.verify[bucket_for(level + 1, buckets)] for level in range(slots + 1)])
    rows = int(active.sum())
    without = (rows + copy[active].sum(axis=0)) / verify
    drafting = (rows + np.maximum(copy[active], draft).sum(axis=0)) / (costs.draft + verify)
    level = 1 + int(np.argmax(drafting[1:]))
    return SourceSpeeds(float(drafting[level]), float(without.max()), (matches > 0) & (copy[:, level] >= draft[level]))


@dataclass
class DraftGate:
    """Host-side memory of the "auto" policy: the measured rates (``SlotRates``,
    shared with the decoder) and the probe schedule. ``draft_next`` decides
    the coming round when the draft is the only source, ``choose_sources``
    when copies stand beside it; ``observe`` learns from a drafted round."""

    costs: CostCurve
    buckets: tuple
    rates: SlotRates
    plain_rounds: int = 0
    probe_interval: int = 1

    @classmethod
    def start(cls, costs: CostCurve, buckets: tuple, max_drafts: int, rates: SlotRates | None = None) -> "DraftGate":
        return cls(costs, buckets, rates if rates is not None else SlotRates.start(max_drafts))

    @property
    def acceptance(self) -> np.ndarray:
        """``[G]`` the draft's alpha_k."""
        return self.rates.acceptance[DRAFTED]

    @property
    def observed(self) -> np.ndarray:
        return self.rates.observed[DRAFTED]

    def expected_speed(self) -> tuple[float, float]:
        """``(drafting, plain)`` tokens per second predicted for the next round."""
        emitted = 1 + np.cumsum(np.cumprod(self.acceptance))
        drafting = max(
            emitted[drafts - 1] / self.costs.round_cost(bucket_for(drafts + 1, self.buckets))
            for drafts in range(1, len(emitted) + 1)
        )
        return drafting, 1 / self.costs.verify[bucket_for(1, self.buckets)]

    def draft_next(self) -> bool:
        return self.decide(*self.expected_speed())

    def decide(self, drafting: float, without: float) -> bool:
        """Draft when that is predicted faster; otherwise probe after 1, 2,
        4, ... up to ``PROBE_LIMIT`` rounds without it."""
        if drafting > without:
            self.probe_interval = 1
            return True
        if self.plain_rounds >= self.probe_interval:
            self.plain_rounds = 0
            self.probe_interval = min(2 * self.probe_interval, PROBE_LIMIT)
            return True
        self.plain_rounds += 1
        return False

    def choose_sources(self, matches: np.ndarray, active: np.ndarray) -> tuple[bool, np.ndarray]:
        """Whether the coming round drafts, and the rows that verify their
        copy (``matches [B]``: the length of each row's matched ending, 0
        without a copy). Reads finished rounds and the committed tokens only."""
        speeds = source_speeds(self.rates, matches, active, self.costs, self.buckets, len(self.acceptance))
        if self.decide(speeds.drafting, speeds.without):
            return True, speeds.copying
        return False, matches > 0

    def observe(self, accepted: np.ndarray, limits: np.ndarray, confidences: np.ndarray) -> None:
        """A drafted round (see ``SlotRates.observe_drafts``)."""
        self.rates.observe_drafts(accepted, limits, confidences)
