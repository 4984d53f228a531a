"""What each round does: whether it drafts, which rows verify a copy, how
many proposals each row verifies and at what width (spec §5 and §7), all
decided by one ``Planner`` from measured rates and costs and learned back
in one place.

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

Where the decision sits: with the draft as the only source (``Planner.ahead``)
the driver evaluates the verify of round r and the draft of round r + 1
together (one host sync per round), then plans round r + 1 from that
draft's own confidences before launching its verify. So the width follows
the current proposal (the paper's Algorithm 1), not a lagged one, at no
extra sync. The round cost is ``draft + verify(width)``.

Whether to draft at all (``Planner.sources`` under "auto"): a round that
does not draft costs one plain target step, ``verify(1)``, and still writes
the draft's context, so drafting can resume at once. Before launching the
draft of round r + 1 the planner compares, from what rounds up to r - 1 showed,

    max_ℓ (1 + Σ_{k<=ℓ} Π_{i<=k} α_i) / (draft + verify(bucket(ℓ + 1)))   vs   1 / verify(1)

where ``α_k`` is the measured rate at which slot k was accepted when slots
< k were (an average over the first rounds, then an exponential moving
average with weight ``ACCEPTANCE_EMA``), and the costs are the measured
curve. Drafting that pays continues; otherwise the round is plain, and a
probe round drafts again after 1, 2, 4, ... up to ``PROBE_LIMIT`` plain
rounds, so a stretch of easy text is found at a bounded cost. The decision
reads only finished rounds, never the tokens of the round it decides, so
it changes the speed, not the output.

Two proposal sources (``proposals="auto"``): a row may verify a copy of an
earlier stretch of its own context (``copying``) instead of the draft. A
copy costs no draft pass. ``SlotRates`` measures ``α_k`` per source: the
draft's as above, and copies' per length of the ending they matched, each
copy scored against the tokens its row committed whether it was verified
or not. Before a round the planner rates it without the draft pass (rows
with a copy verify it) and with it (each row takes the better of its copy
and the draft), each at its best slot level, and drafts only when that is
faster (or a probe is due); with the draft alone the same comparison has
no copies in it. Copies need the previous round's tokens, so with copies
the sources are chosen at the start of the round, and a round that drafts
reads its draft's confidences before planning (a second host sync). A copy is a function of the committed tokens
and its rates are measured on finished rounds: choosing it never looks at
the round's own draws, and its slots enter Algorithm 1 with survival
``Π_{i<=k} α_i``, which depends on no token of the round. (A fixed width
drafts every round, so it proposes copies only with ``proposals="copy"``.)

A third source, for rows under a constraint: where the grammar admits one
continuation only (keys, punctuation, the markers of a tool call), the
driver reads those forced tokens from the row's matcher before the round
(``forced [B]``: how many). They are point masses like copies, and the
verify's masks make the constrained target certain of them, so they are
accepted with probability 1 (``SlotRates`` measures them as the kind
``FORCED``, which stays at 1 unless a mask is wrong). A forcing row's slots
enter the plan with survival 1 up to its forced count and 0 after;
``sources`` compares them with the row's copy and the draft as it compares
copies, so a round in which every row that proposes is forced (or copies)
runs no draft pass. Forced tokens are proposed wherever copies are (the
sources are chosen at the start of the round, once the matchers have
followed the previous round's tokens); like a copy, they are a function of
the committed tokens alone.
"""

from dataclasses import dataclass
from typing import Callable, NamedTuple

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


ACCEPTANCE_EMA = 0.2
PROBE_LIMIT = 16
DRAFTED = 0  # the draft's row of ``SlotRates``; row n >= 1 holds copies that matched an ending of n tokens
FORCED = LONGEST_MATCH + 1  # the row of tokens a grammar forces


@dataclass
class SlotRates:
    """Measured acceptance of each proposal slot, by kind of proposal: the
    draft (row ``DRAFTED``), copies by the length of the ending they
    matched (row n; a longer match continues more often) and forced tokens
    (row ``FORCED``, after the longest match). ``alpha_k`` is
    the rate at which slot k was accepted when slots < k were: an average
    over the first observations, then an exponential moving average with
    weight ``ACCEPTANCE_EMA``."""

    acceptance: np.ndarray  # [2 + longest match, G] alpha_k
    observed: np.ndarray  # [2 + longest match, G] observations of slot k

    @classmethod
    def start(cls, slots: int, longest_match: int = LONGEST_MATCH) -> "SlotRates":
        # Untried slots count as always accepted, so the first rounds propose and measure.
        shape = (2 + longest_match, slots)
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

    def observe_verified(self, kind: int, accepted: np.ndarray, limits: np.ndarray) -> None:
        """Rows that verified proposals of ``kind``: row r verified
        ``limits[r]`` and kept ``accepted[r]``; slot k counts where it was
        verified and every earlier slot accepted."""
        for slot in range(int(limits.max(initial=0))):
            reached = (accepted >= slot) & (limits > slot)
            self.learn(kind, slot, (accepted > slot)[reached])

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

    def gains(self, kinds: np.ndarray, slots: int, lengths: np.ndarray | None = None) -> np.ndarray:
        """``[R, slots + 1]``: expected accepted proposals of each row's kind
        when it verifies its first ``l`` slots (column l); a row has only its
        first ``lengths[r]`` proposals when given."""
        survival = np.cumprod(self.acceptance[np.asarray(kinds, int), :slots], axis=1)
        if lengths is not None:
            survival = survival * (np.arange(slots) < np.asarray(lengths)[:, None])
        return np.concatenate([np.zeros((len(survival), 1)), np.cumsum(survival, axis=1)], axis=1)


class PointMasses(NamedTuple):
    """Each row's best point-mass proposal (a copy or its forced tokens) at every slot level."""

    gains: np.ndarray  # [B, slots + 1] expected accepted proposals of the better of the two
    forced_better: np.ndarray  # [B, slots + 1] where its forced tokens are the better (else its copy)
    available: np.ndarray  # [B] rows that have a copy or forced tokens

    @classmethod
    def rated(cls, rates: SlotRates, matches: np.ndarray, forced: np.ndarray, slots: int) -> "PointMasses":
        copy = rates.gains(matches, slots) * (matches > 0)[:, None]
        force = rates.gains(np.full(len(forced), FORCED), slots, forced)
        return cls(np.maximum(copy, force), (force >= copy) & (forced > 0)[:, None], (matches > 0) | (forced > 0))

    def split(self, taking: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
        """``(copying, forcing)``: the ``taking`` rows by the better of their two at ``level``."""
        forcing = taking & self.available & self.forced_better[:, level]
        return taking & self.available & ~forcing, forcing


class SourceSpeeds(NamedTuple):
    """Tokens per second predicted for the coming round with and without the
    draft pass, and the rows that would verify their copy or forced tokens,
    with the draft pass and without it."""

    drafting: float
    without: float
    copying: np.ndarray  # [B] with the draft pass
    forcing: np.ndarray  # [B] with the draft pass
    copying_without: np.ndarray  # [B] without it
    forcing_without: np.ndarray  # [B] without it


def source_speeds(rates: SlotRates, matches: np.ndarray, active: np.ndarray, costs: CostCurve,
                  buckets: tuple, slots: int, forced: np.ndarray | None = None) -> SourceSpeeds:
    """Without the draft pass every row that has a point-mass proposal (a
    copy, or ``forced[r]`` tokens its grammar forces) may verify it; with it
    each row takes the best of those and the draft. Both are rated at every
    slot level ``l`` (one verify width for the batch) as
    ``sum_r (1 + gain_r(l)) / cost(l)``, from the measured rates alone."""
    forced = np.zeros(len(matches), int) if forced is None else forced
    point = PointMasses.rated(rates, matches, forced, slots)
    draft = rates.gains([DRAFTED], slots)[0]
    verify = np.array([costs.verify[bucket_for(level + 1, buckets)] for level in range(slots + 1)])
    rows = int(active.sum())
    without = (rows + point.gains[active].sum(axis=0)) / verify
    drafting = (rows + np.maximum(point.gains[active], draft).sum(axis=0)) / (costs.draft + verify)
    level = 1 + int(np.argmax(drafting[1:]))
    copying, forcing = point.split(point.gains[:, level] >= draft[level], level)
    copying_without, forcing_without = point.split(point.available, int(np.argmax(without)))
    return SourceSpeeds(float(drafting[level]), float(without.max()), copying, forcing, copying_without,
                        forcing_without)



PROPOSALS = ("auto", "draft", "copy")  # where rows' proposals come from: chosen per row and round, or one source


class Sources(NamedTuple):
    """What a round proposes from, chosen before its draft pass."""

    draft: bool  # the round runs the draft pass
    copying: np.ndarray  # [B] rows that verify their copy instead of the draft
    forcing: np.ndarray  # [B] rows that verify the tokens their grammar forces


class Plan(NamedTuple):
    """What a round verifies: its width and each row's proposal."""

    width: int  # the verify width, a compiled bucket
    limits: np.ndarray  # [B] int32: the proposals a row may keep (0: none, a plain target step)
    drafting: np.ndarray  # [B] rows verifying the draft
    copying: np.ndarray  # [B] rows verifying their copy
    forcing: np.ndarray  # [B] rows verifying their forced tokens
    confidences: np.ndarray | None  # [B, G] per slot, the chance planned with: the draft's confidence, or
    #                                 a copy's or forced token's measured acceptance; None when nothing was proposed

    def source(self, row: int) -> str:
        """What row ``row`` verified: "draft", "copy", "forced" or "" (nothing: a plain target step)."""
        if not self.limits[row]:
            return ""
        return "copy" if self.copying[row] else "forced" if self.forcing[row] else "draft"


CostSource = Callable[[int, tuple], CostCurve]  # (batch size, verify widths) -> the measured cost curve


class Planner:
    """What each round does, decided in one place from measured rates and
    costs, and learned back in one place.

    Settings: ``width`` ("auto": draft when it pays, Algorithm 1 picks the
    width; an int: that width every round; None: the whole block every
    round), ``proposals`` ("auto", "draft" or "copy") and ``threshold`` (a
    draft ends at its first slot of lower confidence). ``costs``: the cost
    curve (the same for every batch size) or a function measuring it per
    batch size; read only under "auto".

    State: the measured rates (``SlotRates``), the probe schedule and the
    cost curve of each batch size the batch has had (``resize``).

    A round asks ``sources`` (whether it drafts, which rows verify a copy
    or their forced tokens), then ``plan`` (the width and each row's limit,
    from the draft's confidences and the point masses' rates), and once its
    tokens are known ``learn``. With the draft as the only source
    (``ahead``) a round's sources are chosen during the round before, so its
    draft is evaluated with that round's verify; with copies and forced
    tokens (``copies``) they are chosen once the previous round's tokens are
    known, since those are made from them. Another source of point-mass
    proposals enters as forced tokens did: another kind of ``SlotRates`` and
    another mask beside ``copying`` and ``forcing``.
    """

    def __init__(self, block_size: int, *, width="auto", proposals: str = "auto", threshold: float = 0.0,
                 costs: "CostCurve | CostSource | None" = None, batch: int = 1):
        if not (width is None or width == "auto" or (isinstance(width, int) and not isinstance(width, bool))):
            raise ValueError(f"verify width must be an integer, None or 'auto', got {width!r}")
        if proposals not in PROPOSALS:
            raise ValueError(f"proposals must be one of {', '.join(PROPOSALS)}, got {proposals!r}")
        self.auto = width == "auto"
        self.max_width = block_size + 1 if width is None or self.auto else width
        if not 1 <= self.max_width <= block_size + 1:
            raise ValueError(f"verify width {self.max_width} must be in 1..{block_size + 1}")
        if self.auto and costs is None:
            raise ValueError("width 'auto' plans from a cost curve: give costs (a CostCurve, or a function that "
                             "measures one)")
        self.block_size, self.proposals, self.threshold = block_size, proposals, threshold
        self.buckets = width_buckets(block_size, self.max_width)
        self.copies = self.max_width > 1 and (proposals == "copy" or (proposals == "auto" and self.auto))
        self._measure = costs if callable(costs) else (lambda batch, buckets: costs)
        self.curves: dict = {}  # batch size -> its cost curve
        self.batch = batch
        self.resize(batch)
        self.reset()

    @property
    def ahead(self) -> bool:
        """Whether a round's sources are chosen during the round before (the draft is the only source)."""
        return not self.copies

    @property
    def costs(self) -> CostCurve | None:
        """The running batch size's cost curve under "auto" (None for a fixed width)."""
        return self.curves[self.batch] if self.auto else None

    def resize(self, batch: int) -> None:
        """Plan for a batch of ``batch`` rows: its cost curve (measured on
        first use); what was measured of the proposals holds at any size."""
        if self.auto and batch not in self.curves:
            self.curves[batch] = self._measure(batch, self.buckets)
        self.batch = batch

    def reset(self) -> None:
        """Forget the measured rates and the probe schedule: a sequence
        that runs alone from here follows the same decisions, so its seeded
        samples repeat."""
        self.rates = SlotRates.start(self.max_width - 1)
        self.plain_rounds, self.probe_interval = 0, 1

    def sources(self, matches: np.ndarray, live: np.ndarray, forced: np.ndarray | None = None) -> Sources:
        """Whether the coming round drafts, and the rows that verify their
        copy (``matches [B]``: the length of the ending each row's copy
        matched, 0 without one) or the tokens their grammar forces
        (``forced [B]``: how many, 0 for none or no grammar). Reads finished
        rounds and the committed tokens only, never the round it decides."""
        forced = np.zeros(len(live), int) if forced is None or not self.copies else np.asarray(forced)
        none = np.zeros_like(live)
        if self.max_width == 1:
            return Sources(False, none, none)
        if self.proposals == "copy":
            point = PointMasses.rated(self.rates, matches, forced, self.max_width - 1)
            return Sources(False, *point.split(live, self.max_width - 1))
        if not self.auto:  # a fixed width drafts every round
            return Sources(True, none, none)
        speeds = source_speeds(self.rates, matches, live, self.costs, self.buckets, self.max_width - 1, forced)
        if not self._draft_pays(speeds.drafting, speeds.without):
            return Sources(False, speeds.copying_without & live, speeds.forcing_without & live)
        copying, forcing = speeds.copying & live, speeds.forcing & live
        return Sources(bool((live & ~copying & ~forcing).any()), copying, forcing)

    def _draft_pays(self, drafting: float, without: float) -> bool:
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

    def plan(self, draft_confidences: np.ndarray | None, matches: np.ndarray, sources: Sources, live: np.ndarray,
             fresh: np.ndarray, forced: np.ndarray | None = None) -> Plan:
        """The round's width and limits. ``draft_confidences [B, G]``: the
        sigmoid of the draft's confidence logits, None without a draft; ``fresh
        [B]``: live rows the draft does not cover (they joined after it was
        made); ``forced [B]``: the forced tokens each row has. A copying
        row's slots are rated by its match length, a forcing row's by the
        forced tokens' rate up to its count (and 0 past it); the threshold
        cuts drafts only; Algorithm 1 ("auto") reads the live rows."""
        copying, forcing = sources.copying, sources.forcing
        drafting = live & ~copying & ~forcing & ~fresh if draft_confidences is not None else np.zeros_like(live)
        proposing = drafting | copying | forcing
        if not proposing.any():
            return Plan(1, np.zeros(len(live), np.int32), drafting, copying, forcing, None)
        slots = self.max_width - 1
        confidences = np.zeros((len(live), self.block_size)) if draft_confidences is None else draft_confidences.copy()
        for row in np.flatnonzero(copying):
            confidences[row, :slots] = self.rates.acceptance[matches[row]]
        limits = np.where(proposing, slots, 0)
        for row in np.flatnonzero(forcing):
            limits[row] = min(slots, int(forced[row]))
            confidences[row] = 0.0
            confidences[row, : limits[row]] = self.rates.acceptance[FORCED, : limits[row]]
        if self.threshold > 0:
            limits = np.where(drafting, np.minimum(limits, threshold_lengths(confidences, self.threshold)), limits)
        if self.auto:
            allowed = np.arange(confidences.shape[1])[None, :] < limits[:, None]
            survival = np.cumprod(confidences, axis=1) * allowed
            limits = np.minimum(limits, scheduled_length(survival[live][:, : self.max_width - 1], self.costs,
                                                         self.buckets))
        widest = int(limits[live].max())
        return Plan(bucket_for(widest + 1, self.buckets), limits.astype(np.int32), drafting, copying, forcing,
                    confidences)

    def learn(self, plan: Plan, accepted: np.ndarray, copies: list, committed: list) -> None:
        """A finished round: the draft's rates from the rows that verified it
        (``accepted [B]``), and every row's copy (``copies[b]``, a
        ``copying.Copy``) scored against the tokens it committed
        (``committed[b]``), whether the round verified that copy or not;
        the forced tokens' rate from the rows that verified theirs."""
        if plan.drafting.any():
            rows = plan.drafting
            self.rates.observe_drafts(accepted[rows], plan.limits[rows], plan.confidences[rows])
        if plan.forcing.any():
            self.rates.observe_verified(FORCED, accepted[plan.forcing], plan.limits[plan.forcing])
        if self.copies:
            self.rates.observe_copies([copy.match for copy in copies], [copy.tokens for copy in copies], committed)
