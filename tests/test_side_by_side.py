"""Several drafts against one target-alone baseline (``run_side_by_side``): each draft's
tokens checked against the target's, its own acceptance, one baseline shared by all."""

import numpy as np
import pytest

import dspark_fn
from dspark_fn import Sampling, benchmark
from dspark_fn.benchmark import baseline_tokens, dspark_tokens, run_bench, run_side_by_side
from dspark_fn.schedule import CostCurve
from dspark_fn.stats import Tally
from helpers import (
    build_bigram_draft, build_draft, build_target, damp_attention, draft_config, random_prompt, target_config,
)

CONFIG = target_config("qwen3", vocab=128, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
NEW_TOKENS = 12
# Fixed round costs: the widths (hence the tallies) of two runs are compared, and learned costs follow the clock.
COSTS = CostCurve(0.1, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A damped target, a bigram draft it often accepts and a random draft it rarely does."""
    root = tmp_path_factory.mktemp("side_by_side")
    model = damp_attention(root / "target", build_target(root / "target", CONFIG, seed=3, gain=2.0), 0.05)
    build_bigram_draft(root / "bigram", CONFIG, model, [1], layers=1, taps=(0, 1), block_size=4)
    build_draft(root / "random", draft_config(CONFIG, layers=1, taps=(0, 1), block_size=4), seed=2)
    # "baseline" as a candidate's name: its tokens/s must stay its own, not mixed with mlx-lm's
    candidates = {name: dspark_fn.load(root / "target", root / path) for name, path in
                  (("bigram", "bigram"), ("baseline", "random"))}
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng, length, CONFIG["vocab_size"]) for length in (5, 9, 14)]
    return model, candidates, prompts


def own_tally(params, prompts) -> Tally:
    tally = Tally()
    for prompt in prompts:
        dspark_tokens(params, prompt, NEW_TOKENS, set(), tally, costs=COSTS)
    return tally


def test_each_draft_keeps_its_own_acceptance_against_one_shared_baseline(setup):
    model, candidates, prompts = setup
    steps = []
    results = run_side_by_side(candidates, model, prompts, NEW_TOKENS, [], repeats=2,
                               on_step=lambda: steps.append(1), costs=COSTS)
    assert list(results) == list(candidates)
    assert len(steps) == 2 * len(prompts)
    tallies = {name: own_tally(params, prompts) for name, params in candidates.items()}
    assert tallies["bigram"].accepted > tallies["baseline"].accepted  # the two drafts are told apart
    for name, result in results.items():
        assert result.identical, f"{name}: tokens differ from the target alone"
        assert result.acceptance == tallies[name]
        assert len(result.dspark_tokens_per_s) == 2
        assert result.baseline_tokens_per_s == results["bigram"].baseline_tokens_per_s
    # two separately timed runs: equal rates would mean one count served both
    assert results["baseline"].dspark_tokens_per_s != results["baseline"].baseline_tokens_per_s


def test_run_bench_is_one_candidate_with_stage_times(setup):
    model, candidates, prompts = setup
    result = run_bench(candidates["bigram"], model, prompts, NEW_TOKENS, [], repeats=1, costs=COSTS)
    assert result.identical
    assert result.acceptance == own_tally(candidates["bigram"], prompts)
    drafting, verifying, rounds = result.stages
    assert rounds > 0 and drafting > 0 and verifying > 0  # timed apart at full width, outside the repeats


def test_no_candidates_is_an_error(setup):
    model, _, prompts = setup
    with pytest.raises(ValueError, match="at least one candidate"):
        run_side_by_side({}, model, prompts, NEW_TOKENS, [])


def test_sampled_runs_sample_in_both_engines_and_compare_no_tokens(setup, monkeypatch):
    """At a temperature the target alone samples too (else its rate would be
    greedy decoding's), and there are no identical tokens to claim."""
    model, candidates, prompts = setup
    temperatures = []

    def recorded(model, prompt, max_new_tokens, stop, temperature=0.0):
        temperatures.append(temperature)
        return baseline_tokens(model, prompt, max_new_tokens, stop, temperature)

    monkeypatch.setattr(benchmark, "baseline_tokens", recorded)
    results = run_side_by_side(candidates, model, prompts, NEW_TOKENS, [], repeats=1, sampling=Sampling(1.0))
    assert all(result.identical is None for result in results.values())
    assert temperatures and set(temperatures) == {1.0}
    sampled = [baseline_tokens(model, prompt, NEW_TOKENS, set(), temperature=1.0) for prompt in prompts]
    assert sampled != [baseline_tokens(model, prompt, NEW_TOKENS, set()) for prompt in prompts]
