"""What each round does: whether it drafts, which rows verify a point
source's offer, how many proposals each row verifies and at what width
(spec §5 and §7), as pure functions of measured rates and costs
(``choose_sources``, ``plan_round``); the rates they read are learned
back in one place (``SlotRates``). The state they read and the order they
run in belong to ``policy.py``.

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
  at the first level that does not improve ``Θ``. Each ``c_{r,i}`` is
  calibrated first (``SlotRates.calibrated``): scaled by the rate row r's
  draft slot i was measured to keep over the mean confidence the draft gave
  it, since a confidence head trained on other text can be surer than the
  target agrees on this one.

Why auto stays lossless: ``c_k`` is computed from the block hidden state and
the token drafted at slot ``k - 1``, so ``a_{r,k}`` is a function of the
drafts before slot ``k``. Thanks to the early stop, whether slot ``k`` is
verified is decided from ``a_{·,1..k}`` alone, never from ``x_k`` itself
(a global argmax over ``ℓ`` would look at ``a_{k+1}``, which depends on
``x_k``: spec Appendix A). The same holds for the threshold cut, and for
the calibration, whose scale is read from finished rounds. Each row's
decision may also depend on the other rows, which are independent of it.

The verify kernels run one width for the whole batch, so the cost of a
round depends on the width only; candidates that share a slot level share
their cost, which is why the levels (not single tokens) are the greedy
steps. For one row this is exactly the paper's Algorithm 1 (its candidates,
sorted by ``a``, are the slots in order). Rows a bucket rounds up past their
``limit`` verify those extra drafts for free but do not keep them.

Where the decision sits: the round before prepares round r + 1's draft
(``policy.prepare``), and round r + 1 plans from that draft's own
confidences before launching its verify. So the width follows the current
proposal (the paper's Algorithm 1), not a lagged one. The round cost is
``draft + verify(width)``.

Whether to draft at all (``choose_sources`` under "auto"): a round that
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
measures ``α_k`` per row and kind: the draft's as above, and each point source's
per kind of offer (a copy's or stored continuation's matched ending
length; forced tokens, one kind), each offer scored against the tokens its
row committed whether it was verified or not (``observe_points``). Before a
round the planner rates it without the draft pass (each row with an offer
verifies its best one) and with it (each row takes the better of its best
offer and the draft), each at its best slot level, and drafts only when
that is faster (or a probe is due); with the draft alone the same
comparison has no offers in it. Offers are made from the previous round's
tokens, so the sources are chosen once those are known, before the draft
pass. An offer is a function of the committed
tokens and its rates are measured on finished rounds: choosing it never
looks at the round's own draws, and its slots enter Algorithm 1 with
survival ``Π_{i<=k} α_i`` up to its length (0 past it), which depends on no
token of the round. Forced tokens are accepted with probability 1 (the
verify's masks make the constrained target certain of them), so their kind
stays at 1 unless a mask is wrong. (A fixed width drafts every round, so it
proposes point masses only with ``proposals="copy"``.)
"""

from typing import NamedTuple, Sequence

import numpy as np

WIDTH_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PROPOSALS = ("auto", "draft", "copy")  # the draft and the point sources chosen per row and round, or one kind alone


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


class Settings(NamedTuple):
    """How rounds are chosen: ``width`` None (each round's width chosen from
    the measured rates and costs, drafting only when it pays) or a fixed
    width (every round drafts and verifies that many tokens);
    ``proposals`` "auto" (per row and round, the draft or a point source's
    offer), "draft" (the draft alone) or "copy" (the point sources alone);
    ``threshold``: a draft ends at its first slot of lower confidence."""

    block_size: int
    width: int | None = None
    proposals: str = "auto"
    threshold: float = 0.0

    def checked(self) -> "Settings":
        width = self.width
        if width is not None and (not isinstance(width, int) or isinstance(width, bool)):
            raise ValueError(f"verify width must be an integer or None (chosen each round), got {width!r}")
        if not 1 <= self.max_width <= self.block_size + 1:
            raise ValueError(f"verify width {self.max_width} must be in 1..{self.block_size + 1}")
        if self.proposals not in PROPOSALS:
            raise ValueError(f"proposals must be one of {', '.join(PROPOSALS)}, got {self.proposals!r}")
        return self

    @property
    def auto(self) -> bool:
        return self.width is None

    @property
    def max_width(self) -> int:
        return self.block_size + 1 if self.width is None else self.width

    @property
    def buckets(self) -> tuple:
        return width_buckets(self.block_size, self.max_width)

    @property
    def pointed(self) -> bool:
        """Whether rows may verify point sources' offers (a fixed width drafts
        every round, so it proposes point masses only with "copy")."""
        return self.max_width > 1 and (self.proposals == "copy" or (self.proposals == "auto" and self.auto))


class CostCurve(NamedTuple):
    """Seconds for one draft block and one verify of each compiled width."""

    draft: float
    verify: dict

    def round_cost(self, width: int) -> float:
        return self.draft + self.verify[width]


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
DRAFTED = 0  # the draft's kind in ``SlotRates``; the point sources' kinds follow (``Kinds``)
NOTHING = -1  # a row that verifies no point source's offer (``Plan.points``)


class Kinds(NamedTuple):
    """Where each point source's kinds sit among the ``SlotRates`` kinds:
    after the draft's, in the order of ``names``."""

    names: tuple = ()
    counts: tuple = ()

    @property
    def total(self) -> int:
        """Kinds in all: the draft's and every point source's."""
        return 1 + sum(self.counts)

    def kind(self, source: int, kind: int) -> int:
        """The ``SlotRates`` kind of kind ``kind`` (``1..counts[source]``) of point source ``source``."""
        return 1 + sum(self.counts[:source]) + kind - 1

    def joined(self, names: Sequence[str], counts: Sequence[int]) -> "Kinds":
        """These kinds and those of any source of ``names`` not among them yet."""
        new = [(name, count) for name, count in zip(names, counts) if name not in self.names]
        return Kinds(self.names + tuple(n for n, _ in new), self.counts + tuple(c for _, c in new))


class SlotRates(NamedTuple):
    """Measured acceptance of each proposal slot, per row and kind of
    proposal: the draft (kind ``DRAFTED``), then each point source's kinds
    (a copy's or a stored continuation's matched ending length: a longer
    match continues more often; a grammar's forced tokens, one kind).
    ``alpha_k`` is the rate at which slot k was accepted when slots < k
    were: an average over the first observations, then an exponential
    moving average with weight ``ACCEPTANCE_EMA``. ``predicted`` averages,
    over the same observations, the chance the proposal gave itself (the
    draft's confidence; 1 for a point mass), so ``calibrated`` can rescale
    the draft's confidences to what its slots were measured to keep. A
    row's rates are its own sequence's; the policy also keeps the batch's,
    learned from every row, which a sequence entering a row starts from
    (``Policy``). Updates return new rates; none is changed in place."""

    acceptance: np.ndarray  # [B, K, G] alpha_k
    observed: np.ndarray  # [B, K, G] observations of slot k
    predicted: np.ndarray  # [B, K, G] the mean chance the observations' proposals gave themselves

    @classmethod
    def start(cls, batch: int, kinds: int, slots: int) -> "SlotRates":
        # Untried slots count as always accepted, so the first rounds propose and measure.
        shape = (batch, kinds, slots)
        return cls(np.ones(shape), np.zeros(shape), np.ones(shape))

    def with_kinds(self, kinds: int) -> "SlotRates":
        """Room for ``kinds`` kinds (new ones untried)."""
        more = kinds - self.acceptance.shape[1]
        if more <= 0:
            return self
        batch, _, slots = self.acceptance.shape
        return SlotRates(*(np.concatenate([mine, np.full((batch, more, slots), new)], axis=1)
                           for mine, new in zip(self, (1.0, 0.0, 1.0))))

    def take(self, rows: Sequence[int], batch: int, fill: "SlotRates") -> "SlotRates":
        """Rows ``rows`` in that order, then rows of ``fill`` (one row) up to ``batch``."""
        pad = batch - len(rows)
        return SlotRates(*(np.concatenate([mine[list(rows)], np.repeat(new, pad, axis=0)])
                           for mine, new in zip(self, fill)))

    def refilled(self, rows: Sequence[int], fill: "SlotRates") -> "SlotRates":
        """Rows ``rows`` replaced by ``fill`` (one row)."""
        refilled = [mine.copy() for mine in self]
        for mine, new in zip(refilled, fill):
            mine[list(rows)] = new[0]
        return SlotRates(*refilled)

    def learned(self, outcomes: "Outcomes") -> "SlotRates":
        """Each row's rates after its round's ``outcomes`` (one observation of
        each row, kind and slot at most)."""
        if not len(outcomes.values):
            return self
        acceptance, observed, predicted = (mine.copy() for mine in self)
        place = (outcomes.rows, outcomes.kinds, outcomes.slots)
        observed[place] += 1
        weight = np.maximum(ACCEPTANCE_EMA, 1 / observed[place])
        acceptance[place] += weight * (outcomes.values - acceptance[place])
        predicted[place] += weight * (outcomes.predicted - predicted[place])
        return SlotRates(acceptance, observed, predicted)

    def learned_together(self, outcomes: "Outcomes") -> "SlotRates":
        """One row's rates (the batch's) after every row's ``outcomes``: each
        kind and slot moves by the round's mean outcome, weighted by how
        many rows showed it."""
        if not len(outcomes.values):
            return self
        count = np.zeros(self.acceptance.shape[1:])
        totals = np.zeros((2, *self.acceptance.shape[1:]))
        np.add.at(count, (outcomes.kinds, outcomes.slots), 1)
        np.add.at(totals[0], (outcomes.kinds, outcomes.slots), outcomes.values)
        np.add.at(totals[1], (outcomes.kinds, outcomes.slots), outcomes.predicted)
        seen = count > 0
        observed = self.observed + count
        weight = np.where(seen, np.maximum(ACCEPTANCE_EMA, count / np.maximum(observed[0], 1)), 0.0)
        acceptance, predicted = (mine + weight * (total / np.maximum(count, 1) - mine) * seen
                                 for mine, total in zip((self.acceptance, self.predicted), totals))
        return SlotRates(acceptance, observed, predicted)

    def expected(self, kinds: np.ndarray, slots: int, rows: np.ndarray | None = None) -> np.ndarray:
        """``[R, slots]``: the rates a plan reads for the kind ``kinds[i]`` of row
        ``rows[i]`` (default: row i). A point
        source's untried slot after a tried one counts at the rate of the
        slot before it: its offers are scored every round, so a slot stays
        untried only while the slots before it are rarely accepted (taken as
        always accepted, it would rate a poor source's long offers high).
        The draft's untried slots count as accepted, so that it is tried."""
        kinds = np.asarray(kinds, int)
        rows = np.arange(len(kinds)) if rows is None else np.asarray(rows, int)
        rates = self.acceptance[rows, kinds, :slots].copy()
        carried = (self.observed[rows, kinds, :slots] == 0) & (kinds != DRAFTED)[:, None]
        for slot in range(1, slots):
            rates[:, slot] = np.where(carried[:, slot], rates[:, slot - 1], rates[:, slot])
        return rates

    def calibrated(self, confidences: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``confidences [R, G]``, the draft's for rows ``rows``, each slot
        scaled by what that row's draft slots were measured to keep over the
        confidence they gave themselves (unchanged where unmeasured), at most 1."""
        slots = confidences.shape[1]
        measured, predicted = self.acceptance[rows, DRAFTED, :slots], self.predicted[rows, DRAFTED, :slots]
        scale = np.where(self.observed[rows, DRAFTED, :slots] > 0, measured / np.maximum(predicted, 1e-6), 1.0)
        return np.minimum(confidences * scale, 1.0)

    def gains(self, kinds: np.ndarray, slots: int, lengths: np.ndarray | None = None) -> np.ndarray:
        """``[B, slots + 1]``: expected accepted proposals of each row's kind
        when it verifies its first ``l`` slots (column l); a row has only its
        first ``lengths[r]`` proposals when given."""
        survival = np.cumprod(self.expected(kinds, slots), axis=1)
        if lengths is not None:
            survival = survival * (np.arange(slots) < np.asarray(lengths)[:, None])
        return np.concatenate([np.zeros((len(survival), 1)), np.cumsum(survival, axis=1)], axis=1)


class Outcomes(NamedTuple):
    """What a round showed of its proposals: observation i is of row
    ``rows[i]``'s slot ``slots[i]`` under kind ``kinds[i]``, accepted or
    not (or a probability standing in), ``values[i]``, proposed with the
    chance ``predicted[i]`` (the draft's confidence; 1 for a point mass)."""

    rows: np.ndarray
    kinds: np.ndarray
    slots: np.ndarray
    values: np.ndarray
    predicted: np.ndarray

    @classmethod
    def joined(cls, parts: Sequence["Outcomes"]) -> "Outcomes":
        return cls(*(np.concatenate([np.asarray(part[i], dtype) for part in parts] or [np.zeros(0, dtype)])
                     for i, dtype in enumerate((int, int, int, float, float))))


def draft_outcomes(rows: np.ndarray, accepted: np.ndarray, limits: np.ndarray, confidences: np.ndarray) -> Outcomes:
    """What rows that verified the draft showed of its slots: row r verified
    ``limits[r]`` drafts and kept ``accepted[r]``. Slot k counts for the rows
    that reached it (every earlier slot accepted): verified, it was accepted
    or not; left unverified by the plan, the draft's own confidence stands in
    for the outcome (the plan cut it because that confidence was low), so an
    unverified slot moves the calibration neither way. Each was proposed
    with the draft's ``confidences``."""
    slots = np.arange(confidences.shape[1])
    reached = rows[:, None] & (accepted[:, None] >= slots[None, :])
    outcome = np.where(limits[:, None] > slots[None, :], accepted[:, None] > slots[None, :], confidences)
    row, slot = np.nonzero(reached)
    return Outcomes(row, np.full(len(row), DRAFTED), slot, outcome[row, slot].astype(float),
                    confidences[row, slot].astype(float))


def point_outcomes(kinds: np.ndarray, proposals: list, committed: list) -> Outcomes:
    """Every row's point-mass proposal (``proposals[b]``, rated under kind
    ``kinds[b]``, 0 for none) against the tokens the row committed
    (``committed[b]``), whether the round verified it or not: slot k counts
    where the proposal's first k tokens were committed and a committed
    token stands at slot k; the outcome is whether it is the proposed one.
    Given that prefix the committed token is distributed as the target's
    (the rounds are lossless), so this is the acceptance of the proposal as
    a point mass, and every source stays measured through rounds that
    verified another."""
    observed = []
    for row in np.flatnonzero(kinds):
        for slot, (proposed, token) in enumerate(zip(proposals[row], committed[row])):
            observed.append((row, int(kinds[row]), slot, proposed == token, 1.0))
            if proposed != token:
                break
    return Outcomes(*(np.array(column) for column in zip(*observed))) if observed else Outcomes.joined([])


class Offer(NamedTuple):
    """What a point source proposes for one row: tokens, and the kind its
    acceptance is measured under (``1..kinds`` of its source; 0: no offer)."""

    tokens: list
    kind: int


class Offers(NamedTuple):
    """A round's point-mass proposals: one from each point source (S) for each row (B)."""

    kinds: np.ndarray  # [S, B] the ``SlotRates`` kind rating each (0: no offer)
    tokens: list  # [S][B] the proposed tokens

    @classmethod
    def none(cls, batch: int) -> "Offers":
        return cls(np.zeros((0, batch), int), [])

    @classmethod
    def of(cls, kinds: Kinds, offered: Sequence[Sequence[Offer]], batch: int) -> "Offers":
        """``offered[s][b]`` (source ``s`` of ``kinds.names``, row ``b``) with
        their kinds; an offer of no tokens is none."""
        rated = [[kinds.kind(s, offer.kind) if offer.kind and len(offer.tokens) else 0 for offer in source]
                 for s, source in enumerate(offered)]
        return cls(np.array(rated, int).reshape(len(offered), batch),
                   [[list(offer.tokens) for offer in source] for source in offered])

    @property
    def lengths(self) -> np.ndarray:
        """``[S, B]`` how many tokens each offer holds."""
        return np.array([[len(tokens) for tokens in source] for source in self.tokens], int).reshape(self.kinds.shape)

    def chosen(self, points: np.ndarray) -> list:
        """Each row's tokens from the source ``points[b]`` (none where ``NOTHING``)."""
        return [self.tokens[source][row] if source != NOTHING else [] for row, source in enumerate(points)]

    def take(self, rows: Sequence[int], batch: int) -> "Offers":
        """Rows ``rows`` in that order, then rows without offers up to ``batch``."""
        pad = batch - len(rows)
        kinds = np.concatenate([self.kinds[:, list(rows)], np.zeros((len(self.kinds), pad), int)], axis=1)
        return Offers(kinds, [[source[row] for row in rows] + [[]] * pad for source in self.tokens])


class PointMasses(NamedTuple):
    """Each row's best point-mass proposal at every slot level, among the point sources' offers."""

    gains: np.ndarray  # [B, slots + 1] expected accepted proposals of the best offer (0 without one)
    best: np.ndarray  # [B, slots + 1] the source whose offer is the best at that level
    available: np.ndarray  # [B] rows with at least one offer

    @classmethod
    def rated(cls, rates: SlotRates, offers: Offers, slots: int) -> "PointMasses":
        batch = offers.kinds.shape[1]
        each = [np.where((kinds > 0)[:, None], rates.gains(kinds, slots, lengths), -1.0)
                for kinds, lengths in zip(offers.kinds, offers.lengths)] or [np.full((batch, slots + 1), -1.0)]
        stacked = np.stack(each)  # [S, B, slots + 1]; -1 where a source offers nothing, so it is never the best
        return cls(np.maximum(stacked.max(axis=0), 0.0), stacked.argmax(axis=0), (offers.kinds > 0).any(axis=0))

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
    draft = rates.gains(np.full(len(active), DRAFTED), slots)
    verify = np.array([costs.verify[bucket_for(level + 1, buckets)] for level in range(slots + 1)])
    rows = int(active.sum())
    without = (rows + point.gains[active].sum(axis=0)) / verify
    drafting = (rows + np.maximum(point.gains[active], draft[active]).sum(axis=0)) / (costs.draft + verify)
    level = 1 + int(np.argmax(drafting[1:]))
    return SourceSpeeds(float(drafting[level]), float(without.max()),
                        point.split(point.gains[:, level] >= draft[:, level], level),
                        point.split(point.available, int(np.argmax(without))))


class Gate(NamedTuple):
    """The probe schedule of a batch that declines drafting: plain rounds
    since the last probe, and how many make the next probe due."""

    plain_rounds: int = 0
    interval: int = 1

    def decide(self, drafting: float, without: float) -> tuple[bool, "Gate"]:
        """Draft when that is predicted faster; otherwise probe after 1, 2,
        4, ... up to ``PROBE_LIMIT`` rounds without it."""
        if drafting > without:
            return True, Gate(self.plain_rounds, 1)
        if self.plain_rounds >= self.interval:
            return True, Gate(0, min(2 * self.interval, PROBE_LIMIT))
        return False, Gate(self.plain_rounds + 1, self.interval)


class Sources(NamedTuple):
    """What a round proposes from, chosen before its draft pass, and the
    probe schedule after choosing."""

    draft: bool  # the round runs the draft pass
    points: np.ndarray  # [B] the point source each row verifies instead of the draft (``NOTHING``: none)
    gate: Gate


def choose_sources(settings: Settings, rates: SlotRates, offers: Offers, live: np.ndarray, costs: CostCurve,
                   gate: Gate) -> Sources:
    """Whether the coming round drafts, and the point source (if any) each
    row verifies instead. Reads finished rounds and the committed tokens
    only, never the round it decides."""
    none = np.full(len(live), NOTHING)
    slots = settings.max_width - 1
    if not slots:
        return Sources(False, none, gate)
    if not settings.pointed:
        offers = Offers.none(len(live))
    if settings.proposals == "copy":
        return Sources(False, PointMasses.rated(rates, offers, slots).split(live, slots), gate)
    if not settings.auto:  # a fixed width drafts every round
        return Sources(True, none, gate)
    speeds = source_speeds(rates, offers, live, costs, settings.buckets, slots)
    drafts, gate = gate.decide(speeds.drafting, speeds.without)
    if not drafts:
        return Sources(False, np.where(live, speeds.points_without, NOTHING), gate)
    points = np.where(live, speeds.points, NOTHING)
    return Sources(bool((live & (points == NOTHING)).any()), points, gate)


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


def plan_round(settings: Settings, rates: SlotRates, costs: CostCurve | None, draft_confidences: np.ndarray | None,
               offers: Offers, points: np.ndarray, live: np.ndarray, names: tuple = ()) -> Plan:
    """The round's width and limits. ``draft_confidences [B, G]``: the
    sigmoid of the draft's confidence logits (None without a draft);
    ``points [B]``: the point source each row verifies (``NOTHING``: the
    draft, where ``live`` rows have one). A row verifying a point source's
    offer has its slots rated by that offer's kind up to its length (and 0
    past it); the threshold cuts drafts only (on the draft's own
    confidences); Algorithm 1 (``width`` None) reads the live rows, a
    drafting row's confidences calibrated to what its slots kept."""
    pointing = (points != NOTHING) & live
    points = np.where(pointing, points, NOTHING)
    drafting = live & ~pointing & (draft_confidences is not None)
    if not (drafting | pointing).any():
        return Plan(1, np.zeros(len(live), np.int32), drafting, points, None, names)
    slots = settings.max_width - 1
    confidences = np.zeros((len(live), settings.block_size)) if draft_confidences is None else draft_confidences.copy()
    limits = np.where(drafting, slots, 0)
    rows = np.flatnonzero(pointing)  # each verifies its offer, rated by its kind up to its length
    limits[rows] = np.minimum(slots, offers.lengths[points[rows], rows])
    rated = rates.expected(offers.kinds[points[rows], rows], settings.block_size, rows)
    confidences[rows] = rated * (np.arange(settings.block_size)[None, :] < limits[rows][:, None])
    if settings.threshold > 0:
        limits = np.where(drafting, np.minimum(limits, threshold_lengths(confidences, settings.threshold)), limits)
    if settings.auto:
        rows = np.flatnonzero(drafting)  # planned at what their drafts were measured to keep
        confidences[rows] = rates.calibrated(confidences[rows], rows)
        allowed = np.arange(confidences.shape[1])[None, :] < limits[:, None]
        survival = np.cumprod(confidences, axis=1) * allowed
        limits = np.minimum(limits, scheduled_length(survival[live][:, :slots], costs, settings.buckets))
    widest = int(limits[live].max())
    return Plan(bucket_for(widest + 1, settings.buckets), limits.astype(np.int32), drafting, points, confidences,
                names)
