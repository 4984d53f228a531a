"""Batched speculation: rows of different lengths decode side by side, each as if alone; sequences enter
and leave a ``Decoder`` by tag and come back, when they end, as one record each.

Breaks tried, and the tests that catch them:
- an ended sequence's cache cut at its committed count past what it emitted
  (``Decoder._kept_cache`` without ``min``): its length passes the context,
  test_an_ended_sequence_comes_back_as_one_record;
- a released sequence's record left out of its last tokens (``Row.cut`` not
  keeping what it cut): the same test;
- a batch's prompts padded to one row's smallest chunk (``smallest_chunk()``
  without the rows): test_rows_prefilled_together_take_smaller_chunks.
"""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import CostCurve, Sampling, prefilling
from dspark_fn.buffers import capacity_for
from dspark_fn.stats import Tally
from helpers import (
    build_bigram_draft,
    build_pair,
    build_target,
    damp_attention,
    mlx_lm_greedy,
    random_prompt,
    speculative_tokens,
    target_config,
)

CONFIG = target_config("qwen3", vocab=128, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
NEW_TOKENS = 40
LENGTHS = (1, 13, 70, 6)


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return root, build_pair(root, CONFIG, block_size=4)


@pytest.fixture(scope="module")
def pair(pair_dir):
    root, model = pair_dir
    return model, dspark_fn.load(root / "target", root / "draft")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [random_prompt(rng, length, CONFIG["vocab_size"]) for length in LENGTHS]


def rows_of(events, batch):
    streams = [[] for _ in range(batch)]
    for event in events:
        streams[event.tag] += event.emitted
    return streams


@pytest.mark.parametrize("width", [None, 2, "auto"])
def test_batched_greedy_rows_equal_their_single_runs(pair, prompts, width):
    model, params = pair
    costs = CostCurve(0.1, {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2, 5: 1.3})
    batched = rows_of(dspark_fn.generate(params, prompts, NEW_TOKENS, width=width, costs=costs), len(prompts))
    for prompt, row in zip(prompts, batched):
        assert row == speculative_tokens(params, prompt, NEW_TOKENS, width=width, costs=costs)
        assert row == mlx_lm_greedy(model, prompt, NEW_TOKENS)


def test_rows_prefilled_together_take_smaller_chunks(pair, monkeypatch):
    """A chunk's matmuls take rows x chunk tokens, so eight short prompts
    prefill in chunks of ``LINEAR_PREFILL_CHUNK`` where one alone takes
    ``smallest_chunk()`` (64 over OpenBLAS: eight rows padded to it cost six
    times as much); each row's first token is the one it gets alone."""
    model, params = pair
    widths, kernel_for = [], prefilling._chunk_kernel

    def counted(*args, **options):
        kernel = kernel_for(*args, **options)

        def run(target, draft, cache, tokens, *rest):
            widths.append(tokens.shape)
            return kernel(target, draft, cache, tokens, *rest)

        return run

    monkeypatch.setattr(prefilling, "_chunk_kernel", counted)
    rng = np.random.default_rng(4)
    prompts = [random_prompt(rng, length, CONFIG["vocab_size"]) for length in (5, 9, 3, 12, 7, 2, 8, 11)]
    _, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, len(prompts), 256), prompts)
    assert widths == [(8, prefilling.LINEAR_PREFILL_CHUNK)] * 2
    assert first.tolist() == [mlx_lm_greedy(model, prompt, 1)[0] for prompt in prompts]
    widths.clear()
    dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), prompts[0])
    assert widths == [(1, prefilling.smallest_chunk())]


def test_finished_rows_stop_while_the_others_go_on(pair, prompts):
    _, params = pair
    alone = [speculative_tokens(params, p, NEW_TOKENS) for p in prompts]
    # a stop token that row 0 emits early and the other rows never emit
    stop = next(t for t in alone[0][1:] if all(t not in row for row in alone[1:]))
    events = list(dspark_fn.generate(params, prompts, NEW_TOKENS, stop_tokens=[stop]))
    batched = rows_of(events, len(prompts))
    assert batched[0] == alone[0][: alone[0].index(stop) + 1]
    assert batched[1:] == alone[1:]
    last_round_of_row_0 = max(i for i, e in enumerate(events) if e.tag == 0)
    assert any(e.tag != 0 and e.kind == "round" for e in events[last_round_of_row_0 + 1 :])


@pytest.fixture(scope="module")
def accepted_pair(tmp_path_factory):
    """A damped target its bigram draft predicts often (and not always)."""
    root = tmp_path_factory.mktemp("batch_accepted")
    model = damp_attention(root / "target", build_target(root / "target", CONFIG, seed=3, gain=2.0), 0.05)
    build_bigram_draft(root / "draft", CONFIG, model, [1], layers=1, taps=(0, 1), block_size=4)
    return model, dspark_fn.load(root / "target", root / "draft")


@pytest.mark.parametrize("width", [None, "auto"])
def test_batched_rows_with_accepted_drafts_equal_the_target(accepted_pair, prompts, width):
    """Rows accept different numbers of drafts in the same round; each row
    still decodes exactly the target's greedy stream."""
    model, params = accepted_pair
    costs = CostCurve(0.05, {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08})
    events = list(dspark_fn.generate(params, prompts, NEW_TOKENS, width=width, costs=costs))
    assert rows_of(events, len(prompts)) == [mlx_lm_greedy(model, p, NEW_TOKENS) for p in prompts]
    rounds = [e for e in events if e.kind == "round"]
    assert sum(e.accepted for e in rounds) > len(rounds) // 2
    per_round = {}
    for index, event in enumerate(rounds):  # events of one round come in row order
        if event.tag == 0 or index == 0 or event.tag <= rounds[index - 1].tag:
            per_round[len(per_round)] = []
        per_round[len(per_round) - 1].append(event.accepted)
    assert any(len(set(accepted)) > 1 for accepted in per_round.values()), "no round with uneven acceptance"


def test_speculate_commits_each_rows_own_right_prefix(accepted_pair, prompts):
    """Each row commits its anchor plus the drafts that match the target's
    greedy continuation of that row, computed apart by mlx-lm."""
    model, params = accepted_pair
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, len(prompts), 256), prompts)
    assert cache.length.tolist() == list(LENGTHS)
    committed = [list(p) for p in prompts]
    for _ in range(4):
        before = np.array(cache.length)
        anchors = tokens.tolist()
        cache, result = dspark_fn.speculate(params, cache, tokens)
        counts = []
        for row, (drafted, anchor) in enumerate(zip(result.drafted.tolist(), anchors)):
            truth = mlx_lm_greedy(model, committed[row] + [anchor], len(drafted))
            right = next((i for i, (a, b) in enumerate(zip(drafted, truth)) if a != b), len(drafted))
            counts.append(right + 1)
            committed[row] += [anchor] + drafted[:right]
        assert result.count.tolist() == counts
        assert (np.array(cache.length) == before + np.array(counts)).all()
        tokens = result.next_tokens
    assert len(set(len(c) - len(p) for c, p in zip(committed, prompts))) > 1  # uneven progress


def test_idle_rows_commit_nothing(pair, prompts):
    _, params = pair
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, len(prompts), 256), prompts)
    active = mx.array([True, False, True, False])
    cache, result = dspark_fn.speculate(params, cache, tokens, active=active)
    assert cache.length.tolist()[1::2] == list(LENGTHS[1::2])
    assert result.count.tolist()[1::2] == [0, 0]
    assert result.next_tokens.tolist()[1::2] == tokens.tolist()[1::2]
    assert (np.array(result.emitted)[1::2] == -1).all()


def test_sampled_rows_are_independent(pair, prompts):
    _, params = pair
    sampling = Sampling(1.0)

    def sample(batch_prompts):
        events = dspark_fn.generate(params, batch_prompts, 20, width=3, sampling=sampling, seed=5)
        return rows_of(events, len(batch_prompts))

    # a row's draws do not depend on what the other rows hold
    assert sample(prompts)[0] == sample([prompts[0]] + prompts[:0:-1])[0]
    # identical prompts are not copies of one another
    copies = sample([prompts[1]] * 4)
    assert len({tuple(row) for row in copies}) == 4


def test_cli_batch_json_rows_equal_the_library(pair_dir, pair, prompts, tmp_path, monkeypatch):
    """``dspark generate`` with repeated --prompt-tokens prints {"batch": [...]};
    sampled with --width auto at the prior's costs (the same decisions every
    run) it reproduces the library run of the same seed."""
    root, _ = pair_dir
    _, params = pair
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    flags = [a for p in prompts[:2] for a in ("--prompt-tokens", ",".join(map(str, p)))]
    options = ["--temp", "1.0", "--top-k", "5", "--seed", "3", "--width", "auto", "--costs", "prior"]
    command = [sys.executable, "-m", "dspark_fn.cli", "generate", "--model", root / "target",
               "--draft", root / "draft", "--max-tokens", "12", "--json", *flags, *options]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    batch = json.loads(result.stdout)["batch"]
    events = dspark_fn.generate(params, prompts[:2], 12, width="auto", sampling=Sampling(1.0, top_k=5), seed=3,
                                costs="prior")
    assert [row["tokens"] for row in batch] == rows_of(events, 2)


def same_round(a, b) -> bool:
    """Two steps give each sequence the same round, whatever rows the sequences sit in."""
    by_tag = lambda step: {e.tag: (e.emitted, e.accepted, e.drafted, e.width) for e in step.events()}  # noqa: E731
    return by_tag(a) == by_tag(b)


@pytest.mark.parametrize("width, pair_name", [(None, "accepted_pair"), ("auto", "accepted_pair"), ("auto", "pair")])
def test_a_resized_batch_goes_on_as_if_never_resized(request, prompts, width, pair_name):
    """Rows moved into a smaller, then a larger batch draft, accept and emit
    exactly what they would have in place (the pending proposal and the
    gate's measurements move with them: with a poor draft the gate has
    stopped drafting and stays stopped); a sequence inserted after the
    resize decodes the target's greedy stream."""
    model, params = request.getfixturevalue(pair_name)
    costs = CostCurve(0.05, {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08})

    def started():
        decoder = dspark_fn.Decoder(params, 4, width=width, costs=costs)
        decoder.insert(prompts[:3])  # tags 0, 1, 2
        return decoder

    steady, moving = started(), started()
    for _ in range(3):
        assert same_round(steady.step(), moving.step())
    for decoder in (steady, moving):
        assert [decoder.release(tag).tag for tag in (0, 2)] == [0, 2]
    moving.resize(1)  # sequence 1 moves from row 1 to row 0
    for _ in range(3):
        kept, moved = steady.step(), moving.step()
        assert kept.tags == moved.tags == [1] and same_round(kept, moved)
    moving.resize(2)
    first = steady.insert([prompts[3]], tags=[3]).emitted  # in row 0, before sequence 1; moving: row 1, after it
    assert moving.insert([prompts[3]], tags=[3]).emitted == first
    joined = list(first[0])
    for _ in range(4):
        kept, moved = steady.step(), moving.step()
        assert (kept.tags, moved.tags) == ([3, 1], [1, 3]) and same_round(kept, moved)
        joined += moved.emitted[1]
    assert joined == mlx_lm_greedy(model, prompts[3], len(joined))


def test_resize_refuses_to_drop_active_rows(pair, prompts):
    _, params = pair
    decoder = dspark_fn.Decoder(params, 4, width=None)
    decoder.insert(prompts[:2])
    with pytest.raises(ValueError, match="2 active rows do not fit in a batch of 1"):
        decoder.resize(1)


def test_an_ended_sequence_comes_back_as_one_record(accepted_pair, prompts):
    """Sequences that end by their budget, by their stop token, or released,
    each come back once, as their events told it: tokens, finish reason,
    tally. The cache a sequence keeps holds its leading tokens (no more
    than it emitted, when its last round committed past its budget), in
    buffers of its own cut to their bucket, and a follow-up prefilled on it
    decodes the target's greedy stream."""
    model, params = accepted_pair
    truth = [mlx_lm_greedy(model, p, NEW_TOKENS) for p in prompts]
    stop = truth[1][5]
    alone = dspark_fn.Decoder(params, 1, width=None)  # rounds of a row do not depend on the other rows
    sizes = [len(alone.insert(prompts[:1]).emitted[0])] + [len(alone.step().emitted[0]) for _ in range(12)]
    cut = next(i for i, size in enumerate(sizes) if i and size >= 3)
    budget = sum(sizes[:cut]) + 1  # its last round commits at least 2 tokens past it
    decoder = dspark_fn.Decoder(params, 4, width=None)
    events, ended = {}, {}

    def take(step):
        for event in step.events():
            events.setdefault(event.tag, []).append(event)
        for record in step.ended:
            assert record.tag not in ended
            ended[record.tag] = record

    take(decoder.insert(prompts[:1], tags=["budget"], max_new_tokens=budget, keep_cache=True))
    take(decoder.insert(prompts[1:2], tags=["stop"], stop_tokens=[stop], keep_cache=True))
    take(decoder.insert(prompts[2:3], tags=["released"], keep_cache=True))
    for _ in range(3):
        take(decoder.step())
    ended["released"] = decoder.release("released")
    while decoder.busy:
        take(decoder.step())
    assert decoder.free == 4 and sorted(ended) == ["budget", "released", "stop"]
    assert (ended["budget"].finish, ended["budget"].tokens) == ("length", truth[0][:budget])
    assert int(ended["budget"].cache.length[0]) == len(ended["budget"].context)
    assert (ended["stop"].finish, ended["stop"].tokens) == ("stop", truth[1][: truth[1].index(stop) + 1])
    assert ended["released"].finish == "cancelled" and len(ended["released"].tokens) > 3
    for prompt, tag in zip(prompts, ["budget", "stop", "released"]):
        record = ended[tag]
        assert record.prompt == prompt and record.tokens == [t for e in events[tag] for t in e.emitted]
        assert record.tally.summary() == Tally.of(events[tag]).summary() and record.tally.rounds > 0
        length = int(record.cache.length[0])
        assert len(record.context) - 1 <= length <= len(record.context)
        assert (record.cache.batch_size, record.cache.capacity) == (1, capacity_for(length))
        follow_up = record.context[:length] + [3]
        fresh = dspark_fn.Decoder(params, 1, width=None)
        resumed = fresh.insert([follow_up], prefix=record.cache).emitted[0]
        while len(resumed) < 12:
            resumed += fresh.step().emitted[0]
        assert resumed == mlx_lm_greedy(model, follow_up, len(resumed)), tag
