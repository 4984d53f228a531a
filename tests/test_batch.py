"""Batched speculation: rows of different lengths decode side by side, each as if alone."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import CostCurve, Sampling
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
        streams[event.row] += event.emitted
    return streams


@pytest.mark.parametrize("width", [None, 2, "auto"])
def test_batched_greedy_rows_equal_their_single_runs(pair, prompts, width):
    model, params = pair
    costs = CostCurve(0.1, {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2, 5: 1.3})
    batched = rows_of(dspark_fn.generate(params, prompts, NEW_TOKENS, width=width, costs=costs), len(prompts))
    for prompt, row in zip(prompts, batched):
        assert row == speculative_tokens(params, prompt, NEW_TOKENS, width=width, costs=costs)
        assert row == mlx_lm_greedy(model, prompt, NEW_TOKENS)


def test_finished_rows_stop_while_the_others_go_on(pair, prompts):
    _, params = pair
    alone = [speculative_tokens(params, p, NEW_TOKENS) for p in prompts]
    # a stop token that row 0 emits early and the other rows never emit
    stop = next(t for t in alone[0][1:] if all(t not in row for row in alone[1:]))
    events = list(dspark_fn.generate(params, prompts, NEW_TOKENS, stop_tokens=[stop]))
    batched = rows_of(events, len(prompts))
    assert batched[0] == alone[0][: alone[0].index(stop) + 1]
    assert batched[1:] == alone[1:]
    last_round_of_row_0 = max(i for i, e in enumerate(events) if e.row == 0)
    assert any(e.row != 0 and e.kind == "round" for e in events[last_round_of_row_0 + 1 :])


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
        if event.row == 0 or index == 0 or event.row <= rounds[index - 1].row:
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
    sampled with --verify auto it reproduces the library run of the same seed."""
    root, _ = pair_dir
    _, params = pair
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    flags = [a for p in prompts[:2] for a in ("--prompt-tokens", ",".join(map(str, p)))]
    options = ["--temp", "1.0", "--top-k", "5", "--seed", "3", "--verify", "auto"]
    command = [sys.executable, "-m", "dspark_fn.cli", "generate", "--model", root / "target",
               "--draft", root / "draft", "--max-tokens", "12", "--json", *flags, *options]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    batch = json.loads(result.stdout)["batch"]
    events = dspark_fn.generate(params, prompts[:2], 12, width="auto", sampling=Sampling(1.0, top_k=5), seed=3)
    assert [row["tokens"] for row in batch] == rows_of(events, 2)


def same_round(a, b) -> bool:
    return (a.emitted, a.accepted, a.drafted, a.width) == (b.emitted, b.accepted, b.drafted, b.width)


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
        decoder.insert([0, 1, 2], prompts[:3])
        return decoder

    steady, moving = started(), started()
    for _ in range(3):
        assert same_round(steady.step(), moving.step())
    for decoder in (steady, moving):
        decoder.release(0)
        decoder.release(2)
    assert moving.resize(1) == {1: 0}
    for _ in range(3):
        kept, moved = steady.step(), moving.step()
        assert (kept.rows, moved.rows) == ([1], [0]) and same_round(kept, moved)
    assert moving.resize(2) == {0: 0}
    first = steady.insert([3], [prompts[3]]).emitted
    assert moving.insert([1], [prompts[3]]).emitted == first
    joined = list(first[0])
    for _ in range(4):
        kept, moved = steady.step(), moving.step()
        assert (kept.rows, moved.rows) == ([1, 3], [0, 1]) and same_round(kept, moved)
        joined += moved.emitted[1]
    assert joined == mlx_lm_greedy(model, prompts[3], len(joined))


def test_resize_refuses_to_drop_active_rows(pair, prompts):
    _, params = pair
    decoder = dspark_fn.Decoder(params, 4, width=None)
    decoder.insert([0, 3], prompts[:2])
    with pytest.raises(ValueError, match="2 active rows do not fit in a batch of 1"):
        decoder.resize(1)
