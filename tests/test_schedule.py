"""Confidence-scheduled verification: Algorithm 1, the threshold cut, cost curves, width buckets, and the
planner that decides each round (sources, width, limits) and learns from it, on its own without a model."""

import importlib
import json

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.costs import cached_costs, monotone
from dspark_fn.schedule import (
    DRAFTED,
    NOTHING,
    Choice,
    CostCurve,
    Offer,
    Offers,
    Plan,
    Planner,
    bucket_for,
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

costs_module = importlib.import_module("dspark_fn.costs")

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


def drafts(planner: Planner, confidences: np.ndarray, live: np.ndarray) -> Plan:
    """The plan of a round in which every live row verifies the draft."""
    none = np.zeros(len(live), bool)
    return planner.plan(confidences, Offers.none(len(live)), Choice(True, np.full(len(live), NOTHING)), live, none)


def test_plan_uses_active_rows_only():
    planner = Planner(BLOCK, width=None, threshold=0.5)
    confidences = np.array([[0.9, 0.9, 0.1, 0.9, 0.9], [0.9] * 5])
    plan = drafts(planner, confidences, np.array([True, False]))
    assert plan.width == 3 and plan.limits.tolist() == [2, 0]
    assert drafts(planner, confidences, np.array([True, True])).width == 6


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_admitting_a_slot_never_depends_on_later_confidences(threshold):
    """Losslessness (spec §7, Appendix A): whether row r verifies slot k may
    depend on c_{r,1..k} (functions of the drafts before slot k) and on other
    rows, never on c_{r,k+1..}, which depend on the draft at slot k."""
    rng = np.random.default_rng(0)
    planner = Planner(BLOCK, width="auto", threshold=threshold, costs=COSTS)
    active = np.ones(3, bool)
    for _ in range(300):
        confidences = rng.uniform(0.3, 1.0, size=(3, BLOCK))
        limits = drafts(planner, confidences, active).limits
        row, slot = rng.integers(3), rng.integers(1, BLOCK + 1)
        changed = confidences.copy()
        changed[row, slot:] = rng.uniform(0.0, 1.0, size=BLOCK - slot)
        changed_limits = drafts(planner, changed, active).limits
        assert (limits[row] >= slot) == (changed_limits[row] >= slot)


def test_costs_are_measured_once_and_cached(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return CostCurve(0.1, {1: 0.5, 2: 0.7})

    path = tmp_path / "costs.json"
    first = cached_costs("model|device|batch 1", measure, path)
    again = cached_costs("model|device|batch 1", measure, path)
    other = cached_costs("model|device|batch 2", measure, path)
    assert first == again == other and len(calls) == 2
    assert set(json.loads(path.read_text())) == {"model|device|batch 1", "model|device|batch 2"}


@pytest.mark.parametrize("text", ["{\"model|device|batch 1\": {\"draft\": 0.1", "[1, 2]", "not json"])
def test_an_unreadable_cost_cache_is_measured_again_and_replaced(tmp_path, capsys, text):
    path = tmp_path / "costs.json"
    path.write_text(text)
    curve = cached_costs("model|device|batch 1", lambda: CostCurve(0.1, {1: 0.5, 2: 0.7}), path)
    assert curve == CostCurve(0.1, {1: 0.5, 2: 0.7})
    assert CostCurve.from_json(json.loads(path.read_text())["model|device|batch 1"]) == curve
    assert f"the cost cache {path} is unreadable" in capsys.readouterr().err


def test_auto_measures_on_first_use_then_reuses(pair, tmp_path, monkeypatch):
    _, params = pair
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    measured = []
    real = costs_module.measure_costs

    def counting(*args, **kwargs):
        measured.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(costs_module, "measure_costs", counting)
    key = costs_module.cost_key(costs_module.model_signature(params), 1, costs_module.COST_CAPACITY,
                                dspark_fn.sampling.batch_sampling(dspark_fn.sampling.GREEDY, 1)[1])
    timed_otherwise = key.removesuffix("|" + costs_module.COST_METHOD)  # a curve an earlier method timed
    (tmp_path / "verify_costs.json").write_text(json.dumps({timed_otherwise: CostCurve(9.0, {1: 0.1}).to_json()}))
    prompt = [3, 4, 5]
    runs = [speculative_tokens(params, prompt, 12, width="auto") for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(measured) == 1
    stored = json.loads((tmp_path / "verify_costs.json").read_text())
    curve = stored[key]
    assert sorted(int(w) for w in curve["verify"]) == list(BUCKETS)
    seconds = [curve["verify"][str(w)] for w in BUCKETS]
    assert seconds == sorted(seconds)


def test_costs_are_timed_on_a_cache_handed_from_round_to_round(pair, monkeypatch):
    """Each timed verify gets the cache the previous one returned (its only
    reference, as in the driver's rounds, so MLX updates it in place), not
    one cache held for every call (which each call would copy whole)."""
    _, params = pair
    handed, returned = [], []
    real = costs_module.verify

    def watching(params, cache, *args, **kwargs):
        handed.append(cache.target[0][0])
        updated, result = real(params, cache, *args, **kwargs)
        returned.append(updated.target[0][0])
        return updated, result

    monkeypatch.setattr(costs_module, "verify", watching)
    costs_module.measure_costs(params, 1, BUCKETS)
    assert len(handed) == (1 + costs_module.PASSES) * len(BUCKETS)  # a warm-up, then the timed passes
    assert all(now is before for now, before in zip(handed[1:], returned))


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


def test_measured_curves_never_decrease_with_width():
    assert monotone({1: 0.5, 2: 0.4, 3: 0.7, 4: 0.6}) == {1: 0.5, 2: 0.5, 3: 0.7, 4: 0.7}


# ---- the planner: whether a round drafts, which rows copy, and what it learns

GATE_COSTS = CostCurve(0.5, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 6: 1.5})
ALL = np.ones(4, bool)
POINTS = (("forced", 1), ("copy", 4))  # the bundled point sources, in their order (sources.default_sources)
FORCED, COPY = 0, 1


def offered(planner: Planner, matches=(0, 0, 0, 0), forced=(0, 0, 0, 0), tokens=(1, 2, 3, 4, 5)) -> Offers:
    """Each row's forced tokens (``forced[b]`` of them) and its copy of ``tokens`` (a match of ``matches[b]``)."""
    return planner.offers([[Offer(list(tokens[:count]), 1) for count in forced],
                           [Offer(list(tokens) if match else [], match) for match in matches]])


NO_OFFERS = Offers.none(4)


def drafted_round(planner: Planner, accepted, limits, confidences) -> None:
    """``planner`` learns from a round in which every row verified the draft."""
    rows = len(accepted)
    plan = Plan(BLOCK + 1, np.array(limits), np.ones(rows, bool), np.full(rows, NOTHING), np.array(confidences))
    planner.learn(plan, np.array(accepted), Offers.none(rows), [[] for _ in range(rows)])


def test_the_planner_measures_the_drafts_acceptance_per_slot():
    """Row 0 kept 2 of 3 drafts, row 1 none of 3, row 2 verified one draft
    and kept it (slot 2 unverified: its confidence 0.25 stands in)."""
    planner = Planner(BLOCK, costs=GATE_COSTS)
    confidences = np.full((3, BLOCK), 0.5)
    confidences[2, 1] = 0.25
    drafted_round(planner, [2, 0, 1], [3, 3, 1], confidences)
    acceptance, observed = planner.rates.acceptance[DRAFTED], planner.rates.observed[DRAFTED]
    assert acceptance[:3].tolist() == pytest.approx([2 / 3, (1 + 0.25) / 2, 0.0])
    assert observed[:4].tolist() == [3, 2, 1, 0]
    assert acceptance[3:].tolist() == [1.0, 1.0]  # not reached: still untried


def test_the_planner_declines_drafts_that_do_not_pay_and_probes_with_backoff():
    planner = Planner(BLOCK, costs=GATE_COSTS)
    assert planner.sources(NO_OFFERS, ALL).draft  # untried: optimistic
    drafted_round(planner, np.zeros(4, int), np.full(4, 5), np.full((4, 5), 0.1))  # every draft rejected
    decisions = [planner.sources(NO_OFFERS, ALL).draft for _ in range(60)]
    probes = [i for i, drafted in enumerate(decisions) if drafted]
    gaps = np.diff([-1] + probes) - 1  # plain rounds before each probe
    assert gaps.tolist()[:6] == [1, 2, 4, 8, 16, 16]
    planner.reset()
    assert planner.sources(NO_OFFERS, ALL).draft and planner.rates.observed.sum() == 0


def test_the_planner_drafts_again_once_acceptance_recovers():
    planner = Planner(BLOCK, costs=GATE_COSTS)
    drafted_round(planner, np.zeros(4, int), np.full(4, 5), np.full((4, 5), 0.1))
    assert not planner.sources(NO_OFFERS, ALL).draft
    for _ in range(10):  # an easy stretch: every draft accepted
        drafted_round(planner, np.full(4, 5), np.full(4, 5), np.full((4, 5), 0.9))
    assert all(planner.sources(NO_OFFERS, ALL).draft for _ in range(5))


def test_fixed_widths_draft_every_round_and_the_threshold_cuts_drafts_only():
    every = Planner(BLOCK, width=4, threshold=0.5, points=POINTS)
    assert every.ahead and every.max_width == 4 and every.costs is None
    assert all(every.sources(offered(every, matches=(2, 2, 2, 2)), ALL).draft for _ in range(5))
    confidences = np.array([[0.9, 0.4, 0.9, 0.9, 0.9], [0.9] * 5, [0.9] * 5, [0.1] * 5])
    fresh = np.array([False, False, True, False])  # joined after the draft: nothing to verify
    plan = every.plan(confidences, NO_OFFERS, Choice(True, np.full(4, NOTHING)), ALL, fresh)
    assert plan.width == 4 and plan.limits.tolist() == [1, 3, 0, 0]
    assert [plan.source(row) for row in range(4)] == ["draft", "draft", "", ""]
    plain = Planner(BLOCK, width=1, proposals="copy", points=POINTS)
    nothing = plain.sources(offered(plain, matches=(2, 0, 1, 0)), ALL)
    assert not plain.pointed and not nothing.draft and (nothing.points == NOTHING).all()
    assert plain.plan(None, NO_OFFERS, nothing, ALL, ~ALL).width == 1
    copies_only = Planner(BLOCK, width=None, proposals="copy", threshold=0.95, points=POINTS)
    live = np.array([True, True, True, False])
    offers = offered(copies_only, matches=(2, 0, 1, 3))
    choice = copies_only.sources(offers, live)
    assert not copies_only.ahead and not choice.draft and choice.points.tolist() == [COPY, NOTHING, COPY, NOTHING]
    plan = copies_only.plan(None, offers, choice, live, ~ALL)  # untried copies: rated 1
    assert plan.width == BLOCK + 1 and plan.limits.tolist() == [BLOCK, 0, BLOCK, 0]
    assert [plan.source(row) for row in range(4)] == ["copy", "", "copy", ""]
    assert not Planner(BLOCK, width=None, proposals="copy").pointed  # no point sources: nothing to propose


def test_the_planner_chooses_copies_where_they_beat_the_draft():
    """Copies of a 3-token match measured always right, the draft fair: the
    rows with such a copy verify it, the rows without one take the draft;
    when every live row has one, the round runs no draft pass. A copy is
    scored against what its row committed, verified or not."""
    planner = Planner(BLOCK, costs=COSTS, points=POINTS)
    planner.rates.acceptance[DRAFTED] = 0.6
    offers = offered(planner, matches=(3, 0, 0, 3))
    for _ in range(3):
        plan = Plan(1, np.zeros(4, np.int32), ~ALL, np.full(4, NOTHING), None)  # a plain round: copies not verified
        planner.learn(plan, np.zeros(4, int), offers, [[1, 2]] * 4)
    three = planner.rate_row(COPY, 3)
    assert planner.rates.acceptance[three, :2].tolist() == [1.0, 1.0] and planner.rates.observed[three, 2] == 0
    choice = planner.sources(offers, ALL)
    assert choice.draft and choice.points.tolist() == [COPY, NOTHING, NOTHING, COPY]
    alone = planner.sources(offers, np.array([True, False, False, True]))
    assert not alone.draft and alone.points.tolist() == [COPY, NOTHING, NOTHING, COPY]


def test_the_planner_verifies_forced_tokens_where_they_beat_the_draft():
    """Forced tokens are certain: rows with some verify them (the draft
    measured at 0.6 a slot), the others take the draft, and a round in which
    every live row is forced runs no draft pass. They enter the plan with
    survival 1 up to their count (the threshold does not cut them) and are
    learned under their own kind."""
    planner = Planner(BLOCK, costs=COSTS, threshold=0.7, points=POINTS)
    planner.rates.acceptance[DRAFTED] = 0.6
    offers = offered(planner, forced=(3, 0, 5, 0))
    choice = planner.sources(offers, ALL)
    assert choice.draft and choice.points.tolist() == [FORCED, NOTHING, FORCED, NOTHING]
    alone = planner.sources(offers, np.array([True, False, True, False]))
    assert not alone.draft and alone.points.tolist() == [FORCED, NOTHING, FORCED, NOTHING]
    plan = planner.plan(np.full((4, BLOCK), 0.6), offers, choice, ALL, ~ALL)
    # the drafts are cut by the threshold; Θ over levels 0..4: 4/1.2, 6/1.25, 8/1.3, 10/1.35, 11/1.55: level 3
    assert plan.width == 4 and plan.limits.tolist() == [3, 0, 3, 0]
    assert [plan.source(row) for row in range(4)] == ["forced", "", "forced", ""]
    assert plan.confidences[0].tolist() == [1, 1, 1, 0, 0]
    planner.learn(plan, np.array([3, 0, 3, 0]), offers, [[1, 2, 3, 9], [4], [1, 2, 3, 4], [4]])
    forced = planner.rate_row(FORCED, 1)
    assert planner.rates.observed[forced].tolist() == [2, 2, 2, 1, 0]  # row 2's fourth forced token counts too
    assert (planner.rates.acceptance[forced] == 1).all()
    never = Planner(BLOCK, width=BLOCK + 1, proposals="draft", points=POINTS)  # the draft alone: no point masses
    assert (never.sources(offers, ALL).points == NOTHING).all()


def test_the_best_offer_wins_and_ties_go_to_the_earlier_source():
    """Two point sources offering to the same rows: a row verifies the offer
    rated higher at the chosen level; rated equal, the earlier source's."""
    planner = Planner(BLOCK, width=None, proposals="copy", points=POINTS)
    offers = offered(planner, matches=(3, 3, 0, 2), forced=(2, 0, 0, 2))
    planner.rates.acceptance[planner.rate_row(COPY, 3)] = 0.9
    planner.rates.acceptance[planner.rate_row(COPY, 2)] = 0.5
    choice = planner.sources(offers, ALL)
    # row 0: at the widest level the copy (5 × 0.9 survival) beats two forced tokens; row 3: forced beats 0.5s
    assert choice.points.tolist() == [COPY, COPY, NOTHING, FORCED]
    tied = planner.sources(offered(planner, matches=(1, 0, 0, 0), forced=(5, 0, 0, 0)), ALL)
    assert tied.points.tolist() == [FORCED, NOTHING, NOTHING, NOTHING]  # both untried (rated 1): the earlier wins


def test_the_planner_keeps_its_measurements_across_batch_sizes_and_measures_each_once():
    measured = []

    def measure(batch: int, widths: tuple) -> CostCurve:
        measured.append((batch, widths))
        return CostCurve(0.1 * batch, {width: 1.0 + 0.01 * width for width in widths})

    planner = Planner(BLOCK, costs=measure, batch=2)
    drafted_round(planner, [1, 2], [3, 3], np.full((2, BLOCK), 0.5))
    rates = planner.rates.acceptance.copy()
    planner.resize(4)
    planner.resize(2)
    planner.resize(4)
    assert measured == [(2, BUCKETS), (4, BUCKETS)] and planner.costs.draft == pytest.approx(0.4)
    assert (planner.rates.acceptance == rates).all()


@pytest.mark.parametrize("settings, message", [
    (dict(width=BLOCK + 2), r"verify width 7 must be in 1..6"),
    (dict(width="wide"), r"verify width must be an integer, None or 'auto', got 'wide'"),
    (dict(width=None, proposals="lookup"), r"proposals must be one of auto, draft, copy, got 'lookup'"),
    (dict(width="auto"), r"width 'auto' plans from a cost curve"),
])
def test_the_planner_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        Planner(BLOCK, **settings)


def test_an_untried_slot_of_a_point_source_counts_at_the_rate_before_it():
    """A store kind whose first slot was accepted half the time and whose
    later slots were never reached is rated 0.5, 0.25, ... (not 0.5, 0.5,
    ...), so the draft (0.6 a slot) wins its rows; the draft's own untried
    slots still count as accepted."""
    flat = CostCurve(0.01, {width: 1.0 for width in BUCKETS})  # a nearly free draft pass, every width alike
    planner = Planner(BLOCK, costs=flat, points=(("store", 1),))
    kind = planner.rate_row(0, 1)
    planner.rates.learn(kind, 0, np.array([True, False]))
    assert planner.rates.expected([kind], 3)[0].tolist() == [0.5, 0.5, 0.5]
    assert planner.rates.gains([kind], 3)[0].tolist() == [0, 0.5, 0.75, 0.875]
    planner.rates.acceptance[DRAFTED] = 0.6
    planner.rates.observed[DRAFTED, :2] = 1
    assert planner.rates.expected([DRAFTED], 4)[0].tolist() == [0.6, 0.6, 0.6, 0.6]
    offers = planner.offers([[Offer([1, 2, 3, 4, 5], 1)] * 4])
    choice = planner.sources(offers, ALL)
    assert choice.draft and (choice.points == NOTHING).all()
