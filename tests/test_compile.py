"""Compile-first, proven: kernels trace once per (pair, width, capacity bucket), not per round or prompt."""

import numpy as np
import pytest

import dspark_fn
from dspark_fn import TRACE_COUNTS
from helpers import build_draft, build_target, draft_config, random_prompt, speculative_tokens, target_config


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    config = target_config("qwen3", vocab=192, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16)
    build_target(root / "target", config, seed=7)
    build_draft(root / "draft", draft_config(config, taps=(0, 2), block_size=4), seed=7)
    return dspark_fn.load(root / "target", root / "draft")


def traces_during(fn):
    before = TRACE_COUNTS.copy()
    fn()
    return {k: TRACE_COUNTS[k] - before[k] for k in TRACE_COUNTS if TRACE_COUNTS[k] != before[k]}


def test_long_generation_traces_each_kernel_once(params):
    rng = np.random.default_rng(0)
    prompt = random_prompt(rng, 21, 192)
    events = []
    new = traces_during(lambda: events.extend(dspark_fn.generate(params, prompt, 200, capacity=512)))
    assert sum(e.kind == "round" for e in events) > 20
    assert new == {"prefill": 1, "draft": 1, "verify": 1}


def test_other_prompt_lengths_in_the_bucket_trace_nothing(params):
    rng = np.random.default_rng(1)
    speculative_tokens(params, random_prompt(rng, 21, 192), 50, capacity=512)
    for length in (3, 40, 64, 65, 130):
        prompt = random_prompt(rng, length, 192)
        assert traces_during(lambda: speculative_tokens(params, prompt, 50, capacity=512)) == {}


def test_a_new_width_traces_one_new_verify_kernel(params):
    prompt = random_prompt(np.random.default_rng(2), 10, 192)
    speculative_tokens(params, prompt, 20, capacity=512, width=2)
    assert traces_during(lambda: speculative_tokens(params, prompt, 20, capacity=512, width=2)) == {}
    assert traces_during(lambda: speculative_tokens(params, prompt, 20, capacity=512, width=3)) == {"verify": 1}
