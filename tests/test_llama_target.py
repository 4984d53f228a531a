"""The llama-family target adapter (llama, qwen2, qwen3) against mlx-lm's own
models on the same weights: logits after prefill, decode and rollback."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn.checkpoints import load_target
from helpers import TargetRunner, build_target, random_prompt, target_config
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics

SHAPES = {
    "llama": target_config("llama", vocab=200, hidden=64, layers=5, heads=8, kv_heads=2, head_dim=8, tied=False),
    "qwen2": target_config("qwen2", vocab=256, hidden=64, layers=4, heads=4, kv_heads=1, head_dim=16),
    "qwen3": target_config("qwen3", vocab=256, hidden=48, layers=4, heads=3, kv_heads=3, head_dim=16, tied=False),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config = SHAPES[request.param]
    # non-unit norm weights: code that ignores one of them fails
    model = build_target(directory, config, seed=5, gain=1.5, vector_spread=0.4)
    adapter, spec, params, _ = load_target(directory)
    return config, model, adapter, spec, params


def close(actual, expected, what, config):
    assert_fp32_close(actual, expected, what, layers=config["num_hidden_layers"], reduction=128)


def test_prefill_and_decode_match_mlx_lm(target):
    config, model, adapter, spec, params = target
    rng = np.random.default_rng(0)
    prompt = random_prompt(rng, 37, config["vocab_size"])
    cache = make_prompt_cache(model)
    ours = TargetRunner(adapter, spec, params)
    close(ours(prompt, 0), np.array(model(mx.array([prompt]), cache=cache)[0]), "prefill logits", config)
    length = len(prompt)
    for step in range(5):
        token = int(rng.integers(0, config["vocab_size"]))
        expected = np.array(model(mx.array([[token]]), cache=cache)[0])
        close(ours([token], length), expected, f"decode step {step}", config)
        length += 1


def test_rollback_matches_an_uncached_forward(target):
    """Verify a block, keep a prefix by position only, verify again."""
    config, model, adapter, spec, params = target
    rng = np.random.default_rng(1)
    committed = random_prompt(rng, 20, config["vocab_size"])
    ours = TargetRunner(adapter, spec, params)
    ours(committed, 0)
    for kept in (3, 0, 5):
        block = random_prompt(rng, 6, config["vocab_size"])
        expected = np.array(model(mx.array([committed + block]))[0])[-len(block):]
        close(ours(block, len(committed)), expected, f"verify after keeping {kept}", config)
        committed += block[:kept]
