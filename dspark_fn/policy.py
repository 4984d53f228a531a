"""The round's policy as state the cache carries, and the round that reads it:
``speculate(params, cache, tokens)``.

What a round verifies (its width, and for each row the draft, a point
source's offer or nothing) is chosen from ``Cache.policy``, a ``Policy``
record of host data, which ``speculate`` returns updated with the cache:

- ``rates``: each row's measured acceptance by source, kind and slot
  (``schedule.SlotRates``), and ``pooled``, the batch's, learned from
  every row, which a sequence entering a row starts from (so a sequence's
  rounds do not depend on the row it sits in);
- ``costs``: the round costs learned from the rounds' own times
  (``costs.RoundCosts``): a round's time but its draft passes prices its
  verify width (the host's own work each round included: a round pays
  it whatever its width), a draft pass's time prices drafting;
- ``gate``: the probe schedule of a batch that declines drafting;
- ``ready``: the next round's proposals, prepared as soon as the round
  before was known: the copy offers matched in the cache's history
  (``copying.py``), the point sources' offers, the choice of sources
  (``schedule.choose_sources``) and, when that choice drafts, the draft pass
  with its confidences on the host. Each row's preparation holds only for
  the anchor and length it was made at: a row whose anchor or length
  differs (a new prompt placed in it, a cache handed in from elsewhere)
  verifies nothing proposed that round, and a round none of whose rows is
  prepared prepares them first.

So a loop of one's own over ``speculate`` gets what ``driver.Decoder``
gets: the Decoder is batching and admission over this same step. One
round, in order: the plan (``schedule.plan_round``: Algorithm 1 over the
draft's confidences and the offers' rates, at the learned costs), the
verify, one evaluation (with the next round's copy offers), what the round
showed learned into the rates, and the next round prepared (a second
evaluation when it drafts). The round's and the draft's times refine the
costs; a round in which a kernel compiled is not timed. Every choice reads
finished rounds, committed tokens and the current draft's confidences
(Algorithm 1's early stop), never the round's own draws, so greedy output
is the target's and sampled output is distributed as the target's
whatever the policy chooses. Seeded samples repeat where the choices do: a
fixed width, or fixed costs (``Policy.start(costs=...)``: a ``CostCurve``,
or ``"prior"`` for the pair's shape prior, the same on every machine);
learned costs follow the machine's timing, so a choice near a tie can go
either way from one run to the next.

A record is never changed in place: a cache handed to ``speculate`` twice
runs the same round twice.
"""

import time
from typing import Callable, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from .buffers import check_free_slots
from .cache import Cache, device_state
from .copying import LONGEST_MATCH, copy_offers, endings
from .costs import RoundCosts
from .kernel import compilations
from .rounds import no_proposal, propose, undrafted, verify
from .sampling import GREEDY, Mode, batch_sampling
from .schedule import (NOTHING, CostCurve, Gate, Kinds, Offer, Offers, Outcomes, Plan, Settings, SlotRates, bucket_for,
                       choose_sources, draft_outcomes, plan_round, point_outcomes)
from .sharding import agree
from .sources import NO_OFFER, PointSource
from .types import Copies, Params, Proposal, Round

COPY = ("copy", LONGEST_MATCH)  # the built-in point source and its kinds (the matched ending's length)


class RowSettings(NamedTuple):
    """A batch's sampling settings on the host: a draft is drawn under them."""

    mode: Mode
    settings: np.ndarray  # [B, 3] each row's temperature, top-k and top-p

    @classmethod
    def of(cls, sampling, batch: int) -> "RowSettings":
        rows, mode = batch_sampling(sampling, batch)
        return cls(mode, np.stack([np.array(a, np.float64) for a in rows], axis=1))


class Ready(NamedTuple):
    """The next round's proposals, prepared once the round before was known."""

    settings: Settings  # the settings they were chosen under
    sources: tuple  # the point sources' names they were offered by
    sampling: RowSettings  # the sampling settings the draft was drawn under
    anchors: np.ndarray  # [B] the anchors they follow
    lengths: np.ndarray  # [B] the committed lengths they follow
    draft: Proposal | None  # the draft pass, when the sources chosen draft
    confidences: np.ndarray | None  # [B, G] the sigmoid of its confidence logits
    offers: Offers  # every point source's offers, in ``Policy.kinds`` order
    points: np.ndarray  # [B] the point source each row verifies (``NOTHING``: the draft, or nothing)

    def covers(self, anchors: np.ndarray, lengths: np.ndarray, sampling: RowSettings) -> np.ndarray:
        """``[B]``: rows whose anchor, length and sampling settings are those
        prepared for (none when the batch's sampling mode changed: the
        draft's distributions have another form)."""
        if sampling.mode != self.sampling.mode:
            return np.zeros(len(anchors), bool)
        same = (self.sampling.settings == sampling.settings).all(axis=1)
        return (self.anchors == anchors) & (self.lengths == lengths) & same

    def take(self, rows: Sequence[int], batch: int) -> "Ready":
        """Rows ``rows`` in that order, then rows prepared for nothing up to ``batch``."""
        pad, rows = batch - len(rows), list(rows)

        def taken(array: np.ndarray, fill) -> np.ndarray:
            return np.concatenate([array[rows], np.full((pad, *array.shape[1:]), fill, array.dtype)])

        draft = None if self.draft is None else Proposal(*(
            mx.concatenate([a[mx.array(rows, mx.int32)], mx.zeros((pad, *a.shape[1:]), a.dtype)]) if rows
            else mx.zeros((pad, *a.shape[1:]), a.dtype) for a in self.draft))
        sampling = self.sampling._replace(settings=taken(self.sampling.settings, -1.0))
        return Ready(self.settings, self.sources, sampling, taken(self.anchors, -1), taken(self.lengths, -1), draft,
                     None if self.confidences is None else taken(self.confidences, 0.0),
                     self.offers.take(rows, batch), taken(self.points, NOTHING))


class Policy(NamedTuple):
    """What the coming rounds verify is chosen from (see the module's docstring)."""

    kinds: Kinds  # the point sources rated so far and their kinds' place among the rates
    rates: SlotRates  # [B, kinds, G] each row's
    pooled: SlotRates  # [1, kinds, G] the batch's, from every row's rounds
    gate: Gate
    costs: RoundCosts
    ready: Ready | None = None

    @classmethod
    def start(cls, params: Params, batch: int, costs: CostCurve | str | None = None) -> "Policy":
        """A batch of ``batch`` rows with nothing measured (``costs``: fixed
        round costs in place of the learned ones, a ``CostCurve`` or
        ``"prior"``: ``costs.RoundCosts.start``)."""
        kinds = Kinds((COPY[0],), (COPY[1],))
        return cls(kinds, SlotRates.start(batch, kinds.total, params.spec.block_size),
                   SlotRates.start(1, kinds.total, params.spec.block_size), Gate(), RoundCosts.start(params, costs))

    @property
    def batch(self) -> int:
        return self.rates.acceptance.shape[0]

    def take(self, rows: Sequence[int], batch: int) -> "Policy":
        """The policy of a batch holding rows ``rows`` of this one, in that
        order, then new rows (at the batch's rates) up to ``batch``."""
        return self._replace(rates=self.rates.take(rows, batch, self.pooled),
                             ready=None if self.ready is None else self.ready.take(rows, batch))

    def entered(self, rows: Sequence[int]) -> "Policy":
        """New sequences in rows ``rows``: they start at the batch's rates."""
        return self._replace(rates=self.rates.refilled(rows, self.pooled))

    def forgetting(self) -> "Policy":
        """Nothing measured of the proposals, the learned costs kept."""
        return self._replace(rates=SlotRates.start(*self.rates.acceptance.shape),
                             pooled=SlotRates.start(*self.pooled.acceptance.shape), gate=Gate(), ready=None)

    def with_sources(self, sources: Sequence[PointSource]) -> "Policy":
        """Rates for every kind of ``sources`` too."""
        kinds = self.kinds.joined([s.name for s in sources], [s.kinds for s in sources])
        return self._replace(kinds=kinds, rates=self.rates.with_kinds(kinds.total),
                             pooled=self.pooled.with_kinds(kinds.total))

    def learned(self, outcomes: Outcomes) -> "Policy":
        """After a round's outcomes, in each row's rates and the batch's."""
        return self._replace(rates=self.rates.learned(outcomes), pooled=self.pooled.learned_together(outcomes))


def speculate(params: Params, cache: Cache, tokens: mx.array, *, width: int | None = None, sampling=GREEDY,
              limit: mx.array | None = None, active: mx.array | None = None,
              masks: Callable | None = None, draft_masks=None, sources: Sequence[PointSource] = (),
              proposals: str = "auto", threshold: float = 0.0,
              top_log_probs: int | None = None) -> tuple[Cache, Round]:
    """One DSpark round from the anchors ``tokens [B]``: choose, verify,
    accept, commit, learn, prepare the next; returns ``(cache, Round)``, the
    cache carrying the updated policy. ``Round.next_tokens`` are the next
    anchors; the round is evaluated (its arrays are on the host's reach).

    By default the cache's policy chooses everything (``Policy``): whether
    the round drafts, each row's proposal (the draft, a copy of its own
    context, or an offer of ``sources``), how many of it to verify, and the
    width. Overrides: ``width`` (an int: every round drafts and verifies
    that many tokens, anchor included), ``proposals`` ("draft": no point
    sources; "copy": point sources only), ``threshold`` (a draft ends at its
    first slot of lower confidence), ``limit [B]`` (caps a row's proposals),
    ``active [B]`` (False: the row commits nothing, a recurrent state
    included, and keeps its anchor). ``sampling`` is one ``Sampling`` for
    every row or one per row. ``top_log_probs`` (K) scores the emitted
    tokens (``Round.scores``).

    Constrained rows: ``draft_masks`` (bits ``[B, G, ceil(V/32)]``) constrain
    the draft's slots; ``masks(proposed, limits=)`` maps each row's proposed
    tokens ``[B, width - 1]`` (and the proposals each may keep) to the bits
    of every verified position (``rounds.verify``), e.g.
    ``functools.partial(constraints.verify_masks, matchers, vocab_size=V)``.
    Masks depend on the round's commits, so with ``draft_masks`` nothing is
    prepared ahead: each round drafts after the last one's commits.

    A fixed ``width`` needs that many free slots in every active row, and
    the chosen width never exceeds a row's free slots: a ``ValueError``
    before anything runs when a row has none (``grow_cache`` makes room).
    """
    start, compiled_before = time.perf_counter(), compilations()
    settings = Settings(params.spec.block_size, width, proposals, threshold).checked()
    batch = tokens.shape[0]
    row_settings = RowSettings.of(sampling, batch)
    sampled = row_settings.mode.sampled
    policy = cache.policy if cache.policy is not None and cache.policy.batch == batch else Policy.start(params, batch)
    policy = policy.with_sources(sources)
    live = np.ones(batch, bool) if active is None else np.array(active, bool)
    lengths, anchors = np.array(cache.length), np.array(tokens)
    widest = widest_room(settings, cache, lengths, live)
    costs = policy.costs.curve(batch, sampled, settings.buckets)
    ahead = draft_masks is None
    ready = policy.ready if ahead and prepared_for(policy.ready, settings, sources) else None
    covered = live & (ready.covers(anchors, lengths, row_settings) if ready is not None else False)
    drafts = []  # the seconds of each draft pass the round runs
    if not covered.any():
        ready, gate, seconds = prepare(params, cache, tokens, policy, settings, sources, live, sampling, draft_masks,
                                       costs, row_settings)
        policy, covered, drafts = policy._replace(gate=gate), live, drafts + [seconds] * (seconds is not None)
    plan = plan_round(settings, policy.rates, costs, ready.confidences if ready.draft is not None else None,
                      ready.offers, ready.points, covered, policy.kinds.names)
    plan = capped(plan, widest, settings, limit)
    cache, result, next_copies = verified(params, cache, tokens, plan, ready, live, sampling, masks, settings, sources,
                                          top_log_probs)
    policy = policy.learned(round_outcomes(plan, result, ready, covered))._replace(ready=None)
    if ahead:
        ready, gate, seconds = prepare(params, cache, result.next_tokens, policy, settings, sources, live, sampling,
                                       None, costs, row_settings, next_copies,
                                       known=(np.array(result.next_tokens), np.array(cache.length)))
        policy, drafts = policy._replace(ready=ready, gate=gate), drafts + [seconds] * (seconds is not None)
    round_seconds = time.perf_counter() - start - sum(drafts)  # the round but its draft passes
    timed = compilations() == compiled_before  # a round that compiled a kernel says nothing of its costs
    policy = policy._replace(costs=learned_costs(policy.costs, batch, sampled, plan.width,
                                                 round_seconds if timed else None,
                                                 drafts[-1] if timed and drafts else None))
    sources_used = tuple(plan.source(row) for row in range(batch))
    return cache._replace(policy=policy), result._replace(limits=plan.limits, sources=sources_used)


def round_outcomes(plan: Plan, result: Round, ready: Ready, covered: np.ndarray) -> Outcomes:
    """What the round showed of its proposals: the draft's slots in the rows
    that verified it, and every offer made for a row it covered (an offer
    made for another anchor says nothing) against what the row committed."""
    counts, emitted = np.array(result.count), np.array(result.emitted)
    committed = [row[:count].tolist() for row, count in zip(emitted, counts)]
    outcomes = [draft_outcomes(plan.drafting, np.array(result.accepted), plan.limits, ready.confidences)] \
        if plan.drafting.any() else []
    kinds = np.where(covered, ready.offers.kinds, 0)
    return Outcomes.joined(outcomes + [point_outcomes(k, tokens, committed)
                                       for k, tokens in zip(kinds, ready.offers.tokens)])


def widest_room(settings: Settings, cache: Cache, lengths: np.ndarray, live: np.ndarray) -> int:
    """The widest verify every live row has room for; a row without room for
    a fixed width, or for any, is a ``ValueError`` naming the fix."""
    check_free_slots(cache.capacity, np.where(live, lengths, 0), 1 if settings.auto else settings.max_width)
    return min([settings.max_width] + (cache.capacity - lengths[live]).tolist())


def capped(plan: Plan, widest: int, settings: Settings, limit: mx.array | None) -> Plan:
    """``plan`` within each row's ``limit`` and, when the width is chosen,
    the room (a bucket no wider than ``widest``); a fixed width stays."""
    limits = plan.limits if limit is None else np.minimum(plan.limits, np.array(limit)).astype(np.int32)
    if not settings.auto:
        return plan._replace(limits=limits)
    room = max(b for b in settings.buckets if b <= widest)
    limits = np.minimum(limits, room - 1).astype(np.int32)
    return plan._replace(limits=limits, width=min(plan.width, bucket_for(int(limits.max()) + 1, settings.buckets)))


def point_tokens(proposals: list, slots: int) -> np.ndarray:
    """``[B, slots]``: each row's point-mass proposal (a list of tokens), zero-padded."""
    tokens = np.zeros((len(proposals), slots), np.int32)
    for row, proposal in enumerate(proposals):
        tokens[row, : min(slots, len(proposal))] = proposal[:slots]
    return tokens


def verified(params: Params, cache: Cache, tokens: mx.array, plan: Plan, ready: "Ready", live: np.ndarray, sampling,
             masks: Callable | None, settings: Settings, sources: Sequence[PointSource], top_log_probs: int | None):
    """Launch the planned verify and the next round's copy offers, evaluate
    both and the whole cache (work left pending, such as the draft's
    context, would run inside the next draft pass and be timed as drafting):
    ``(cache, round, copy offers and endings for the next round)``."""
    width, batch = plan.width, tokens.shape[0]
    if width == 1:
        proposal = no_proposal(batch)
    elif ready.draft is not None and plan.drafting.any():
        proposal = ready.draft
    else:
        proposal = undrafted(params, batch, batch_sampling(sampling, batch).mode)
    pointing = plan.points != NOTHING
    proposed = point_tokens(ready.offers.chosen(plan.points), width - 1)
    points = Copies(mx.array(proposed), mx.array(pointing)) if pointing.any() else None
    verified_masks = None
    if masks is not None:
        if plan.drafting.any() and width > 1:  # the draft's tokens, already on the host once planned
            proposed = np.where(pointing[:, None], proposed, np.array(proposal.tokens[:, : width - 1]))
        verified_masks = masks(proposed, limits=plan.limits)
    cache, result = verify(params, cache, tokens, proposal, width, sampling=sampling, limit=mx.array(plan.limits),
                           active=mx.array(live), copies=points, top_log_probs=top_log_probs, check_room=False,
                           masks=verified_masks)
    following = next_offers(cache, result.next_tokens, settings, sources)
    mx.eval(result, device_state(cache), following)
    return cache, result, following


def next_offers(cache: Cache, anchors: mx.array, settings: Settings, sources: Sequence[PointSource]):
    """The copy offers and the endings the point sources read, after ``anchors`` (launched, not evaluated)."""
    if not settings.pointed:
        return None
    reach = max([source.reach for source in sources] + [1])
    return (copy_offers(cache.history, cache.length, anchors, settings.max_width - 1),
            endings(cache.history, cache.length, anchors, reach))


def prepare(params: Params, cache: Cache, anchors: mx.array, policy: Policy, settings: Settings,
            sources: Sequence[PointSource], live: np.ndarray, sampling, draft_masks, costs: CostCurve,
            row_settings: RowSettings, following=None, known=None) -> tuple[Ready, Gate, float | None]:
    """The round's proposals from ``anchors`` (``Ready``), the probe schedule
    after choosing, and the seconds the draft pass took (None: no draft).
    ``following``: the copy offers and endings, when launched already;
    ``known``: the anchors and lengths on the host, when read."""
    if following is None:
        following = next_offers(cache, anchors, settings, sources)
    batch = len(live)
    offers = Offers.none(batch)
    if following is not None:
        copies, tails = following
        offered = {COPY[0]: copied(np.array(copies.tokens), np.array(copies.match))}
        lengths = np.array(cache.length)
        endings_ = [row[max(0, len(row) - int(length) - 1):].tolist() for row, length in zip(np.array(tails), lengths)]
        for source in sources:
            offered[source.name] = source.offers([ending[len(ending) - source.reach:] for ending in endings_],
                                                  settings.max_width - 1)
        offers = Offers.of(policy.kinds, [offered.get(name, [NO_OFFER] * batch) for name in policy.kinds.names], batch)
    chosen = choose_sources(settings, policy.rates, offers, live, costs, policy.gate)
    draft = confidences = seconds = None
    if chosen.draft:
        start = time.perf_counter()
        draft = propose(params, cache, anchors, sampling, draft_masks)
        confidences = sigmoid(np.array(draft.confidence_logits.astype(mx.float32)))
        seconds = time.perf_counter() - start
    anchors_, lengths_ = known if known is not None else (np.array(anchors), np.array(cache.length))
    ready = Ready(settings, tuple(source.name for source in sources), row_settings, anchors_, lengths_, draft,
                  confidences, offers, chosen.points)
    return ready, chosen.gate, seconds


def prepared_for(ready: Ready | None, settings: Settings, sources: Sequence[PointSource]) -> bool:
    """Whether ``ready`` was prepared under these settings and sources."""
    return ready is not None and ready.settings == settings and ready.sources == tuple(s.name for s in sources)


def copied(tokens: np.ndarray, match: np.ndarray) -> list:
    """The copy offers as ``Offer``s (rated by the matched ending's length)."""
    return [Offer(row.tolist(), int(m)) if m else NO_OFFER for row, m in zip(tokens, match)]


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * logits))  # without overflow


def learned_costs(costs: RoundCosts, batch: int, sampled: bool, width: int, verify_seconds: float | None,
                  draft_seconds: float | None) -> RoundCosts:
    """``costs`` with the round's times (over several ranks, rank 0's: every
    rank must take the same decisions, or they would run different kernels)."""
    if mx.distributed.init().size() > 1:
        shared = agree([-1.0 if s is None else s for s in (verify_seconds, draft_seconds)]).tolist()
        verify_seconds, draft_seconds = (None if s < 0 else s for s in shared)
    return costs.timed(batch, sampled, width, verify=verify_seconds, draft=draft_seconds).remembered()
