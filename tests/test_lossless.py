"""Greedy DSpark output is token-identical to the target decoding alone (mlx-lm)."""

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from helpers import build_draft, build_target, draft_config, mlx_lm_greedy, random_prompt, speculative_tokens, target_config

pytestmark = pytest.mark.numerics  # rerun on the bundled BLAS by .ci/run

NEW_TOKENS = 200

SHAPES = {
    "qwen3": target_config("qwen3", vocab=256, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16),
    "qwen3-mha-untied": target_config("qwen3", vocab=320, hidden=48, layers=4, heads=3, kv_heads=3, head_dim=16, tied=False),
    "llama": target_config("llama", vocab=200, hidden=64, layers=5, heads=8, kv_heads=2, head_dim=8),
    "qwen2": target_config("qwen2", vocab=256, hidden=64, layers=4, heads=4, kv_heads=1, head_dim=16),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    config = SHAPES[request.param]
    model = build_target(root / "target", config, seed=len(request.param))
    last = config["num_hidden_layers"] - 2
    build_draft(root / "draft", draft_config(config, taps=(0, last), block_size=5), seed=1)
    return model, dspark_fn.load(root / "target", root / "draft"), config["vocab_size"]


@pytest.mark.parametrize("prompt_length", [1, 13, 70, 600])
def test_generate_equals_target_greedy(pair, prompt_length):
    model, params, vocab = pair
    prompt = random_prompt(np.random.default_rng(prompt_length), prompt_length, vocab)
    expected = mlx_lm_greedy(model, prompt, NEW_TOKENS)
    assert speculative_tokens(params, prompt, NEW_TOKENS) == expected


@pytest.mark.parametrize("width", [1, 3])
def test_every_verify_width_is_lossless(pair, width):
    model, params, vocab = pair
    prompt = random_prompt(np.random.default_rng(5), 9, vocab)
    assert speculative_tokens(params, prompt, 60, width=width) == mlx_lm_greedy(model, prompt, 60)


def wrong_token(token: int, vocab: int) -> int:
    return (token + 1) % vocab


PROPOSALS = {
    "always-right": lambda truth, r, vocab: truth,
    "always-wrong": lambda truth, r, vocab: [wrong_token(t, vocab) for t in truth],
    # right for the first (round % width) slots, then wrong
    "partly-right": lambda truth, r, vocab: [
        t if i < r % (len(truth) + 1) else wrong_token(t, vocab) for i, t in enumerate(truth)
    ],
}


@pytest.mark.parametrize("kind", sorted(PROPOSALS))
def test_verify_keeps_exactly_the_right_prefix(pair, kind):
    """Drive rounds with proposals built from the target's own greedy stream."""
    model, params, vocab = pair
    width = params.spec.block_size + 1
    prompt = random_prompt(np.random.default_rng(11), 17, vocab)
    truth = mlx_lm_greedy(model, prompt, NEW_TOKENS + width)
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 512), prompt)
    out, r = tokens.tolist(), 0
    while len(out) < NEW_TOKENS:
        proposal = PROPOSALS[kind](truth[len(out) : len(out) + width - 1], r, vocab)
        block = mx.array([[out[-1]] + proposal], mx.int32)
        cache, result = dspark_fn.verify_block(params, cache, block)
        count = result.count.item()
        right = next((i for i, (a, b) in enumerate(zip(proposal, truth[len(out):])) if a != b), len(proposal))
        assert count == right + 1
        out += result.emitted[0, :count].tolist()
        tokens, r = result.next_tokens, r + 1
    assert out[:NEW_TOKENS] == truth[:NEW_TOKENS]
    if kind == "always-right":
        assert r == -(-(NEW_TOKENS - 1) // width)
    if kind == "always-wrong":
        assert r == NEW_TOKENS - 1


def test_stop_token_ends_generation_inclusive(pair):
    model, params, vocab = pair
    prompt = random_prompt(np.random.default_rng(3), 8, vocab)
    expected = mlx_lm_greedy(model, prompt, 80)
    stop = expected[37]
    cut = expected.index(stop) + 1
    assert speculative_tokens(params, prompt, 80, stop_tokens=[stop]) == expected[:cut]


@pytest.mark.parametrize("budget", [1, 2, 33])
def test_max_new_tokens_is_exact(pair, budget):
    model, params, vocab = pair
    prompt = random_prompt(np.random.default_rng(4), 6, vocab)
    assert speculative_tokens(params, prompt, budget) == mlx_lm_greedy(model, prompt, budget)
