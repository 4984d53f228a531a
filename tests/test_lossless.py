"""Greedy DSpark output is token-identical to the target decoding alone (mlx-lm)."""

import numpy as np
import pytest

import dspark_fn
from helpers import (
    PROPOSALS, build_draft, build_target, draft_config, drive_proposals, mlx_lm_greedy, random_prompt, speculative_tokens,
    target_config,
)

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


@pytest.mark.parametrize("kind", sorted(PROPOSALS))
def test_verify_keeps_exactly_the_right_prefix(pair, kind):
    """Drive rounds with proposals built from the target's own greedy stream."""
    model, params, vocab = pair
    width = params.spec.block_size + 1
    prompt = random_prompt(np.random.default_rng(11), 17, vocab)
    _, rounds = drive_proposals(model, params, vocab, [prompt], kind, NEW_TOKENS)
    if kind == "always-right":
        assert rounds == -(-(NEW_TOKENS - 1) // width)
    if kind == "always-wrong":
        assert rounds == NEW_TOKENS - 1


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
