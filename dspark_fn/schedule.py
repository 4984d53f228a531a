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

Point sources (``proposals="auto"``; ``sources``): a row may verify a
point-mass proposal instead of the draft: a copy of an earlier stretch of
its own context, the tokens its grammar forces, a store's continuation, or
any other ``sources.PointSource``. Each costs no draft pass. ``SlotRates``
measures ``α_k`` per kind: the draft's as above, and each point source's
per kind of offer (a copy's or stored continuation's matched ending
length; forced tokens, one kind), each offer scored against the tokens its
row committed whether it was verified or not (``observe_points``). Before a
round the planner rates it without the draft pass (each row with an offer
verifies its best one) and with it (each row takes the better of its best
offer and the draft), each at its best slot level, and drafts only when
that is faster (or a probe is due); with the draft alone the same
comparison has no offers in it. Offers are made from the previous round's
tokens, so with point sources the sources are chosen at the start of the
round, and a round that drafts reads its draft's confidences before
planning (a second host sync). An offer is a function of the committed
tokens and its rates are measured on finished rounds: choosing it never
looks at the round's own draws, and its slots enter Algorithm 1 with
survival ``Π_{i<=k} α_i`` up to its length (0 past it), which depends on no
token of the round. Forced tokens are accepted with probability 1 (the
verify's masks make the constrained target certain of them), so their kind
stays at 1 unless a mask is wrong. (A fixed width drafts every round, so it
proposes point masses only with ``proposals="copy"``.)
"""

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

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
DRAFTED = 0  # the draft's row of ``SlotRates``; the point sources' kinds follow (``Planner.rate_row``)
NOTHING = -1  # a row that verifies no point source's proposal (``Choice.points``, ``Plan.points``)


@dataclass
class SlotRates:
    """Measured acceptance of each proposal slot, by kind of proposal: the
    draft (row ``DRAFTED``), then each point source's kinds (a copy's or a
    stored continuation's matched ending length: a longer match continues
    more often; a grammar's forced tokens, one kind). ``alpha_k`` is the
    rate at which slot k was accepted when slots < k were: an average over
    the first observations, then an exponential moving average with weight
    ``ACCEPTANCE_EMA``."""

    acceptance: np.ndarray  # [1 + point kinds, G] alpha_k
    observed: np.ndarray  # [1 + point kinds, G] observations of slot k

    @classmethod
    def start(cls, slots: int, point_kinds: int = 0) -> "SlotRates":
        # Untried slots count as always accepted, so the first rounds propose and measure.
        shape = (1 + point_kinds, slots)
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

    def observe_points(self, kinds: np.ndarray, proposals: list, committed: list) -> None:
        """Every row's point-mass proposal (``proposals[b]``, rated under row
        ``kinds[b]``, 0 for none) against the tokens the row committed
        (``committed[b]``), whether the round verified it or not: slot k
        counts where the proposal's first k tokens were committed and a
        committed token stands at slot k; the outcome is whether it is the
        proposed one. Given that prefix the committed token is distributed as
        the target's (the rounds are lossless), so this is the acceptance of
        the proposal as a point mass, and every source stays measured through
        rounds that verified another."""
        outcomes: dict = {}
        for kind, proposal, tokens in zip(kinds, proposals, committed):
            if not kind:
                continue
            for slot, (proposed, token) in enumerate(zip(proposal, tokens)):
                outcomes.setdefault((kind, slot), []).append(proposed == token)
                if proposed != token:
                    break
        for (kind, slot), kept in outcomes.items():
            self.learn(kind, slot, np.array(kept))

    def expected(self, kinds: np.ndarray, slots: int) -> np.ndarray:
        """``[R, slots]``: the rates a plan reads for each row's kind. A point
        source's untried slot after a tried one counts at the rate of the
        slot before it: its offers are scored every round, so a slot stays
        untried only while the slots before it are rarely accepted (taken as
        always accepted, it would rate a poor source's long offers high).
        The draft's untried slots count as accepted, so that it is tried."""
        kinds = np.asarray(kinds, int)
        rates = self.acceptance[kinds, :slots].copy()
        carried = (self.observed[kinds, :slots] == 0) & (kinds != DRAFTED)[:, None]
        for slot in range(1, slots):
            rates[:, slot] = np.where(carried[:, slot], rates[:, slot - 1], rates[:, slot])
        return rates

    def gains(self, kinds: np.ndarray, slots: int, lengths: np.ndarray | None = None) -> np.ndarray:
        """``[R, slots + 1]``: expected accepted proposals of each row's kind
        when it verifies its first ``l`` slots (column l); a row has only its
        first ``lengths[r]`` proposals when given."""
        survival = np.cumprod(self.expected(kinds, slots), axis=1)
        if lengths is not None:
            survival = survival * (np.arange(slots) < np.asarray(lengths)[:, None])
        return np.concatenate([np.zeros((len(survival), 1)), np.cumsum(survival, axis=1)], axis=1)


class Offer(NamedTuple):
    """What a point source proposes for one row: tokens, and the kind its
    acceptance is measured under (``1..kinds`` of its source; 0: no offer)."""

    tokens: list
    kind: int


class Offers(NamedTuple):
    """A round's point-mass proposals: one from each point source (S) for each row (B)."""

    rates: np.ndarray  # [S, B] the ``SlotRates`` row rating each (0: no offer)
    tokens: list  # [S][B] the proposed tokens

    @classmethod
    def none(cls, batch: int) -> "Offers":
        return cls(np.zeros((0, batch), int), [])

    @property
    def lengths(self) -> np.ndarray:
        """``[S, B]`` how many tokens each offer holds."""
        return np.array([[len(tokens) for tokens in source] for source in self.tokens], int).reshape(self.rates.shape)

    def chosen(self, points: np.ndarray) -> list:
        """Each row's tokens from the source ``points[b]`` (none where ``NOTHING``)."""
        return [self.tokens[source][row] if source != NOTHING else [] for row, source in enumerate(points)]


class PointMasses(NamedTuple):
    """Each row's best point-mass proposal at every slot level, among the point sources' offers."""

    gains: np.ndarray  # [B, slots + 1] expected accepted proposals of the best offer (0 without one)
    best: np.ndarray  # [B, slots + 1] the source whose offer is the best at that level
    available: np.ndarray  # [B] rows with at least one offer

    @classmethod
    def rated(cls, rates: SlotRates, offers: Offers, slots: int) -> "PointMasses":
        batch = offers.rates.shape[1]
        each = [np.where((kinds > 0)[:, None], rates.gains(kinds, slots, lengths), -1.0)
                for kinds, lengths in zip(offers.rates, offers.lengths)] or [np.full((batch, slots + 1), -1.0)]
        stacked = np.stack(each)  # [S, B, slots + 1]; -1 where a source offers nothing, so it is never the best
        return cls(np.maximum(stacked.max(axis=0), 0.0), stacked.argmax(axis=0), (offers.rates > 0).any(axis=0))

    def split(self, taking: np.ndarray, level: int) -> np.ndarray:
        """``[B]``: the source each of the ``taking`` rows verifies, its best at ``level`` (``NOTHING`` elsewhere)."""
        return np.where(taking & self.available, self.best[:, level], NOTHING)


class SourceSpeeds(NamedTuple):
    """Tokens per second predicted for the coming round with and without the
    draft pass, and the point source each row would verify, with the draft
    pass and without it."""

    drafting: float
    without: float
    points: np.ndarray  # [B] with the draft pass (``NOTHING``: the draft)
    points_without: np.ndarray  # [B] without it (``NOTHING``: a plain target step)


def source_speeds(rates: SlotRates, offers: Offers, active: np.ndarray, costs: CostCurve, buckets: tuple,
                  slots: int) -> SourceSpeeds:
    """Without the draft pass every row that has a point-mass proposal may
    verify its best one; with it each row takes the best of those and the
    draft. Both are rated at every slot level ``l`` (one verify width for
    the batch) as ``sum_r (1 + gain_r(l)) / cost(l)``, from the measured
    rates alone."""
    point = PointMasses.rated(rates, offers, slots)
    draft = rates.gains([DRAFTED], slots)[0]
    verify = np.array([costs.verify[bucket_for(level + 1, buckets)] for level in range(slots + 1)])
    rows = int(active.sum())
    without = (rows + point.gains[active].sum(axis=0)) / verify
    drafting = (rows + np.maximum(point.gains[active], draft).sum(axis=0)) / (costs.draft + verify)
    level = 1 + int(np.argmax(drafting[1:]))
    return SourceSpeeds(float(drafting[level]), float(without.max()), point.split(point.gains[:, level] >= draft[level],
                        level), point.split(point.available, int(np.argmax(without))))


PROPOSALS = ("auto", "draft", "copy")  # the draft and the point sources chosen per row and round, or one kind alone


class Choice(NamedTuple):
    """What a round proposes from, chosen before its draft pass."""

    draft: bool  # the round runs the draft pass
    points: np.ndarray  # [B] the point source each row verifies instead of the draft (``NOTHING``: none)


class Plan(NamedTuple):
    """What a round verifies: its width and each row's proposal."""

    width: int  # the verify width, a compiled bucket
    limits: np.ndarray  # [B] int32: the proposals a row may keep (0: none, a plain target step)
    drafting: np.ndarray  # [B] rows verifying the draft
    points: np.ndarray  # [B] the point source a row verifies (``NOTHING``: none)
    confidences: np.ndarray | None  # [B, G] per slot, the chance planned with: the draft's confidence, or
    #                                 a point source's measured acceptance; None when nothing was proposed
    names: tuple = ()  # the point sources' names, by index

    def source(self, row: int) -> str:
        """What row ``row`` verified: "draft", a point source's name, or "" (nothing: a plain target step)."""
        if not self.limits[row]:
            return ""
        return self.names[self.points[row]] if self.points[row] != NOTHING else "draft"


CostSource = Callable[[int, tuple], CostCurve]  # (batch size, verify widths) -> the measured cost curve


class Planner:
    """What each round does, decided in one place from measured rates and
    costs, and learned back in one place.

    Settings: ``width`` ("auto": draft when it pays, Algorithm 1 picks the
    width; an int: that width every round; None: the whole block every
    round), ``proposals`` ("auto": the draft and the point sources, per row
    and round; "draft"; "copy": the point sources alone) and ``threshold``
    (a draft ends at its first slot of lower confidence). ``points``: the
    point sources as ``(name, kinds)``, in order of preference where two
    are rated equal. ``costs``: the cost curve (the same for every batch
    size) or a function measuring it per batch size; read only under
    "auto".

    State: the measured rates (``SlotRates``), the probe schedule and the
    cost curve of each batch size the batch has had (``resize``).

    A round asks ``sources`` (whether it drafts, which rows verify a point
    source's offer), then ``plan`` (the width and each row's limit, from the
    draft's confidences and the offers' rates), and once its tokens are
    known ``learn``. With the draft as the only source (``ahead``) a round's
    sources are chosen during the round before, so its draft is evaluated
    with that round's verify; with point sources (``pointed``) they are
    chosen once the previous round's tokens are known, since the offers are
    made from them.
    """

    def __init__(self, block_size: int, *, width="auto", proposals: str = "auto", threshold: float = 0.0,
                 costs: "CostCurve | CostSource | None" = None, batch: int = 1, points: Sequence[tuple] = ()):
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
        self.names = tuple(name for name, _ in points)
        kinds = [int(count) for _, count in points]
        self.first_kind = tuple(1 + int(sum(kinds[:i])) for i in range(len(kinds)))  # each source's first rate row
        self.pointed = bool(points) and self.max_width > 1 and (proposals == "copy" or (proposals == "auto" and self.auto))
        self._measure = costs if callable(costs) else (lambda batch, buckets: costs)
        self.curves: dict = {}  # batch size -> its cost curve
        self.batch = batch
        self.resize(batch)
        self.point_kinds = sum(kinds)
        self.reset()

    @property
    def ahead(self) -> bool:
        """Whether a round's sources are chosen during the round before (the draft is the only source)."""
        return not self.pointed

    @property
    def costs(self) -> CostCurve | None:
        """The running batch size's cost curve under "auto" (None for a fixed width)."""
        return self.curves[self.batch] if self.auto else None

    def rate_row(self, source: int, kind: int) -> int:
        """The ``SlotRates`` row of kind ``kind`` (``1..kinds``) of point source ``source``."""
        return self.first_kind[source] + kind - 1

    def offers(self, offered: Sequence[Sequence[Offer]]) -> Offers:
        """The round's offers (``offered[s][b]``: point source s's for row b)
        with their rate rows; an offer of no tokens is none."""
        rates = [[self.rate_row(s, offer.kind) if offer.kind and offer.tokens else 0 for offer in source]
                 for s, source in enumerate(offered)]
        batch = len(offered[0]) if offered else self.batch
        return Offers(np.array(rates, int).reshape(len(offered), batch),
                      [[list(offer.tokens) for offer in source] for source in offered])

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
        self.rates = SlotRates.start(self.max_width - 1, self.point_kinds)
        self.plain_rounds, self.probe_interval = 0, 1

    def sources(self, offers: Offers, live: np.ndarray) -> Choice:
        """Whether the coming round drafts, and the point source (if any)
        each row verifies instead. Reads finished rounds and the committed
        tokens only, never the round it decides."""
        none = np.full(len(live), NOTHING)
        if self.max_width == 1:
            return Choice(False, none)
        if not self.pointed:
            offers = Offers.none(len(live))
        if self.proposals == "copy":
            return Choice(False, PointMasses.rated(self.rates, offers, self.max_width - 1).split(live, self.max_width - 1))
        if not self.auto:  # a fixed width drafts every round
            return Choice(True, none)
        speeds = source_speeds(self.rates, offers, live, self.costs, self.buckets, self.max_width - 1)
        if not self._draft_pays(speeds.drafting, speeds.without):
            return Choice(False, np.where(live, speeds.points_without, NOTHING))
        points = np.where(live, speeds.points, NOTHING)
        return Choice(bool((live & (points == NOTHING)).any()), points)

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

    def plan(self, draft_confidences: np.ndarray | None, offers: Offers, choice: Choice, live: np.ndarray,
             fresh: np.ndarray) -> Plan:
        """The round's width and limits. ``draft_confidences [B, G]``: the
        sigmoid of the draft's confidence logits, None without a draft;
        ``fresh [B]``: live rows the draft does not cover (they joined after
        it was made). A row verifying a point source's offer has its slots
        rated by that offer's kind up to its length (and 0 past it); the
        threshold cuts drafts only; Algorithm 1 ("auto") reads the live rows."""
        points = choice.points
        pointing = points != NOTHING
        drafting = live & ~pointing & ~fresh if draft_confidences is not None else np.zeros_like(live)
        if not (drafting | pointing).any():
            return Plan(1, np.zeros(len(live), np.int32), drafting, points, None, self.names)
        slots = self.max_width - 1
        confidences = np.zeros((len(live), self.block_size)) if draft_confidences is None else draft_confidences.copy()
        limits = np.where(drafting, slots, 0)
        for row in np.flatnonzero(pointing):
            source = points[row]
            limits[row] = min(slots, len(offers.tokens[source][row]))
            confidences[row] = 0.0
            confidences[row, : limits[row]] = self.rates.expected([offers.rates[source, row]], limits[row])[0]
        if self.threshold > 0:
            limits = np.where(drafting, np.minimum(limits, threshold_lengths(confidences, self.threshold)), limits)
        if self.auto:
            allowed = np.arange(confidences.shape[1])[None, :] < limits[:, None]
            survival = np.cumprod(confidences, axis=1) * allowed
            limits = np.minimum(limits, scheduled_length(survival[live][:, :slots], self.costs, self.buckets))
        widest = int(limits[live].max())
        return Plan(bucket_for(widest + 1, self.buckets), limits.astype(np.int32), drafting, points, confidences,
                    self.names)

    def learn(self, plan: Plan, accepted: np.ndarray, offers: Offers, committed: list) -> None:
        """A finished round: the draft's rates from the rows that verified it
        (``accepted [B]``), and every point source's offers scored against
        the tokens each row committed (``committed[b]``), whether the round
        verified them or not."""
        if plan.drafting.any():
            rows = plan.drafting
            self.rates.observe_drafts(accepted[rows], plan.limits[rows], plan.confidences[rows])
        for kinds, proposals in zip(offers.rates, offers.tokens):
            self.rates.observe_points(kinds, proposals, committed)
