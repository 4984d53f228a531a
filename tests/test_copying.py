"""Copies of the context as a second proposal source: the index and the
kernel that matches on the device, the choice between sources, and rounds
that verify copies, drafts or both, lossless.

Breaks tried, and the tests that catch them:
- a copied block off by one position (``CopyIndex.extend`` records each
  n-gram's continuation one position early): test_index_equals_a_brute_force_search,
  test_lookup_by_hand; in the kernel (``match_copies`` follows ``latest + 2``):
  test_the_kernel_equals_the_index, test_copies_continue_the_committed_text,
  test_greedy_equals_the_target[*-repeats everything-auto],
  test_a_hybrid_target_rolls_back_after_copies;
- the history written at the wrong slots (``write_tokens`` one slot late in
  the verify): test_copies_continue_the_committed_text;
- a copy accepted without checking the target (the verify kernel keeps every
  copied token, ``accepted = where(copying, limit, accepted)``):
  test_greedy_equals_the_target, test_a_mixed_batch_equals_the_target,
  test_copies_continue_the_committed_text, test_a_hybrid_target_rolls_back_after_copies
  (sampled: test_sampling's control "copy accepted without checking the target",
  ``point_mass`` at -inf everywhere);
- copies rated only when verified (``speculate`` scores the offers of
  copying rows alone): test_copies_rated_poor_recover_without_being_verified;
- the draft launched in rounds where every row copies (``choose_sources``
  without the check for a row that takes the draft):
  test_a_round_of_copies_runs_no_draft_pass.
"""

import importlib
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import CostCurve
from dspark_fn.copying import LONGEST_MATCH, SHORTEST_MATCH, CopyIndex, match_copies
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.schedule import DRAFTED, NOTHING, Offers, SlotRates, point_outcomes, source_speeds
from dspark_fn.stats import Tally, combined
from helpers import (
    build_bigram_draft, build_draft, build_pair, build_target, damp_attention, draft_config, mlx_lm_greedy,
    random_prompt, speculative_tokens, target_config,
)
from hybrids import HYBRID_SHAPES, hybrid_draft_config

CONFIG = target_config("qwen3", vocab=128, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
BLOCK = 4
NEW_TOKENS = 48
# a draft pass costs a third of a target step; wider verifies cost a little more
COSTS = CostCurve(0.3, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})
WIDTHS = ("auto", None)


def brute_force(context: list, count: int, longest=LONGEST_MATCH, shortest=SHORTEST_MATCH) -> tuple[list, int]:
    """The continuation after the latest earlier occurrence of the longest
    ending found, by scanning the whole context."""
    end = len(context)
    for n in range(min(longest, end), shortest - 1, -1):
        for start in range(end - 1, n - 1, -1):
            if context[start - n : start] == context[end - n :]:
                extended = list(context)
                for i in range(count):
                    extended.append(extended[start + i])
                return extended[end:], n
    return [], 0


@pytest.mark.parametrize("vocab, longest, shortest", [(2, 4, 1), (3, 4, 1), (5, 3, 2), (40, 4, 1), (4, 1, 1)])
def test_index_equals_a_brute_force_search(vocab, longest, shortest):
    rng = np.random.default_rng(vocab * 10 + longest)
    for _ in range(20):
        start = rng.integers(0, vocab, size=rng.integers(0, 8)).tolist()
        index, context = CopyIndex(start, longest, shortest), list(start)
        while len(context) < 60:
            for count in (1, 3, 7):
                found = index.lookup(count)
                assert (found.tokens, found.match) == brute_force(context, count, longest, shortest), context
            chunk = rng.integers(0, vocab, size=rng.integers(1, 6)).tolist()
            index.extend(chunk)
            context += chunk
        assert index.tokens == context


def test_lookup_by_hand():
    assert CopyIndex([1, 2, 3, 1, 2]).lookup(3) == ([3, 1, 2], 2)
    assert CopyIndex([1, 2, 3, 9, 2, 3, 7, 2, 3]).lookup(2) == ([7, 2], 2)  # the latest occurrence
    assert CopyIndex([5, 5, 5]).lookup(4) == ([5, 5, 5, 5], 2)  # a pattern running into the present repeats
    assert CopyIndex([1, 2, 3]).lookup(4) == ([], 0)
    assert CopyIndex([1, 2, 1]).lookup(0) == ([], 0)
    with pytest.raises(ValueError, match="shortest <= longest"):
        CopyIndex([], longest=1, shortest=2)


@pytest.mark.parametrize("vocab", [2, 3, 40])
def test_the_kernel_equals_the_index(vocab):
    """The device kernel's offer for every row (any length, stale tokens past
    it) is the host index's over the row's context: its committed history
    and its anchor."""
    rng = np.random.default_rng(vocab)
    capacity, rows = 48, 6
    for _ in range(10):
        lengths = rng.integers(0, capacity, size=rows)
        history = rng.integers(0, vocab, size=(rows, capacity)).astype(np.int32)
        anchors = rng.integers(0, vocab, size=rows).astype(np.int32)
        found = match_copies(mx.array(history), mx.array(lengths, mx.int32), mx.array(anchors), 5)
        for row in range(rows):
            expected = CopyIndex(history[row, : lengths[row]].tolist() + [int(anchors[row])]).lookup(5)
            assert int(found.match[row]) == expected.match
            if expected.match:
                assert found.tokens[row].tolist() == expected.tokens


def test_copies_are_rated_whether_verified_or_not():
    """Each copy is scored against what its row committed: slot k counts
    where the copy's first k tokens were committed and slot k was."""
    rates = SlotRates.start(4, kinds=3, slots=4)
    matches = [2, 0, 1, 2]
    copies = [[7, 8, 9, 9], [1, 1, 1, 1], [3, 4, 5, 6], [7, 1, 2, 3]]
    committed = [[7, 8, 5], [1], [3, 4], [6]]  # row 2 kept both it could show; row 1 has no copy
    rates = rates.learned(point_outcomes(matches, copies, committed))
    assert rates.acceptance[0, 2].tolist() == [1.0, 1.0, 0.0, 1.0]  # 7, 8 kept; 5 for 9
    assert rates.acceptance[3, 2].tolist() == [0.0, 1.0, 1.0, 1.0]  # 6 for 7
    assert rates.observed[:, 2].tolist() == [[1, 1, 1, 0], [0] * 4, [0] * 4, [1, 0, 0, 0]]
    assert rates.acceptance[2, 1].tolist() == [1.0] * 4 and rates.observed[2, 1].tolist() == [1, 1, 0, 0]
    assert rates.observed[:, DRAFTED].sum() == 0 and rates.observed[1].sum() == 0


def test_sources_follow_the_measured_rates():
    """Good copies and a poor draft: no draft pass. A good draft and poor
    short copies: the draft runs, and only rows whose copies match longer
    endings (measured better than the draft) verify them."""
    rates = SlotRates.start(3, kinds=5, slots=4)
    active, buckets = np.ones(3, bool), (1, 2, 3, 4, 5)
    rates.acceptance[:, DRAFTED] = 0.1
    speeds = source_speeds(rates, copy_offers([4, 0, 2]), active, COSTS, buckets, 4)
    assert speeds.without > speeds.drafting
    rates.acceptance[:, DRAFTED] = 0.8
    rates.acceptance[:, 1] = 0.1
    speeds = source_speeds(rates, copy_offers([1, 0, 4]), active, COSTS, buckets, 4)
    assert speeds.drafting > speeds.without
    assert speeds.points.tolist() == [NOTHING, NOTHING, 0]


def copy_offers(matches: list) -> Offers:
    """One point source's offers of four tokens, rated under the kind of each row's match (0: no offer)."""
    return Offers(np.array([matches]), [[[5, 6, 7, 8] if match else [] for match in matches]])


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("copying")
    return root, build_pair(root, CONFIG, block_size=BLOCK)


@pytest.fixture(scope="module")
def pair(pair_dir):
    root, model = pair_dir
    return model, dspark_fn.load(root / "target", root / "draft")


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """A target without attention (each token alone decides the next) and a
    draft that knows its token map: its greedy text runs round a cycle of
    the map, and a prompt that is that cycle repeated is continued by
    repeating it."""
    root = tmp_path_factory.mktemp("echo")
    model = damp_attention(root / "target", build_target(root / "target", CONFIG, seed=5, gain=2.0), 0.0)
    build_bigram_draft(root / "draft", CONFIG, model, [1], layers=1, taps=(0, 1), block_size=BLOCK)
    following = np.array(mx.argmax(model(mx.arange(CONFIG["vocab_size"])[:, None])[:, -1], axis=-1)).tolist()
    cycle = []
    for token in range(CONFIG["vocab_size"]):
        path = [token]
        while following[path[-1]] not in path:
            path.append(following[path[-1]])
        loop = path[path.index(following[path[-1]]) :]
        cycle = max(cycle, loop, key=len)
    assert len(cycle) >= 3
    return model, dspark_fn.load(root / "target", root / "draft"), cycle


def distinct_prompt(length: int = 20) -> list:
    return np.random.default_rng(1).permutation(CONFIG["vocab_size"] - 1)[:length].tolist()


def contexts(echo_cycle: list) -> dict:
    return {
        "no repeat": distinct_prompt(),
        "repeats everything": echo_cycle * 2,
        "random": random_prompt(np.random.default_rng(4), 30, CONFIG["vocab_size"]),
    }


def rounds_of(events) -> list:
    return [e for e in events if e.kind == "round"]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("context", ["no repeat", "repeats everything", "random"])
@pytest.mark.parametrize("proposals", ["copy", "draft", "auto"])
def test_greedy_equals_the_target(pair, echo, proposals, context, width):
    model, params, cycle = echo if context == "repeats everything" else (*pair, echo[2])
    prompt = contexts(cycle)[context]
    events = list(dspark_fn.generate(params, prompt, NEW_TOKENS, width=width, costs=COSTS, proposals=proposals))
    assert [t for e in events for t in e.emitted] == mlx_lm_greedy(model, prompt, NEW_TOKENS)
    rounds = rounds_of(events)
    sources = {e.source for e in rounds}
    copying = proposals == "copy" or (proposals == "auto" and width == "auto")  # a fixed width drafts
    if not copying:
        assert "copy" not in sources
    if proposals == "copy":
        assert "draft" not in sources
    if context == "no repeat" and proposals == "copy":
        assert "" in sources  # rounds without a copy to verify: plain target steps
    if context == "repeats everything" and copying:
        assert all(e.source == "copy" and e.accepted == BLOCK for e in rounds)


def mixed_prompts(cycle: list) -> list:
    """A row that repeats itself, one that does not at first, one between."""
    return [cycle * 2, distinct_prompt(), distinct_prompt(6) + cycle[:2]]


def round_sources(events) -> list:
    """The set of sources the rows verified, round by round."""
    by_round, previous = [], None
    for event in rounds_of(events):
        if previous is None or event.tag <= previous:  # generate's tags ascend within a round
            by_round.append(set())
        by_round[-1].add(event.source)
        previous = event.tag
    return by_round


def mixed_rounds(events) -> int:
    """Rounds in which one row verified its copy and another the draft."""
    return sum({"copy", "draft"} <= sources for sources in round_sources(events))


@pytest.mark.parametrize("new_tokens", [NEW_TOKENS, 5])
def test_a_mixed_batch_equals_the_target(echo, new_tokens):
    """Copy rows and draft rows side by side in one verify; each row decodes
    the target's greedy text."""
    model, params, cycle = echo
    prompts = mixed_prompts(cycle)
    events = list(dspark_fn.generate(params, prompts, new_tokens, costs=COSTS))
    streams = [[] for _ in prompts]
    for event in events:
        streams[event.tag] += event.emitted
    assert streams == [mlx_lm_greedy(model, p, new_tokens) for p in prompts]
    assert mixed_rounds(events) > 0


@pytest.mark.parametrize("proposals", ["copy", "auto"])
def test_copies_continue_the_committed_text(pair, proposals):
    """Every copy a row verified is the brute-force continuation of its
    committed text (prompt and emitted tokens, nothing rejected), and the
    cache's history holds exactly that text up to each row's anchor."""
    model, params = pair
    prompts = [random_prompt(np.random.default_rng(seed), 9 + 11 * seed, CONFIG["vocab_size"]) for seed in range(3)]
    decoder = dspark_fn.Decoder(params, 3, width="auto", costs=COSTS, proposals=proposals)
    texts = [p + emitted for p, emitted in zip(prompts, decoder.start(prompts).emitted)]
    copies = 0
    for _ in range(24):
        step = decoder.step()
        for tag, source, drafted, emitted in zip(step.tags, step.sources, step.drafted, step.emitted):
            if source == "copy":
                assert drafted == brute_force(texts[tag], BLOCK)[0][: len(drafted)]
                copies += 1
            texts[tag] += emitted
    assert copies > 5
    history = np.array(decoder.cache.history)
    assert [history[row, : len(text) - 1].tolist() + [text[-1]] for row, text in enumerate(texts)] == texts
    assert decoder.tokens.tolist() == [text[-1] for text in texts]
    assert all(text[len(p):] == mlx_lm_greedy(model, p, len(text) - len(p)) for p, text in zip(prompts, texts))


def test_verify_takes_copies_row_by_row(pair):
    """``verify(..., copies=...)``: a copying row verifies its own tokens
    (here the target's text: all kept), the other row the draft's."""
    model, params = pair
    rng = np.random.default_rng(8)
    prompts = [random_prompt(rng, 9, CONFIG["vocab_size"]), random_prompt(rng, 5, CONFIG["vocab_size"])]
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, 256), prompts)
    text = mlx_lm_greedy(model, prompts[0] + tokens.tolist()[:1], BLOCK)
    proposal = dspark_fn.propose(params, cache, tokens)
    copies = dspark_fn.Copies(mx.array([text, [0] * BLOCK], mx.int32), mx.array([True, False]))
    _, result = dspark_fn.verify(params, cache, tokens, proposal, BLOCK + 1, copies=copies)
    assert result.drafted.tolist() == [text, proposal.tokens.tolist()[1]]
    assert result.accepted.tolist()[0] == BLOCK
    with pytest.raises(ValueError, match="proposals must be one of auto, draft, copy"):
        dspark_fn.Decoder(params, 1, width=None, proposals="lookup")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("copying-lfm2")
    config = HYBRID_SHAPES["lfm2"]
    model = build_target(root / "target", config, seed=3, vector_spread=0.4)
    build_draft(root / "draft", hybrid_draft_config(config, taps=(0, 3), block_size=BLOCK), seed=1)
    return model, dspark_fn.load(root / "target", root / "draft"), config["vocab_size"]


@pytest.mark.parametrize("proposals", ["copy", "auto"])
def test_a_hybrid_target_rolls_back_after_copies(hybrid, proposals):
    """Short convolutions settle on the state after the accepted copied tokens."""
    model, params, vocab = hybrid
    rng = np.random.default_rng(2)
    pattern = random_prompt(rng, 5, vocab)
    prompts = [pattern * 4, random_prompt(rng, 17, vocab), random_prompt(rng, 3, vocab)]
    events = list(dspark_fn.generate(params, prompts, NEW_TOKENS, costs=COSTS, proposals=proposals))
    streams = [[] for _ in prompts]
    for event in events:
        streams[event.tag] += event.emitted
    assert streams == [mlx_lm_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert any(e.source == "copy" and 0 < e.accepted < len(e.drafted) for e in events)  # partial: a real rollback


# ---- compiled once, and no draft pass where no row takes the draft


@pytest.fixture(scope="module")
def unique_echo(tmp_path_factory):
    """The echo target in a geometry no other test uses, so its kernels trace here first."""
    root = tmp_path_factory.mktemp("echo-traces")
    config = dict(CONFIG, vocab_size=112)
    model = damp_attention(root / "target", build_target(root / "target", config, seed=5, gain=2.0), 0.0)
    build_draft(root / "draft", draft_config(config, layers=1, taps=(0, 1), block_size=BLOCK), seed=2)
    stream = mlx_lm_greedy(model, [3], 60)
    return dspark_fn.load(root / "target", root / "draft"), stream


def traces_during(fn) -> dict:
    before = TRACE_COUNTS.copy()
    fn()
    return {k: TRACE_COUNTS[k] - before[k] for k in TRACE_COUNTS if TRACE_COUNTS[k] != before[k]}


def test_a_mixed_batch_traces_each_kernel_once(unique_echo):
    """Copy rows and draft rows share the verify kernel of the width: a
    batch that mixes them, with rounds that draft and rounds that do not,
    traces one draft kernel and each width's verify kernel once; a second
    run traces nothing, nor does a run of copies alone."""
    params, stream = unique_echo
    prompts = [stream[30:50], list(range(1, 21)), [7, 9]]
    events = []
    run = lambda: events.extend(dspark_fn.generate(params, prompts, 80, capacity=512, costs=COSTS))  # noqa: E731
    new = traces_during(run)
    assert new["prefill"] == 1 and new["draft"] == 1 and 1 <= new["verify"] <= BLOCK + 1
    assert mixed_rounds(events) > 0 and any("draft" not in sources for sources in round_sources(events))
    assert traces_during(run) == {}
    copies = lambda: speculative_tokens(params, prompts, 80, capacity=512, costs=COSTS, proposals="copy")  # noqa: E731
    assert traces_during(copies) == {}


def test_a_round_of_copies_runs_no_draft_pass(unique_echo, monkeypatch):
    """A round in which every row verifies a copy launches no draft; with
    proposals="copy" the draft never runs."""
    params, stream = unique_echo
    proposing = importlib.import_module("dspark_fn.policy")
    calls = []
    real = proposing.propose

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(proposing, "propose", counted)
    prompts = [stream[30:50], list(range(1, 21))]
    decoder = dspark_fn.Decoder(params, 2, width="auto", costs=COSTS, capacity=512)
    decoder.start(prompts)
    copy_rounds = 0
    for _ in range(20):
        before = len(calls)
        step = decoder.step()
        if all(source == "copy" for source in step.sources):
            assert len(calls) == before
            copy_rounds += 1
    assert copy_rounds > 5 and calls
    calls.clear()
    speculative_tokens(params, prompts, 40, costs=COSTS, capacity=512, proposals="copy")
    speculative_tokens(params, prompts, 40, width=None, capacity=512, proposals="copy")
    assert not calls


def test_copies_rated_poor_recover_without_being_verified(echo):
    """Copies start rated useless, so rows verify the (good) draft; scored
    against the committed text every round, they earn back their rate and
    rows verify them again."""
    _, params, cycle = echo
    decoder = dspark_fn.Decoder(params, 3, costs=COSTS)
    decoder.start(mixed_prompts(cycle))
    policy = decoder.cache.policy
    acceptance = policy.rates.acceptance.copy()
    acceptance[:, 1:] = 0.0
    decoder.cache = decoder.cache._replace(policy=policy._replace(rates=policy.rates._replace(acceptance=acceptance)))
    sources = [decoder.step().sources for _ in range(12)]
    assert "copy" not in sources[0] and any("copy" in step for step in sources)


def test_statistics_per_source():
    """Rounds are tallied apart by source ("none": nothing verified), and
    tallies combine (a reply of several requests)."""
    first, second = Tally(), Tally()
    first.add(4, 3, 4, "copy")
    first.add(1, 0, 0, "")
    second.add(2, 1, 3, "draft")
    second.add(3, 2, 2, "copy")
    sources = combined([first, second]).summary()["sources"]
    assert sources["copy"] == {"rounds": 2, "share": 0.5, "tau": 3.5, "acceptance_rate": 5 / 6}
    assert sources["draft"]["tau"] == 2.0 and sources["none"]["share"] == 0.25


def test_cli_reports_each_source(pair_dir, pair, tmp_path, monkeypatch):
    """``dspark generate --proposals copy --json``: each round names its
    source, the statistics are per source, the tokens are the library's."""
    root, _ = pair_dir
    _, params = pair
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    prompt = random_prompt(np.random.default_rng(4), 30, CONFIG["vocab_size"])
    command = [sys.executable, "-m", "dspark_fn.cli", "generate", "--model", root / "target", "--draft",
               root / "draft", "--prompt-tokens", ",".join(map(str, prompt)), "--max-tokens", "30", "--json",
               "--proposals", "copy"]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens"] == speculative_tokens(params, prompt, 30, proposals="copy")
    assert {r["source"] for r in report["rounds"]} == {"copy", ""}
    assert set(report["sources"]) == {"copy", "none"}
    assert sum(part["rounds"] for part in report["sources"].values()) == len(report["rounds"])
