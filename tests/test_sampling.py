"""Sampled speculation is distributed exactly as sampling the target alone.

20,000 independent rows run as one batch through the real driver
(``generate``), ``TOKENS`` tokens each, and two tests read them:

- the first three emitted tokens against their exact joint distribution
  (computed from the mlx-lm target's own logits), chi-square over every
  outcome expected >= 5 times (the rest pooled);
- every position up to ``TOKENS`` (later draft slots, bonus tokens after a
  fully accepted block, rounds with and without a draft) by the randomised
  probability integral transform: ``u = F(t - 1) + U * p(t)`` under the
  target's exact conditional distribution given the row's own prefix is
  uniform on [0, 1) and independent across positions iff the sampler is
  right; chi-square of ``u`` over 20 equal bins at each position.

A check fails when p < 1e-5: the file runs about a hundred checks, so a
correct sampler fails a run with probability about 0.1%. The broken
samplers at the end are rejected at p < 1e-6 by the same checks.

The draft's cases propose from the draft alone; two cases verify copies of
the context (point-mass proposals): copies alone under top-k/top-p (a
copied token the filters exclude is never kept), and copies and drafts
chosen row by row in one batch; one verifies a store of the target's
greedy answers (point masses too). The last section holds rows to a grammar
(constrained sampling: the mask, then temperature, top-k, top-p) through a
loop over the pure functions with a matcher per row, with its own negative
controls.
"""

import functools
import importlib
import json
import math

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import GREEDY, CostCurve, Sampling
from dspark_fn.checkpoints import save_draft
from dspark_fn.constraints import commit, compile_constraint, draft_masks, next_masks, verify_masks
from dspark_fn.drafts.vocab import reduced_checkpoint
from dspark_fn.sampling import Mode, batch_sampling, constrained, log_probs
from dspark_fn.sources import StoredAnswers
from dspark_fn.store import build_store
from grammars import ALTERNATING, SAMPLING_PIECES, EngineMask, vocabulary
from helpers import build_bigram_draft, build_target, mlx_lm_greedy, speculative_tokens, target_config
from hybrids import HYBRID_SHAPES

SAMPLES = 20_000
STORED = object()  # stands for the store of ``stored_answers``, built from the target of the run
TOKENS = 8
PIT_BINS = 20
PROMPT = [5, 9]
P_VALUE_FLOOR = 1e-5
CONFIG = target_config("qwen3", vocab=32, hidden=16, layers=2, heads=2, kv_heads=1, head_dim=8)
# A hybrid target (a gated short convolution, then attention): the law must
# hold through the recurrent state's rollback too.
HYBRID = dict(
    HYBRID_SHAPES["lfm2"], vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, block_dim=16, block_ff_dim=32, full_attn_idxs=[1],
)
DRAFT = dict(layers=1, taps=(0,), block_size=3)


def build_models(root, config: dict):
    """The target and its bigram drafts: good, bad, too flat, and good over half the vocabulary."""
    model = build_target(root / "target", config, seed=0, gain=3.0)
    shape = CONFIG  # the drafts' own geometry (a qwen3 draft serves any target of this width and vocabulary)
    build_bigram_draft(root / "good", shape, model, PROMPT, scale=1.0, **DRAFT)
    build_bigram_draft(root / "bad", shape, model, PROMPT, scale=-1.0, **DRAFT)
    build_bigram_draft(root / "flat", shape, model, PROMPT, scale=0.3, **DRAFT)  # right in shape, too flat
    draft = json.loads((root / "good" / "config.json").read_text())
    weights = mx.load(str(root / "good" / "model.safetensors"))
    save_draft(root / "reduced", *reduced_checkpoint(draft, weights, np.arange(0, 32, 2)))  # even ids only
    pairs = {name: dspark_fn.load(root / "target", root / name) for name in ("good", "bad", "flat", "reduced")}
    return model, pairs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("sampling"), CONFIG)


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("sampling-hybrid"), HYBRID)


def target_models(request, target: str):
    return request.getfixturevalue("hybrid_models" if target == "hybrid" else "models")


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def reference_probs(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Temperature, then top-k, then top-p, written out in numpy."""
    z = logits.astype(np.float64) / sampling.temperature
    if sampling.top_k:
        kth = np.sort(z, axis=-1)[..., -sampling.top_k, None]
        z = np.where(z >= kth, z, -np.inf)
    if sampling.top_p < 1:
        p = softmax(z)
        order = np.argsort(-p, axis=-1)
        ranked = np.take_along_axis(p, order, axis=-1)
        keep_ranked = np.cumsum(ranked, axis=-1) - ranked < sampling.top_p
        keep = np.zeros_like(keep_ranked)
        np.put_along_axis(keep, order, keep_ranked, axis=-1)
        z = np.where(keep, z, -np.inf)
    return softmax(z)


def exact_first_three(model, sampling: Sampling) -> np.ndarray:
    """``P[t1, t2, t3]`` of sampling the target alone after ``PROMPT``."""
    vocab = CONFIG["vocab_size"]
    t1, t2 = np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij")
    rows = np.concatenate([np.tile(PROMPT, (vocab * vocab, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], axis=1)
    logits = np.array(model(mx.array(rows))[:, len(PROMPT) - 1 :].astype(mx.float32))
    p = reference_probs(logits, sampling)  # [V*V, 3, V]
    first = p[0, 0]
    second = p[::vocab, 1]  # rows with t2 = 0 carry p(t2 | t1) for every t1
    third = p[:, 2].reshape(vocab, vocab, vocab)
    return first[:, None, None] * second[:, :, None] * third


def loop_streams(params, sampling: Sampling, seed: int) -> tuple[np.ndarray, set, int]:
    """``sampled_streams`` through a loop of one's own over ``speculate``,
    every round's width and sources chosen by the cache's policy (its costs
    learned as the rounds run); a row that has its tokens goes idle."""
    cache = dspark_fn.init_cache(params, SAMPLES, 24, seed=seed)
    cache, tokens = dspark_fn.prefill(params, cache, [PROMPT] * SAMPLES, sampling=sampling)
    streams, widths, mixed = np.full((SAMPLES, TOKENS + params.spec.block_size + 1), -1), set(), 0
    streams[:, 0], counts = np.array(tokens), np.ones(SAMPLES, int)
    while (counts < TOKENS).any():
        cache, step = dspark_fn.speculate(params, cache, tokens, sampling=sampling, active=mx.array(counts < TOKENS))
        emitted, count = np.array(step.emitted), np.array(step.count)
        for row in np.flatnonzero(count):
            streams[row, counts[row] : counts[row] + count[row]] = emitted[row, : count[row]]
        counts += count
        widths.add(step.emitted.shape[1])
        mixed += {"copy", "draft"} <= set(step.sources)
        tokens = step.next_tokens
    return streams[:, :TOKENS], widths, mixed


def sampled_streams(params, sampling: Sampling, seed: int, loop: bool = False, **kwargs) -> tuple[np.ndarray, set, int]:
    """``[SAMPLES, TOKENS]`` emitted tokens, the verify widths the rounds
    used, and the number of rounds in which some rows verified a copy and
    others the draft (``loop``: through ``loop_streams``)."""
    if loop:
        return loop_streams(params, sampling, seed)
    streams = [[] for _ in range(SAMPLES)]
    events = dspark_fn.generate(
        params, [PROMPT] * SAMPLES, TOKENS, sampling=sampling, seed=seed, capacity=24, **kwargs
    )
    widths, sources, mixed, previous = set(), set(), 0, SAMPLES
    for event in events:
        streams[event.tag] += event.emitted
        widths.add(event.width)
        if event.kind == "round":
            if event.tag <= previous:  # generate's tags ascend within a round
                mixed += {"copy", "draft"} <= sources
                sources = set()
            sources.add(event.source)
            previous = event.tag
    outcomes = np.array(streams)
    assert outcomes.shape == (SAMPLES, TOKENS)
    return outcomes, widths - {0}, mixed + ({"copy", "draft"} <= sources)


def first_three_counts(outcomes: np.ndarray) -> np.ndarray:
    vocab = CONFIG["vocab_size"]
    index = (outcomes[:, 0] * vocab + outcomes[:, 1]) * vocab + outcomes[:, 2]
    return np.bincount(index, minlength=vocab**3)


def pit_values(model, outcomes: np.ndarray, sampling: Sampling, seed: int) -> np.ndarray:
    """``[SAMPLES, TOKENS]`` randomised PIT of each token under the target's
    exact distribution given the prompt and the row's earlier tokens."""
    rows = np.concatenate([np.tile(PROMPT, (len(outcomes), 1)), outcomes[:, :-1]], axis=1)
    logits = np.concatenate([
        np.array(model(mx.array(rows[i : i + 4096]))[:, len(PROMPT) - 1 :].astype(mx.float32))
        for i in range(0, len(rows), 4096)
    ])
    probs = reference_probs(logits, sampling)  # [N, T, V]
    taken = np.take_along_axis(probs, outcomes[..., None], axis=-1)[..., 0]
    below = np.take_along_axis(np.cumsum(probs, axis=-1), outcomes[..., None], axis=-1)[..., 0] - taken
    return below + np.random.default_rng(seed).uniform(size=taken.shape) * taken


def chi_square_survival(statistic: float, dof: int) -> float:
    """P(chi2_dof > statistic) = Q(dof / 2, statistic / 2), the regularised
    upper incomplete gamma function (series below a + 1, continued fraction above)."""
    a, x = dof / 2, statistic / 2
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1 - math.exp(log_front) * total)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def uniform_p_value(values: np.ndarray) -> float:
    """Chi-square of ``values`` in [0, 1) over ``PIT_BINS`` equal bins."""
    observed = np.bincount(np.minimum((values * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)
    expected = len(values) / PIT_BINS
    return chi_square_survival(((observed - expected) ** 2 / expected).sum(), PIT_BINS - 1)


def chi_square_p_value(observed: np.ndarray, probs: np.ndarray, samples: int = SAMPLES) -> float:
    """Bins: every outcome expected >= 5 times, plus one bin pooling the rest."""
    expected = samples * probs.ravel()
    order = np.argsort(-expected)
    expected, observed = expected[order], observed[order]
    large = expected >= 5
    bins_e = np.append(expected[large], expected[~large].sum())
    bins_o = np.append(observed[large], observed[~large].sum())
    if bins_e[-1] < 5:  # too little left over to stand alone
        bins_e, bins_o = np.append(bins_e[:-2], bins_e[-2:].sum()), np.append(bins_o[:-2], bins_o[-2:].sum())
    statistic = ((bins_o - bins_e) ** 2 / bins_e).sum()
    return chi_square_survival(statistic, len(bins_e) - 1)


WHOLE_BLOCK = dict(width=None, proposals="draft")
CASES = {
    "good draft": ("good", Sampling(1.0), WHOLE_BLOCK),
    "bad draft": ("bad", Sampling(1.0), WHOLE_BLOCK),
    "flat draft": ("flat", Sampling(1.0), WHOLE_BLOCK),
    "top-k top-p": ("good", Sampling(0.8, top_k=6, top_p=0.9), WHOLE_BLOCK),
    # a cost curve under which Algorithm 1 picks intermediate widths
    "auto width": (
        "good", Sampling(1.0),
        dict(width="auto", costs=CostCurve(0.5, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.5}), proposals="draft"),
    ),
    # a slot is nearly free to verify but the draft costs half a step: the
    # gate drafts the first round, sees the bad draft rejected, and declines
    "auto declines to draft": (
        "bad", Sampling(1.0), dict(costs=CostCurve(0.5, {1: 1.0, 2: 1.02, 3: 1.4, 4: 1.5}), proposals="draft"),
    ),
    "confidence threshold": ("good", Sampling(1.0), dict(WHOLE_BLOCK, confidence_threshold=0.2)),
    # the draft proposes from half the vocabulary; the residual covers the rest
    "reduced vocabulary": ("reduced", Sampling(1.0), WHOLE_BLOCK),
    "reduced vocabulary top-k": ("reduced", Sampling(0.7, top_k=5), WHOLE_BLOCK),
    # copies only: point masses, some on tokens the filters exclude
    "copies, top-k top-p": ("good", Sampling(0.8, top_k=6, top_p=0.9), dict(width=None, proposals="copy")),
    # the default: each round, each row its copy or the draft, the width by Algorithm 1 over both
    "copies and drafts in one batch": (
        "good", Sampling(1.0), dict(width="auto", costs=CostCurve(0.5, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.5})),
    ),
    # a store of the target's greedy answers alone (``stored_answers``): point masses, often right
    "stored answers": ("bad", Sampling(1.0), dict(width=None, proposals="copy", sources=STORED)),
    # a loop of one's own, ``speculate`` with no width: the policy in the cache chooses, at learned costs
    "the loop's own policy": ("good", Sampling(1.0), dict(loop=True)),
    "the loop's own policy, top-k top-p": ("flat", Sampling(0.8, top_k=6, top_p=0.9), dict(loop=True)),
}


def stored_answers(model, options: dict) -> dict:
    """``options`` with ``sources=STORED`` replaced by a store of the
    target's greedy answers to 64 two-token prompts (not learning, so every
    row proposes from the same store)."""
    if options.get("sources") is not STORED:
        return options
    vocab = CONFIG["vocab_size"]
    prompts = np.random.default_rng(3).integers(0, vocab, (64, 2)).tolist()
    store = build_store([mlx_lm_greedy(model, prompt, 10) for prompt in [PROMPT] + prompts], vocab, "harness")
    return dict(options, sources=(StoredAnswers(store, learning=False),))


HYBRID_CASES = ("good draft", "bad draft", "top-k top-p", "auto width")
RUNS = [("qwen3", case) for case in sorted(CASES)] + [("hybrid", case) for case in HYBRID_CASES]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{target}: {case}" for target, case in RUNS])
def sampled(request):
    target, case = request.param
    model, pairs = target_models(request, target)
    draft, sampling, kwargs = CASES[case]
    outcomes, widths, mixed = sampled_streams(pairs[draft], sampling, seed=len(case), **stored_answers(model, kwargs))
    return case, model, sampling, outcomes, widths, mixed


def test_first_three_tokens_match_target_sampling(sampled):
    case, model, sampling, outcomes, _, _ = sampled
    probs = exact_first_three(model, sampling)
    counts = first_three_counts(outcomes)
    assert counts[probs.ravel() == 0].sum() == 0, "emitted a token the filters exclude"
    p_value = chi_square_p_value(counts, probs)
    assert p_value > P_VALUE_FLOOR, f"{case}: chi-square p = {p_value:.2e}"


def test_every_position_matches_target_sampling(sampled):
    case, model, sampling, outcomes, widths, mixed = sampled
    if case == "auto declines to draft":
        assert 1 in widths and max(widths) > 1, widths  # rounds with and without a draft
    if case == "copies and drafts in one batch":
        assert mixed, "no round verified copies and drafts side by side"
    if case == "stored answers":
        assert max(widths) > 1, "no round verified the store's proposals"
    if case.startswith("the loop's own policy"):
        assert len(widths) > 1, widths  # the policy chose more than one width
    pit = pit_values(model, outcomes, sampling, seed=len(case))
    for position in range(TOKENS):
        p_value = uniform_p_value(pit[:, position])
        assert p_value > P_VALUE_FLOOR, f"{case}: token {position + 1}: chi-square p = {p_value:.2e}"


def test_transform_matches_reference():
    """Per-row settings: each row of one batch under its own transform."""
    settings = [Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.6), Sampling(0.9, 10, 0.75)]
    logits = np.random.default_rng(0).normal(size=(len(settings), 16, 50)).astype(np.float32) * 3
    ours = np.exp(np.array(log_probs(mx.array(logits), *batch_sampling(settings, len(settings)))))
    for row, sampling in enumerate(settings):
        np.testing.assert_allclose(ours[row], reference_probs(logits[row], sampling), atol=1e-6)


def test_top_p_keeps_the_most_likely_token():
    logits = mx.array([[4.0, 1.0, 0.0]])
    kept = np.exp(np.array(log_probs(logits, *batch_sampling(Sampling(1.0, top_p=0.01), 1))))
    np.testing.assert_allclose(kept, [[1.0, 0.0, 0.0]])


@pytest.mark.parametrize("choices", [dict(width=4), dict(costs=CostCurve(0.5, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.5})),
                                     dict(costs="prior")])
def test_same_seed_same_tokens_and_seeds_differ(models, choices):
    """A seed repeats its samples where the rounds' choices repeat: a fixed
    width, or fixed costs, given or the prior's (learned costs follow the
    machine's timing)."""
    _, pairs = models
    runs = [speculative_tokens(pairs["good"], PROMPT, 40, sampling=Sampling(1.0), seed=s, **choices)
            for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_temperature_zero_is_greedy(models):
    model, pairs = models
    greedy = Sampling(0.0, top_k=3, top_p=0.5)
    assert speculative_tokens(pairs["bad"], PROMPT, 30, sampling=greedy) == mlx_lm_greedy(model, PROMPT, 30)


def test_invalid_settings_are_refused(models):
    _, pairs = models
    with pytest.raises(ValueError, match="temperature"):
        Sampling(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        Sampling(1.0, top_k=-2)
    params = pairs["good"]
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 16), PROMPT)
    with pytest.raises(ValueError, match="draft_log_probs"):
        dspark_fn.verify_block(params, cache, mx.array([[tokens.item(), 3]]), sampling=Sampling(1.0))


# ---- negative controls: the same harness, broken samplers

VERIFY = importlib.import_module("dspark_fn.accept")
DRIVER = importlib.import_module("dspark_fn.rounds")
CACHE = importlib.import_module("dspark_fn.cache")
CONTROL_FLOOR = 1e-6


def accept_every_draft(p_draft, q_draft, uniforms):
    return mx.full(p_draft.shape[:1], p_draft.shape[1], mx.int32)


def no_residual(p, q, rejected):
    return p


def bonus_from_the_draft(p, q, rejected):
    residual = mx.maximum(p - q, 0)
    return mx.where(rejected, residual, mx.where(q.sum(axis=-1, keepdims=True) > 0, q, p))


def unfiltered_draft_distribution(logits, rows, mode, allowed=None):
    return log_probs(logits, rows, Mode(mode.greedy, mode.sampled), allowed)


def blind_copy(tokens, vocab_size):
    """Copies accepted without checking the target: a copied token's log q
    is -inf, so ``log u < log p - log q`` always holds."""
    return mx.full((*tokens.shape, vocab_size), -mx.inf)


def last_state_kept(entry, count):
    """No rollback: a recurrent layer keeps the state after every verified token."""
    if isinstance(entry, CACHE.PendingStates):
        return entry.history[:, -1]
    if isinstance(entry, CACHE.PendingWindow):
        return entry.rows[:, -entry.size :]
    return entry


BROKEN = {
    "accepts every draft": ("good", Sampling(1.0), VERIFY, "acceptance_run", accept_every_draft),
    "no residual, good draft": ("good", Sampling(1.0), VERIFY, "correction", no_residual),
    "no residual, flat draft": ("flat", Sampling(1.0), VERIFY, "correction", no_residual),
    "bonus drawn from the draft": ("good", Sampling(1.0), VERIFY, "correction", bonus_from_the_draft),
    "draft distribution left unfiltered": (
        "good", Sampling(0.8, top_k=6, top_p=0.9), DRIVER, "log_probs", unfiltered_draft_distribution,
    ),
    "recurrent state not rolled back": ("good", Sampling(1.0), CACHE, "settle_entry", last_state_kept),
    "copy accepted without checking the target": ("good", Sampling(1.0), DRIVER, "point_mass", blind_copy),
    "stored continuation accepted without checking the target": (
        "bad", Sampling(1.0), DRIVER, "point_mass", blind_copy,
    ),
}
BROKEN["accepts every draft, the loop's own policy"] = BROKEN["accepts every draft"]
BROKEN["copy accepted without checking the target, the loop's own policy"] = BROKEN[
    "copy accepted without checking the target"]
PROPOSALS_OF = {  # the others break the draft's rounds
    "copy accepted without checking the target": dict(proposals="copy"),
    "stored continuation accepted without checking the target": dict(proposals="copy", sources=STORED),
    "accepts every draft, the loop's own policy": dict(loop=True),
    "copy accepted without checking the target, the loop's own policy": dict(loop=True),
}
CONTROLS = [("qwen3", name) for name in sorted(BROKEN) if name != "recurrent state not rolled back"] + [
    ("hybrid", name) for name in ("accepts every draft", "no residual, good draft", "recurrent state not rolled back")
]


def clear_kernels():
    DRIVER._draft_kernel.cache_clear()
    DRIVER._verify_kernel.cache_clear()


@pytest.mark.parametrize("target, name", CONTROLS, ids=[f"{target}: {name}" for target, name in CONTROLS])
def test_the_harness_rejects_broken_samplers(request, monkeypatch, target, name):
    """Each broken rule is rejected far below the floor a correct sampler
    clears: the harness has the power the passing tests rely on."""
    model, pairs = target_models(request, target)
    draft, sampling, module, attribute, broken = BROKEN[name]
    monkeypatch.setattr(module, attribute, broken)
    clear_kernels()
    try:
        options = stored_answers(model, PROPOSALS_OF.get(name, dict(proposals="draft")))
        outcomes, _, _ = sampled_streams(pairs[draft], sampling, seed=len(name), width=None, **options)
    finally:
        monkeypatch.undo()
        clear_kernels()
    pit = pit_values(model, outcomes, sampling, seed=len(name))
    p_values = [chi_square_p_value(first_three_counts(outcomes), exact_first_three(model, sampling))]
    p_values += [uniform_p_value(pit[:, position]) for position in range(TOKENS)]
    assert min(p_values) < CONTROL_FLOOR, f"{name}: smallest p = {min(p_values):.2e}"


def test_rows_with_their_own_settings_share_one_batch(models):
    """Half the rows at T=1, half at T=0.8 with top-k/top-p, a few greedy, in
    one batch: each group is distributed as the target under its settings."""
    model, pairs = models
    settings = [Sampling(1.0), Sampling(0.8, top_k=6, top_p=0.9)]
    per_row = [settings[row % 2] for row in range(SAMPLES)] + [GREEDY] * 4
    streams = [[] for _ in per_row]
    for event in dspark_fn.generate(pairs["good"], [PROMPT] * len(per_row), TOKENS, sampling=per_row, seed=9,
                                    capacity=24, width=None):
        streams[event.tag] += event.emitted
    outcomes = np.array(streams)
    assert (outcomes[SAMPLES:] == mlx_lm_greedy(model, PROMPT, TOKENS)).all()
    for group, sampling in enumerate(settings):
        rows = outcomes[group:SAMPLES:2]
        pit = pit_values(model, rows, sampling, seed=group)
        for position in range(TOKENS):
            p_value = uniform_p_value(pit[:, position])
            assert p_value > P_VALUE_FLOOR, f"{sampling}: token {position + 1}: chi-square p = {p_value:.2e}"


IMAGE_SAMPLING = Sampling(1.0, top_k=4)
IMAGE_SAMPLES = SAMPLES // 2  # a wider model than the others': half the rows (its 64 outcomes need no more)


def image_first_three(release, text: str, images: list) -> dict:
    """``{(t1, t2, t3): P}`` of sampling mlx-vlm's own model of the release
    alone after a prompt with an image, under ``IMAGE_SAMPLING``."""
    def next_probs(then: tuple) -> np.ndarray:
        return reference_probs(release.reference(text, images, then=then)[0][-1], IMAGE_SAMPLING)

    law, first = {}, next_probs(())
    for t1 in np.flatnonzero(first):
        second = next_probs((int(t1),))
        for t2 in np.flatnonzero(second):
            third = next_probs((int(t1), int(t2)))
            for t3 in np.flatnonzero(third):
                law[int(t1), int(t2), int(t3)] = first[t1] * second[t2] * third[t3]
    return law


def test_an_image_prompt_samples_the_target_law(tmp_path_factory):
    """``IMAGE_SAMPLES`` rows of one prompt with an image (a Qwen3.5 release: its
    multimodal positions and the shift they leave, delta nets rolled back),
    top-k 4, whole draft blocks: the first three tokens against their exact
    joint law under mlx-vlm's own model."""
    from dspark_fn.vision import image_prompt
    from multimodal import Release, synthetic_image

    release = Release(tmp_path_factory.mktemp("sampling-image"), "qwen3_5")
    picture = synthetic_image(16, 16, seed=1)  # 4 image tokens: the prompt fits a cache of 64 for 20,000 rows
    text = release.text("Hi", 1)
    prompt = image_prompt(release.params, text, [picture])
    streams = [[] for _ in range(IMAGE_SAMPLES)]
    for event in dspark_fn.generate(release.params, [prompt] * IMAGE_SAMPLES, 3, sampling=IMAGE_SAMPLING, seed=3,
                                    capacity=64, width=None, proposals="draft"):
        streams[event.tag] += event.emitted
    law = image_first_three(release, text, [picture])
    outcomes = [tuple(stream) for stream in streams]
    assert set(outcomes) <= set(law), "a token outside the top-k was sampled"
    order = sorted(law)
    counts = np.array([outcomes.count(outcome) for outcome in order])
    p_value = chi_square_p_value(counts, np.array([law[outcome] for outcome in order]), IMAGE_SAMPLES)
    assert p_value > P_VALUE_FLOOR, f"first three tokens after an image: chi-square p = {p_value:.2e}"


def test_chi_square_survival_matches_the_closed_form_for_even_dof():
    for dof, statistic in ((2, 3.0), (4, 10.0), (20, 45.0), (20, 5.0)):
        half = statistic / 2
        closed = math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))
        assert chi_square_survival(statistic, dof) == pytest.approx(closed, rel=1e-9)


# ---- constrained sampling: a grammar that changes the law at every position
#
# Rows follow ``grammars.ALTERNATING`` (characters alternate between a-d and
# e-h, so the legal pieces depend on the phase; 5 of the 32 tokens are legal
# at each step). The loop is the one a caller writes with the pure functions
# and its own matchers: the first token under ``prefill(..., masks=...)``,
# then ``speculate`` with the draft's first slot masked and every verified
# position under the mask along its proposal, each matcher advanced by the
# tokens its row committed. The law each token must follow is plain
# constrained sampling: the grammar's mask after the row's own prefix, then
# temperature, top-k, top-p, written out in numpy.

SAMPLING_VOCAB = vocabulary(SAMPLING_PIECES, CONFIG["vocab_size"])
WIDTH = DRAFT["block_size"] + 1


def commit_emitted(matchers, drafted, emitted):
    commit(matchers, emitted)


def constrained_streams(params, sampling: Sampling, seed: int, constrained=lambda row: True,
                        advance=commit_emitted) -> np.ndarray:
    """``[SAMPLES, TOKENS]`` tokens of rows under ``ALTERNATING`` (those
    ``constrained(row)`` says; the others free) in one batch."""
    grammar = compile_constraint(ALTERNATING, SAMPLING_VOCAB)
    vocab = CONFIG["vocab_size"]
    matchers = [grammar.matcher() if constrained(row) else None for row in range(SAMPLES)]
    cache = dspark_fn.init_cache(params, SAMPLES, 24, seed=seed)
    cache, anchors = dspark_fn.prefill(params, cache, [PROMPT] * SAMPLES, sampling=sampling,
                                       masks=next_masks(matchers, vocab))
    streams = [[t] for t in anchors.tolist()]
    commit(matchers, streams)
    while min(len(s) for s in streams) < TOKENS:
        running = [len(s) < TOKENS for s in streams]
        live = [m if run else None for m, run in zip(matchers, running)]  # finished rows' matchers rest
        cache, result = dspark_fn.speculate(
            params, cache, anchors, width=WIDTH, sampling=sampling, active=mx.array(running),
            masks=functools.partial(verify_masks, live, vocab_size=vocab),
            draft_masks=draft_masks(live, DRAFT["block_size"], vocab),
        )
        counts, anchors, tokens = result.count.tolist(), result.next_tokens, np.array(result.emitted).tolist()
        emitted = [row[:count] if run else [] for row, count, run in zip(tokens, counts, running)]
        advance(live, result.drafted.tolist(), emitted)
        for stream, tokens in zip(streams, emitted):
            stream += tokens
    return np.array([s[:TOKENS] for s in streams])


def grammar_masks(prefixes: np.ndarray) -> np.ndarray:
    """``[N, T, V]`` bools: the tokens ``ALTERNATING`` allows after each row's
    first ``t`` tokens, for ``t < T`` (llguidance driven directly)."""
    return EngineMask(ALTERNATING, SAMPLING_VOCAB).along(prefixes)


def constrained_reference(logits: np.ndarray, allowed: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Plain constrained sampling: the mask, then ``reference_probs``; a prefix
    no row can reach (its mask allows nothing) keeps its logits."""
    allowed = allowed | ~allowed.any(axis=-1, keepdims=True)
    return reference_probs(np.where(allowed, logits, -np.inf), sampling)


def exact_constrained_first_three(model, sampling: Sampling) -> np.ndarray:
    vocab = CONFIG["vocab_size"]
    t1, t2 = np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij")
    prefixes = np.concatenate([t1.reshape(-1, 1), t2.reshape(-1, 1), np.zeros((vocab * vocab, 1), int)], axis=1)
    rows = np.concatenate([np.tile(PROMPT, (vocab * vocab, 1)), prefixes[:, :2]], axis=1)
    logits = np.array(model(mx.array(rows))[:, len(PROMPT) - 1:].astype(mx.float32))
    p = constrained_reference(logits, grammar_masks(prefixes), sampling)
    return p[0, 0][:, None, None] * p[::vocab, 1][:, :, None] * p[:, 2].reshape(vocab, vocab, vocab)


def constrained_pit(model, outcomes: np.ndarray, sampling: Sampling, seed: int) -> np.ndarray:
    """``pit_values`` under the constrained law."""
    rows = np.concatenate([np.tile(PROMPT, (len(outcomes), 1)), outcomes[:, :-1]], axis=1)
    logits = np.concatenate([
        np.array(model(mx.array(rows[i: i + 4096]))[:, len(PROMPT) - 1:].astype(mx.float32))
        for i in range(0, len(rows), 4096)
    ])
    probs = constrained_reference(logits, grammar_masks(outcomes), sampling)
    taken = np.take_along_axis(probs, outcomes[..., None], axis=-1)[..., 0]
    below = np.take_along_axis(np.cumsum(probs, axis=-1), outcomes[..., None], axis=-1)[..., 0] - taken
    return below + np.random.default_rng(seed).uniform(size=taken.shape) * taken


def constrained_p_values(model, outcomes: np.ndarray, sampling: Sampling, seed: int) -> list:
    """The first three tokens' joint law, then every position's PIT."""
    counts = first_three_counts(outcomes)
    p_values = [chi_square_p_value(counts, exact_constrained_first_three(model, sampling))]
    pit = constrained_pit(model, outcomes, sampling, seed)
    return p_values + [uniform_p_value(pit[:, position]) for position in range(TOKENS)]


CONSTRAINED_CASES = {
    "good draft": ("good", Sampling(1.0)),
    "bad draft": ("bad", Sampling(1.0)),
    "top-k top-p": ("good", Sampling(0.8, top_k=3, top_p=0.7)),
}


@pytest.mark.parametrize("case", sorted(CONSTRAINED_CASES))
def test_constrained_sampling_matches_the_constrained_target(models, case):
    model, pairs = models
    draft, sampling = CONSTRAINED_CASES[case]
    outcomes = constrained_streams(pairs[draft], sampling, seed=len(case))
    assert grammar_masks(outcomes)[np.arange(SAMPLES)[:, None], np.arange(TOKENS), outcomes].all(), \
        "a token the grammar refuses"
    assert (first_three_counts(outcomes)[exact_constrained_first_three(model, sampling).ravel() == 0] == 0).all()
    p_values = constrained_p_values(model, outcomes, sampling, seed=len(case))
    assert min(p_values) > P_VALUE_FLOOR, f"{case}: p = {p_values}"


def test_constrained_and_free_rows_share_a_batch(models):
    """Even rows under the grammar, odd rows free, in one batch: each group follows its own law."""
    model, pairs = models
    sampling = Sampling(1.0)
    outcomes = constrained_streams(pairs["good"], sampling, seed=5, constrained=lambda row: row % 2 == 0)
    bound, free = outcomes[0::2], outcomes[1::2]
    pit = constrained_pit(model, bound, sampling, seed=5)
    free_pit = pit_values(model, free, sampling, seed=6)
    for position in range(TOKENS):
        for group, values in (("constrained", pit), ("free", free_pit)):
            p_value = uniform_p_value(values[:, position])
            assert p_value > P_VALUE_FLOOR, f"{group} rows: token {position + 1}: p = {p_value:.2e}"


def mask_only_on_the_bonus_token(block, logits, q, rows, mode, accept_uniforms, correction_uniforms, limit=None,
                                 allowed=None):
    """Drafts accepted and rejected by the unconstrained target; only the
    token after a fully accepted block is drawn under the mask."""
    free = ACCEPT_SAMPLED(block, logits, q, rows, mode, accept_uniforms, correction_uniforms, limit)
    at_bonus = mx.take_along_axis(VERIFY.log_probs(logits, rows, mode, allowed), free.accepted[:, None, None], axis=1)
    bonus = VERIFY.gumbel_argmax(at_bonus[:, 0], correction_uniforms).astype(block.dtype)
    full = free.accepted == (block.shape[1] - 1 if limit is None else limit)
    next_tokens = mx.where(full, bonus, free.next_tokens)
    return VERIFY.Verdict(free.accepted, next_tokens, VERIFY.emitted_tokens(block, free.accepted, next_tokens))


def advanced_by_rejected_drafts(matchers, drafted, emitted):
    """Each matcher takes every drafted token it can, kept or not, then the target's own token."""
    for matcher, proposals, tokens in zip(matchers, drafted, emitted):
        if matcher is not None and tokens:
            legal = matcher.copy().commit(proposals)
            matcher.commit(proposals[:legal] + tokens[-1:])


def masked_after_top_p(logits, rows, mode, allowed=None):
    scores = log_probs(logits, rows, mode)
    if allowed is None:
        return scores
    kept = constrained(scores, allowed & (scores > -mx.inf))
    return kept - mx.logsumexp(kept, axis=-1, keepdims=True)


def unmasked_draft_distribution(logits, rows, mode, allowed=None):
    return log_probs(logits, rows, mode)


ACCEPT_SAMPLED = VERIFY.accept_sampled
CONSTRAINED_BROKEN = {
    "mask only on the bonus token": (Sampling(1.0), VERIFY, "accept_sampled", mask_only_on_the_bonus_token),
    "grammar advanced by rejected drafts": (Sampling(1.0), None, None, advanced_by_rejected_drafts),
    "mask applied after top-p": (Sampling(0.8, top_p=0.7), VERIFY, "log_probs", masked_after_top_p),
    "draft q not the q that drafted": (Sampling(1.0), DRIVER, "log_probs", unmasked_draft_distribution),
}


@pytest.mark.parametrize("name", sorted(CONSTRAINED_BROKEN))
def test_the_harness_rejects_broken_constrained_samplers(models, monkeypatch, name):
    model, pairs = models
    sampling, module, attribute, broken = CONSTRAINED_BROKEN[name]
    advance = broken if module is None else commit_emitted
    if module is not None:
        monkeypatch.setattr(module, attribute, broken)
    clear_kernels()
    try:
        outcomes = constrained_streams(pairs["good"], sampling, seed=len(name), advance=advance)
    finally:
        monkeypatch.undo()
        clear_kernels()
    p_values = constrained_p_values(model, outcomes, sampling, seed=len(name))
    assert min(p_values) < CONTROL_FLOOR, f"{name}: smallest p = {min(p_values):.2e}"
