"""Confidence-scheduled verification: Algorithm 1, the threshold cut, width buckets, the round costs learned as
rounds run, and the choices of each round (sources, width, limits) and what they learn, on their own without a
model; then the policy the cache carries, in rounds of a model.

Breaks tried, and the tests that catch them:
- the costs' fit ignoring the newest measurements (``weights`` reversed):
  test_learned_costs_follow_the_machine;
- the prior's draft pass priced from the target's bytes:
  test_the_prior_prices_a_draft_pass_below_a_plain_step;
- a round's time recorded when a kernel compiled in it (the trace check
  dropped): test_speculate_learns_costs_from_rounds_that_did_not_compile;
- a prepared draft used for a row whose anchor changed (``Ready.covers``
  true everywhere): test_a_row_given_another_anchor_verifies_nothing_prepared;
- a round evaluating only its result, not the cache it returns:
  test_a_round_leaves_its_cache_evaluated;
- the prior's fixed costs recording the rounds' times (``timed`` learning
  whatever the costs): test_seeded_samples_repeat_at_the_prior_costs_whatever_the_clock.
"""

import importlib
import io
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn.cache import device_state
from dspark_fn.costs import RoundCosts, Shape
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.policy import Policy
from dspark_fn.schedule import (
    DRAFTED,
    NOTHING,
    CostCurve,
    Gate,
    Kinds,
    Offer,
    Offers,
    Outcomes,
    Settings,
    SlotRates,
    bucket_for,
    choose_sources,
    draft_outcomes,
    plan_round,
    point_outcomes,
    scheduled_length,
    threshold_lengths,
    width_buckets,
)
from helpers import (
    build_bigram_draft,
    build_target,
    damp_attention,
    mlx_lm_greedy,
    random_prompt,
    speculative_tokens,
    target_config,
)

CONFIG = target_config("qwen3", vocab=64, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
BLOCK = 5
BUCKETS = width_buckets(BLOCK)
# widening is cheap up to 4 tokens; 6 pays only after confident drafts
COSTS = CostCurve(0.2, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 6: 1.35})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    model = damp_attention(root / "target", build_target(root / "target", CONFIG, seed=3, gain=2.0), 0.05)
    build_bigram_draft(root / "draft", CONFIG, model, [1], layers=1, taps=(0, 1), block_size=BLOCK)
    return model, dspark_fn.load(root / "target", root / "draft")


def theta(survival_row, length, costs, buckets):
    return (1 + survival_row[:length].sum()) / costs.round_cost(bucket_for(length + 1, buckets))


def test_width_buckets_cover_the_block():
    assert width_buckets(7) == (1, 2, 3, 4, 6, 8)
    assert width_buckets(3) == (1, 2, 3, 4)
    assert width_buckets(7, fixed=5) == (1, 2, 3, 4, 5, 6, 8)
    assert bucket_for(5, width_buckets(7)) == 6


def test_algorithm_1_stops_at_the_first_level_that_does_not_pay():
    """A longer proposal would score higher, but reaching it means passing a
    level that lowers Θ; the early stop (needed for losslessness) stays short."""
    buckets = (1, 2, 3, 4)
    costs = CostCurve(0.0, {1: 1.0, 2: 1.6, 3: 1.65, 4: 1.7})
    survival = np.array([[0.5, 0.45, 0.42]])
    thetas = [theta(survival[0], length, costs, buckets) for length in range(4)]
    assert thetas[1] < thetas[0] < thetas[3]  # the global optimum is 3
    assert scheduled_length(survival, costs, buckets) == 0


def test_algorithm_1_goes_on_while_theta_improves():
    buckets = (1, 2, 3, 4)
    costs = CostCurve(0.0, {1: 1.0, 2: 1.1, 3: 1.2, 4: 2.0})
    survival = np.array([[0.9, 0.8, 0.7], [0.8, 0.6, 0.5]])
    # totals over rows: levels add 1.7, 1.4, 1.2 expected tokens
    thetas = [(2 + [0, 1.7, 3.1, 4.3][k]) / costs.round_cost(k + 1) for k in range(4)]
    assert thetas[0] < thetas[1] < thetas[2] > thetas[3]
    assert scheduled_length(survival, costs, buckets) == 2


def test_threshold_cuts_at_the_first_low_confidence():
    confidences = np.array([[0.9, 0.2, 0.95], [0.1, 0.9, 0.9], [0.8, 0.8, 0.8]])
    assert threshold_lengths(confidences, 0.5).tolist() == [1, 0, 3]


def drafts(settings: Settings, confidences: np.ndarray, live: np.ndarray, costs: CostCurve | None = None,
           rates: SlotRates | None = None):
    """The plan of a round in which every live row verifies the draft."""
    rates = rates or SlotRates.start(len(live), 1, BLOCK)
    return plan_round(settings, rates, costs, confidences, Offers.none(len(live)), np.full(len(live), NOTHING), live)


def test_plan_uses_active_rows_only():
    whole = Settings(BLOCK, width=BLOCK + 1, threshold=0.5)
    confidences = np.array([[0.9, 0.9, 0.1, 0.9, 0.9], [0.9] * 5])
    plan = drafts(whole, confidences, np.array([True, False]))
    assert plan.width == 3 and plan.limits.tolist() == [2, 0]
    assert drafts(whole, confidences, np.array([True, True])).width == 6


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_admitting_a_slot_never_depends_on_later_confidences(threshold):
    """Losslessness (spec §7, Appendix A): whether row r verifies slot k may
    depend on c_{r,1..k} (functions of the drafts before slot k) and on other
    rows, never on c_{r,k+1..}, which depend on the draft at slot k."""
    rng = np.random.default_rng(0)
    auto = Settings(BLOCK, threshold=threshold)
    active = np.ones(3, bool)
    for _ in range(300):
        confidences = rng.uniform(0.3, 1.0, size=(3, BLOCK))
        limits = drafts(auto, confidences, active, COSTS).limits
        row, slot = rng.integers(3), rng.integers(1, BLOCK + 1)
        changed = confidences.copy()
        changed[row, slot:] = rng.uniform(0.0, 1.0, size=BLOCK - slot)
        changed_limits = drafts(auto, changed, active, COSTS).limits
        assert (limits[row] >= slot) == (changed_limits[row] >= slot)


SCHEDULES = {
    "auto": dict(width="auto"),
    "threshold": dict(confidence_threshold=0.86),
    "auto+threshold": dict(width="auto", confidence_threshold=0.8),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_scheduled_greedy_is_token_identical(pair, schedule):
    model, params = pair
    prompt = random_prompt(np.random.default_rng(5), 11, CONFIG["vocab_size"])
    events = list(dspark_fn.generate(params, prompt, 80, costs=COSTS, **SCHEDULES[schedule]))
    assert [t for e in events for t in e.emitted] == mlx_lm_greedy(model, prompt, 80)
    rounds = [e for e in events if e.kind == "round"]
    assert len({e.width for e in rounds}) > 1, "the schedule should vary the width here"
    assert all(len(e.drafted) < e.width for e in rounds)
    assert any(e.accepted for e in rounds)


def test_switching_widths_never_retraces(pair):
    _, params = pair
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, 256), [[1, 2, 3], [4, 5]])
    schedule = [6, 1, 3, 2, 4, 6, 2, 1, 4, 3]
    for width in BUCKETS:  # first use of every bucket compiles it
        cache, result = dspark_fn.speculate(params, cache, tokens, width=width)
        tokens = result.next_tokens
    before = dict(TRACE_COUNTS)
    for width in schedule:
        limit = np.random.default_rng(width).integers(0, width, size=2)
        cache, result = dspark_fn.speculate(params, cache, tokens, width=width, limit=mx.array(limit, mx.int32))
        tokens = result.next_tokens
        assert (np.array(result.accepted) <= limit).all()
    assert dict(TRACE_COUNTS) == before


def test_limit_caps_an_always_right_proposal(pair):
    """Proposals equal to the target's own greedy stream: each row keeps
    exactly ``limit`` of them and the output stays the greedy stream."""
    model, params = pair
    prompt, width = [3, 1, 4], BLOCK + 1
    truth = mlx_lm_greedy(model, prompt, 60)
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), prompt)
    out = tokens.tolist()
    zeros = mx.zeros((1, width - 1))
    for limit in [0, 3, 5, 1, 2, 5, 4]:
        drafts = mx.array([truth[len(out) : len(out) + width - 1]])
        proposal = dspark_fn.Proposal(tokens=drafts, confidence_logits=zeros, log_probs=zeros[..., None])
        cache, result = dspark_fn.verify(params, cache, tokens, proposal, width, limit=mx.array([limit]))
        assert result.accepted.item() == limit
        out += result.emitted[0, : result.count.item()].tolist()
        tokens = result.next_tokens
    assert out == truth[: len(out)]


# ---- the choices: whether a round drafts, which rows copy, and what it learns

GATE_COSTS = CostCurve(0.5, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 6: 1.5})
ALL = np.ones(4, bool)
KINDS = Kinds(("forced", "copy"), (1, 4))  # two point sources, in their order of preference
FORCED, COPY = 0, 1
AUTO = Settings(BLOCK)


def offered(matches=(0, 0, 0, 0), forced=(0, 0, 0, 0), tokens=(1, 2, 3, 4, 5)) -> Offers:
    """Each row's forced tokens (``forced[b]`` of them) and its copy of ``tokens`` (a match of ``matches[b]``)."""
    return Offers.of(KINDS, [[Offer(list(tokens[:count]), 1) for count in forced],
                             [Offer(list(tokens) if match else [], match) for match in matches]], len(matches))


NO_OFFERS = Offers.none(4)


def untried(rows: int = 4) -> SlotRates:
    return SlotRates.start(rows, KINDS.total, BLOCK)


def drafted_round(rates: SlotRates, accepted, limits, confidences) -> SlotRates:
    """``rates`` after a round in which every row verified the draft."""
    rows = len(accepted)
    return rates.learned(draft_outcomes(np.ones(rows, bool), np.array(accepted), np.array(limits),
                                        np.array(confidences)))


def sources(rates, offers=NO_OFFERS, live=ALL, settings=AUTO, costs=GATE_COSTS, gate=Gate()):
    return choose_sources(settings, rates, offers, live, costs, gate)


def test_the_drafts_acceptance_is_measured_per_row_and_slot():
    """Row 0 kept 2 of 3 drafts, row 1 none of 3, row 2 verified one draft
    and kept it (slot 1 unverified: its confidence 0.25 stands in)."""
    confidences = np.full((3, BLOCK), 0.5)
    confidences[2, 1] = 0.25
    rates = drafted_round(untried(3), [2, 0, 1], [3, 3, 1], confidences)
    acceptance, observed = rates.acceptance[:, DRAFTED], rates.observed[:, DRAFTED]
    assert acceptance[:, :3].tolist() == [[1, 1, 0], [0, 1, 1], [1, 0.25, 1]]
    assert observed.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert (rates.observed[:, 1:] == 0).all()  # no point source measured


def test_the_draft_is_planned_at_what_its_slots_kept():
    """A draft that gives every slot 0.9 whose first slot is kept every other
    round and whose second never is: its first slot is planned at the rate
    measured, its second at 0, a slot never reached at its own confidence;
    so Algorithm 1 verifies one draft where the raw confidences ask for more."""
    confident = np.full((4, BLOCK), 0.9)
    rates = untried()
    for round_ in range(10):
        rates = drafted_round(rates, np.full(4, round_ % 2), np.full(4, 2), confident)
    plan = plan_round(AUTO, rates, GATE_COSTS, confident, NO_OFFERS, np.full(4, NOTHING), ALL)
    assert plan.confidences[:, 0] == pytest.approx(rates.acceptance[:, DRAFTED, 0])
    assert 0.3 < rates.acceptance[0, DRAFTED, 0] < 0.7
    assert plan.confidences[:, 1].tolist() == [0.0] * 4 and plan.confidences[:, 2:].tolist() == confident[:, 2:].tolist()
    assert plan.limits.tolist() == [1] * 4
    assert plan_round(AUTO, untried(), GATE_COSTS, confident, NO_OFFERS, np.full(4, NOTHING), ALL).limits[0] > 1


def test_a_slot_the_plan_left_unverified_does_not_move_its_calibration():
    """Rows that verify one draft and keep it: their second slot is reached
    but never verified, so its own confidence stands in, and it is planned
    at that confidence, neither surer nor less sure, round after round."""
    confidences = np.tile(np.linspace(0.9, 0.5, BLOCK), (4, 1))
    rates = untried()
    for _ in range(10):
        rates = drafted_round(rates, np.ones(4, int), np.ones(4, int), confidences)
    assert (rates.observed[:, DRAFTED, :2] == 10).all()
    plan = plan_round(AUTO, rates, GATE_COSTS, confidences, NO_OFFERS, np.full(4, NOTHING), ALL)
    assert plan.confidences[:, 0].tolist() == [1.0] * 4  # kept every time: at most sure
    assert plan.confidences[:, 1:] == pytest.approx(confidences[:, 1:])


def test_drafts_that_do_not_pay_are_declined_and_probed_with_backoff():
    assert sources(untried()).draft  # untried: optimistic
    rates = drafted_round(untried(), np.zeros(4, int), np.full(4, 5), np.full((4, 5), 0.1))  # every draft rejected
    gate, decisions = Gate(), []
    for _ in range(60):
        chosen = sources(rates, gate=gate)
        decisions.append(chosen.draft)
        gate = chosen.gate
    probes = [i for i, drafted in enumerate(decisions) if drafted]
    gaps = np.diff([-1] + probes) - 1  # plain rounds before each probe
    assert gaps.tolist()[:6] == [1, 2, 4, 8, 16, 16]


def test_drafting_resumes_once_acceptance_recovers():
    rates = drafted_round(untried(), np.zeros(4, int), np.full(4, 5), np.full((4, 5), 0.1))
    assert not sources(rates).draft
    for _ in range(10):  # an easy stretch: every draft accepted
        rates = drafted_round(rates, np.full(4, 5), np.full(4, 5), np.full((4, 5), 0.9))
    assert sources(rates).draft


def test_fixed_widths_draft_every_round_and_the_threshold_cuts_drafts_only():
    every = Settings(BLOCK, width=4, threshold=0.5)
    assert not every.pointed and every.max_width == 4
    assert all(sources(untried(), offered(matches=(2, 2, 2, 2)), settings=every, costs=None).draft
               for _ in range(5))
    confidences = np.array([[0.9, 0.4, 0.9, 0.9, 0.9], [0.9] * 5, [0.9] * 5, [0.1] * 5])
    covered = np.array([True, True, False, True])  # row 2 joined after the draft: nothing to verify
    plan = plan_round(every, untried(), None, confidences, NO_OFFERS, np.full(4, NOTHING), covered)
    assert plan.width == 4 and plan.limits.tolist() == [1, 3, 0, 0]
    assert [plan.source(row) for row in range(4)] == ["draft", "draft", "", ""]
    plain = Settings(BLOCK, width=1, proposals="copy")
    nothing = sources(untried(), offered(matches=(2, 0, 1, 0)), settings=plain)
    assert not plain.pointed and not nothing.draft and (nothing.points == NOTHING).all()
    assert plan_round(plain, untried(), None, None, NO_OFFERS, nothing.points, ALL).width == 1
    copies_only = Settings(BLOCK, width=BLOCK + 1, proposals="copy", threshold=0.95)
    live = np.array([True, True, True, False])
    offers = offered(matches=(2, 0, 1, 3))
    chosen = sources(untried(), offers, live, copies_only)
    assert not chosen.draft and chosen.points.tolist() == [COPY, NOTHING, COPY, NOTHING]
    plan = plan_round(copies_only, untried(), None, None, offers, chosen.points, live)  # untried copies: rated 1
    assert plan.width == BLOCK + 1 and plan.limits.tolist() == [BLOCK, 0, BLOCK, 0]
    assert [plan._replace(names=KINDS.names).source(row) for row in range(4)] == ["copy", "", "copy", ""]


def test_copies_are_chosen_where_they_beat_the_draft():
    """Copies of a 3-token match measured always right, the draft fair: the
    rows with such a copy verify it, the rows without one take the draft;
    when every live row has one, the round runs no draft pass. A copy is
    scored against what its row committed, verified or not."""
    rates = untried()
    rates.acceptance[:, DRAFTED] = 0.6
    offers = offered(matches=(3, 0, 0, 3))
    for _ in range(3):  # plain rounds: the copies scored, not verified
        for kinds, tokens in zip(offers.kinds, offers.tokens):
            rates = rates.learned(point_outcomes(kinds, tokens, [[1, 2]] * 4))
    three = KINDS.kind(COPY, 3)
    assert rates.acceptance[0, three, :2].tolist() == [1.0, 1.0] and rates.observed[0, three, 2] == 0
    assert rates.observed[1, three].sum() == 0  # row 1 had no copy
    chosen = sources(rates, offers, costs=COSTS)
    assert chosen.draft and chosen.points.tolist() == [COPY, NOTHING, NOTHING, COPY]
    alone = sources(rates, offers, np.array([True, False, False, True]), costs=COSTS)
    assert not alone.draft and alone.points.tolist() == [COPY, NOTHING, NOTHING, COPY]


def test_forced_tokens_are_verified_where_they_beat_the_draft():
    """Forced tokens are certain: rows with some verify them (the draft
    measured at 0.6 a slot), the others take the draft, and a round in which
    every live row is forced runs no draft pass. They enter the plan with
    survival 1 up to their count (the threshold does not cut them) and are
    learned under their own kind."""
    settings = Settings(BLOCK, threshold=0.7)
    rates = untried()
    rates.acceptance[:, DRAFTED] = 0.6
    offers = offered(forced=(3, 0, 5, 0))
    chosen = sources(rates, offers, settings=settings, costs=COSTS)
    assert chosen.draft and chosen.points.tolist() == [FORCED, NOTHING, FORCED, NOTHING]
    alone = sources(rates, offers, np.array([True, False, True, False]), settings, COSTS)
    assert not alone.draft and alone.points.tolist() == [FORCED, NOTHING, FORCED, NOTHING]
    plan = plan_round(settings, rates, COSTS, np.full((4, BLOCK), 0.6), offers, chosen.points, ALL, KINDS.names)
    # the drafts are cut by the threshold; Θ over levels 0..4: 4/1.2, 6/1.25, 8/1.3, 10/1.35, 11/1.55: level 3
    assert plan.width == 4 and plan.limits.tolist() == [3, 0, 3, 0]
    assert [plan.source(row) for row in range(4)] == ["forced", "", "forced", ""]
    assert plan.confidences[0].tolist() == [1, 1, 1, 0, 0]
    committed = [[1, 2, 3, 9], [4], [1, 2, 3, 4], [4]]
    rates = rates.learned(point_outcomes(offers.kinds[FORCED], offers.tokens[FORCED], committed))
    forced = KINDS.kind(FORCED, 1)
    assert rates.observed[:, forced].sum(axis=0).tolist() == [2, 2, 2, 1, 0]  # row 2's fourth forced token counts
    assert (rates.acceptance[:, forced] == 1).all()
    never = Settings(BLOCK, width=BLOCK + 1, proposals="draft")  # the draft alone: no point masses
    assert (sources(rates, offers, settings=never, costs=None).points == NOTHING).all()


def test_the_best_offer_wins_and_ties_go_to_the_earlier_source():
    """Two point sources offering to the same rows: a row verifies the offer
    rated higher at the chosen level; rated equal, the earlier source's."""
    copies_only = Settings(BLOCK, width=BLOCK + 1, proposals="copy")
    rates = untried()
    rates.acceptance[:, KINDS.kind(COPY, 3)] = 0.9
    rates.acceptance[:, KINDS.kind(COPY, 2)] = 0.5
    chosen = sources(rates, offered(matches=(3, 3, 0, 2), forced=(2, 0, 0, 2)), settings=copies_only)
    # row 0: at the widest level the copy (5 × 0.9 survival) beats two forced tokens; row 3: forced beats 0.5s
    assert chosen.points.tolist() == [COPY, COPY, NOTHING, FORCED]
    tied = sources(untried(), offered(matches=(1, 0, 0, 0), forced=(5, 0, 0, 0)), settings=copies_only)
    assert tied.points.tolist() == [FORCED, NOTHING, NOTHING, NOTHING]  # both untried (rated 1): the earlier wins


@pytest.mark.parametrize("settings, message", [
    (dict(width=BLOCK + 2), r"verify width 7 must be in 1..6"),
    (dict(width="wide"), r"verify width must be an integer or None \(chosen each round\), got 'wide'"),
    (dict(proposals="lookup"), r"proposals must be one of auto, draft, copy, got 'lookup'"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Settings(BLOCK, **settings).checked()


def test_an_untried_slot_of_a_point_source_counts_at_the_rate_before_it():
    """A store kind whose first slot was accepted half the time and whose
    later slots were never reached is rated 0.5, 0.25, ... (not 0.5, 0.5,
    ...), so the draft (0.6 a slot) wins its rows; the draft's own untried
    slots still count as accepted."""
    flat = CostCurve(0.01, {width: 1.0 for width in BUCKETS})  # a nearly free draft pass, every width alike
    kinds = Kinds(("store",), (1,))
    kind = kinds.kind(0, 1)
    rows = np.arange(4)
    rates = SlotRates.start(4, kinds.total, BLOCK).learned(Outcomes(rows, np.full(4, kind), np.zeros(4, int),
                                                                    np.ones(4), np.ones(4)))
    rates = rates.learned(Outcomes(rows, np.full(4, kind), np.zeros(4, int), np.zeros(4), np.ones(4)))
    assert rates.expected([kind] * 4, 3)[0].tolist() == [0.5, 0.5, 0.5]
    assert rates.gains([kind] * 4, 3)[0].tolist() == [0, 0.5, 0.75, 0.875]
    rates.acceptance[:, DRAFTED] = 0.6
    rates.observed[:, DRAFTED, :2] = 1
    assert rates.expected([DRAFTED] * 4, 4)[0].tolist() == [0.6, 0.6, 0.6, 0.6]
    offers = Offers.of(kinds, [[Offer([1, 2, 3, 4, 5], 1)] * 4], 4)
    chosen = sources(rates, offers, costs=flat)
    assert chosen.draft and (chosen.points == NOTHING).all()


# ---- the round costs, learned as rounds run


def untimed(params) -> RoundCosts:
    """Nothing measured (``RoundCosts.start`` would take what this process's rounds learned)."""
    return RoundCosts(Shape.of(params))


def test_the_prior_prices_a_draft_pass_below_a_plain_step(pair):
    """Before any round ran: a verify costs more the wider it is, a batch
    more than one row, and the draft (one layer beside the target's three)
    less than a plain step."""
    costs = untimed(pair[1])
    one, four = costs.curve(1, False, BUCKETS), costs.curve(4, False, BUCKETS)
    assert [one.verify[w] for w in BUCKETS] == sorted(one.verify[w] for w in BUCKETS)
    assert one.verify[BLOCK + 1] > one.verify[1] and four.verify[1] > one.verify[1]
    assert 0 < one.draft < one.verify[1]
    fixed = RoundCosts.start(pair[1], COSTS)
    assert fixed.timed(1, False, 2, verify=9.0, draft=9.0).curve(1, False, BUCKETS) == COSTS


def timings(costs: RoundCosts, rounds: int, plain: float, token: float, draft: float, rng) -> RoundCosts:
    """``costs`` after ``rounds`` rounds at random widths on a machine where a
    verify costs ``plain + token x (width - 1)`` and a draft ``draft``, with
    5% noise."""
    for _ in range(rounds):
        width = int(rng.choice(BUCKETS))
        noise = rng.uniform(0.95, 1.05, size=2)
        costs = costs.timed(1, False, width, verify=(plain + token * (width - 1)) * noise[0], draft=draft * noise[1])
    return costs


def test_learned_costs_follow_the_machine(pair):
    """The curve fits what the rounds measured (a verify's cost line, the
    draft's mean) within the noise; when the machine gets three times
    slower per token, the curve follows within some twenty rounds."""
    rng = np.random.default_rng(0)
    costs = timings(untimed(pair[1]), 30, plain=0.05, token=0.004, draft=0.02, rng=rng)
    curve = costs.curve(1, False, BUCKETS)
    assert curve.verify[1] == pytest.approx(0.05, rel=0.1) and curve.verify[6] == pytest.approx(0.07, rel=0.1)
    assert curve.draft == pytest.approx(0.02, rel=0.1)
    busy = timings(costs, 20, plain=0.08, token=0.012, draft=0.03, rng=rng).curve(1, False, BUCKETS)
    assert busy.verify[6] == pytest.approx(0.14, rel=0.15) and busy.draft == pytest.approx(0.03, rel=0.15)
    assert costs.curve(2, False, BUCKETS) == untimed(pair[1]).curve(2, False, BUCKETS)  # per batch size


def test_each_width_is_priced_from_its_own_times(pair):
    """On a machine where widening past four tokens costs little (a verify's
    costs bend, they are no line), each width run is priced from its own
    times within their noise, not from the line through all of them; a
    width never run is priced on the line the others draw."""
    bent = {1: 0.05, 2: 0.056, 3: 0.062, 4: 0.068, 6: 0.07}
    rng = np.random.default_rng(3)
    costs = untimed(pair[1])
    for _ in range(40):
        width = int(rng.choice(BUCKETS))
        costs = costs.timed(1, False, width, verify=bent[width] * rng.uniform(0.99, 1.01))
    curve = costs.curve(1, False, BUCKETS)
    # 1% noise, and the line (up to 6% off these) counting as half a round beside a round or more of each width
    assert [curve.verify[w] for w in BUCKETS] == pytest.approx([bent[w] for w in BUCKETS], rel=0.03)
    costs = untimed(pair[1])
    for _ in range(40):
        width = int(rng.integers(1, 5))
        costs = costs.timed(1, False, width, verify=(0.05 + 0.006 * (width - 1)) * rng.uniform(0.98, 1.02))
    assert costs.curve(1, False, (1, 6)).verify[6] == pytest.approx(0.08, rel=0.05)


def test_a_cost_no_longer_measured_follows_the_rest(pair):
    """On a machine that runs just as the prior's shape says: drafts measured
    through a stretch ten times slower, then forty quiet rounds that verify
    plain steps alone. The draft pass, no longer measured, is priced near
    its quiet cost again (priced from the newest rounds, not the busy ones,
    so the planner can choose it and measure it anew)."""
    costs = untimed(pair[1])
    plain, token, draft = 0.05 * costs.shape.prior(1) / costs.shape.prior(1)[0]
    rng = np.random.default_rng(2)
    costs = timings(costs, 30, plain, token, draft, rng)
    costs = timings(costs, 30, 10 * plain, 10 * token, 10 * draft, rng)
    for _ in range(40):
        costs = costs.timed(1, False, 1, verify=plain)
    curve = costs.curve(1, False, BUCKETS)
    assert curve.verify[1] == pytest.approx(plain, rel=0.1)
    assert curve.draft == pytest.approx(draft, rel=0.5)


def test_the_width_chosen_follows_the_learned_costs(pair):
    """The same confident drafts: verified wide while widening is cheap,
    narrower once each verified token costs three times as much."""
    rng = np.random.default_rng(1)
    confidences = np.array([[0.7, 0.6, 0.5, 0.5, 0.4]])
    quiet = timings(untimed(pair[1]), 30, plain=0.05, token=0.002, draft=0.01, rng=rng)
    busy = timings(quiet, 30, plain=0.06, token=0.02, draft=0.012, rng=rng)
    widths = [drafts(AUTO, confidences, np.ones(1, bool), costs.curve(1, False, BUCKETS)).width
              for costs in (quiet, busy)]
    assert widths[0] > widths[1] > 1


def a_clock(rng: np.random.Generator):
    """A stand-in for ``time.perf_counter`` whose every reading advances by a
    random stretch from ``rng``: rounds timed by it cost whatever it says."""
    now = [0.0]

    def perf_counter() -> float:
        now[0] += float(rng.exponential(0.05))
        return now[0]

    return SimpleNamespace(perf_counter=perf_counter)


def sampled_run(params, monkeypatch, clock_seed: int, costs) -> tuple:
    """``(tokens, widths)`` of a seeded sampled run under width "auto" whose rounds read ``a_clock(clock_seed)``."""
    monkeypatch.setattr(importlib.import_module("dspark_fn.policy"), "time", a_clock(np.random.default_rng(clock_seed)))
    events = list(dspark_fn.generate(params, [4, 9, 2, 6], 40, sampling=dspark_fn.Sampling(1.0, top_k=8), seed=5,
                                     costs=costs))
    return [t for e in events for t in e.emitted], [e.width for e in events]


def test_seeded_samples_repeat_at_the_prior_costs_whatever_the_clock(pair, monkeypatch):
    """With ``costs="prior"`` a seeded sampled run takes the same decisions,
    and so draws the same tokens, under any clock; with learned costs the
    clock moves the widths (so the clock does reach the decisions here)."""
    _, params = pair
    sampled_run(params, monkeypatch, 0, "prior")  # every kernel compiled: a round that compiles is not timed
    at_prior = [sampled_run(params, monkeypatch, clock, "prior") for clock in (1, 2, 3)]
    assert at_prior[0] == at_prior[1] == at_prior[2]
    learned = [sampled_run(params, monkeypatch, clock, None)[1] for clock in (1, 2, 3)]
    assert len({tuple(widths) for widths in learned}) > 1
    with pytest.raises(ValueError, match="'prior'"):
        dspark_fn.Decoder(params, 1, costs="learned")


def readme_loop(params, prompt, rounds, capacity=256, **options):
    """The README's loop: ``(tokens, the cache after it)``."""
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, capacity), prompt)
    out = tokens.tolist()
    for _ in range(rounds):
        cache, step = dspark_fn.speculate(params, cache, tokens, **options)
        out += step.emitted[0, : step.count.item()].tolist()
        tokens = step.next_tokens
    return out, cache


def test_the_readme_loop_chooses_widths_and_equals_the_target(pair):
    """``speculate(params, cache, tokens)`` alone: its policy chooses the
    width and source of each round (several widths and sources here, at
    costs where widening past four tokens pays only after confident drafts),
    and the tokens are the target's greedy ones."""
    model, params = pair
    prompt = [3, 1, 4, 1, 5]
    chosen = []
    cache = dspark_fn.init_cache(params, 1, 256)._replace(policy=Policy.start(params, 1, COSTS))
    cache, tokens = dspark_fn.prefill(params, cache, prompt)
    out = tokens.tolist()
    for _ in range(40):
        cache, step = dspark_fn.speculate(params, cache, tokens)
        out += step.emitted[0, : step.count.item()].tolist()
        tokens = step.next_tokens
        chosen.append((step.emitted.shape[1], step.sources[0]))
    assert out == mlx_lm_greedy(model, prompt, len(out))
    assert len({width for width, _ in chosen}) > 1 and {"draft", "copy"} <= {source for _, source in chosen}
    assert cache.policy.rates.observed[0, DRAFTED, 0] > 0


def test_speculate_learns_costs_from_rounds_that_did_not_compile(pair):
    """Every round that compiled nothing adds its verify's time (and its
    draft's, when it drafted); a width seen first compiles and is not timed.
    A new cache's policy starts from what the last one learned."""
    _, params = pair
    prompt = [2, 7, 1, 8]
    fresh = dspark_fn.init_cache(params, 1, 768)._replace(policy=Policy.start(params, 1)._replace(
        costs=untimed(params)))
    cache, tokens = dspark_fn.prefill(params, fresh, prompt)
    traced = sum(TRACE_COUNTS.values())
    cache, step = dspark_fn.speculate(params, cache, tokens, width=3)  # a capacity no other test runs: it compiles
    assert sum(TRACE_COUNTS.values()) > traced and cache.policy.costs.verifies == {}
    for _ in range(12):
        cache, step = dspark_fn.speculate(params, cache, step.next_tokens, width=3)
    verifies = cache.policy.costs.verifies[(1, False)]
    assert len(verifies) == 12 and {extra for extra, _, _ in verifies} == {2}
    assert all(seconds > 0 for _, seconds, _ in verifies) and len(cache.policy.costs.drafts[(1, False)]) >= 12
    assert Policy.start(params, 1).costs == cache.policy.costs


def pending_operations(arrays) -> int:
    """How many operations the arrays of a pytree still wait on (0: all evaluated)."""
    graph = io.StringIO()
    mx.export_to_dot(graph, *[value for _, value in tree_flatten(arrays) if isinstance(value, mx.array)])
    return graph.getvalue().count("shape=rectangle")


def test_a_round_leaves_its_cache_evaluated(pair):
    """A round returns its cache computed, the draft's context and the
    history included: work left pending would run inside the next draft
    pass and be priced as drafting."""
    _, params = pair
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), [4, 2, 4])
    for width in (BLOCK + 1, 1, BLOCK + 1):
        cache, step = dspark_fn.speculate(params, cache, tokens, width=width)
        assert pending_operations(device_state(cache)) == 0
        tokens = step.next_tokens


def test_a_row_given_another_anchor_verifies_nothing_prepared(pair):
    """The policy prepares each row's next proposals for the anchor and
    length the round left: handed another anchor, that row verifies nothing
    proposed (a plain step) while the other row verifies its draft."""
    model, params = pair
    prompts = [[5, 6, 7], [8, 9]]
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, 256), prompts)
    cache, step = dspark_fn.speculate(params, cache, tokens, width=BLOCK + 1)
    anchors = step.next_tokens.tolist()
    other = mx.array([(anchors[0] + 1) % CONFIG["vocab_size"], anchors[1]], mx.int32)
    cache, step = dspark_fn.speculate(params, cache, other, width=BLOCK + 1)
    assert step.sources == ("", "draft") and step.limits.tolist() == [0, BLOCK]


def test_the_policy_moves_with_its_rows(pair):
    """``take_rows`` moves each row's rates and prepared proposals with it;
    a new row, and a sequence entering a row, start at the batch's rates."""
    _, params = pair
    policy = Policy.start(params, 3).learned(Outcomes(np.arange(3), np.zeros(3, int), np.zeros(3, int), np.zeros(3),
                                                         np.ones(3)))
    acceptance = policy.rates.acceptance.copy()
    acceptance[:, DRAFTED, 0] = [0.1, 0.2, 0.3]
    policy = policy._replace(rates=policy.rates._replace(acceptance=acceptance))
    assert policy.pooled.acceptance[0, DRAFTED, 0] == 0.0 and policy.pooled.observed[0, DRAFTED, 0] == 3
    moved = policy.take([2, 0], 4)
    assert moved.rates.acceptance[:, DRAFTED, 0].tolist() == [0.3, 0.1, 0.0, 0.0]
    assert moved.batch == 4 and moved.costs is policy.costs
    assert moved.entered([0]).rates.acceptance[:, DRAFTED, 0].tolist() == [0.0, 0.1, 0.0, 0.0]


def test_a_draft_prepared_under_other_sampling_settings_is_drafted_again(pair, monkeypatch):
    """The policy prepares the next draft under the round's sampling
    settings; a round under another sampling mode drafts again, and a row
    whose temperature changed verifies nothing proposed that round: no row
    verifies a draft whose distribution is not the one it samples from."""
    _, params = pair
    policy_module = importlib.import_module("dspark_fn.policy")
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, 256), [[5, 6, 7], [8, 9]])
    cache, step = dspark_fn.speculate(params, cache, tokens, width=BLOCK + 1)
    drafts = []
    real = policy_module.propose
    monkeypatch.setattr(policy_module, "propose", lambda *a, **k: drafts.append(1) or real(*a, **k))
    sampled = [dspark_fn.Sampling(1.0), dspark_fn.Sampling(0.5)]
    cache, step = dspark_fn.speculate(params, cache, step.next_tokens, width=BLOCK + 1, sampling=sampled)
    assert len(drafts) == 2  # drafted again under the sampled settings, then the next round's ahead
    cache, step = dspark_fn.speculate(params, cache, step.next_tokens, width=BLOCK + 1,
                                      sampling=[sampled[0], dspark_fn.Sampling(0.7)])
    assert len(drafts) == 3 and step.sources == ("draft", "")  # row 1's temperature changed: nothing proposed
