"""Compiled vs eager rounds, and dspark generate vs mlx-lm greedy, on the same target.

Run: python -m pytest bench/test_bench_core.py --benchmark-only
"""

import pytest

from workloads import PARITY, dspark_generate, eager, fixture_pair, mlx_lm_generate

NEW_TOKENS = 128

pytestmark = pytest.mark.skipif(not PARITY.is_dir(), reason="parity fixtures not found")


@pytest.fixture(scope="module")
def pair():
    return fixture_pair()


@pytest.mark.benchmark(group="round: compiled vs eager")
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_round(benchmark, pair, mode):
    params, _, prompt = pair
    run = dspark_generate if mode == "compiled" else eager(dspark_generate)
    run(params, prompt, NEW_TOKENS)  # warm-up (traces the kernels)
    tokens = benchmark.pedantic(run, args=(params, prompt, NEW_TOKENS), rounds=5, iterations=1)
    assert len(tokens) == NEW_TOKENS


@pytest.mark.benchmark(group="generate: dspark vs mlx-lm greedy")
@pytest.mark.parametrize("engine", ["dspark_fn", "mlx_lm"])
def test_generate(benchmark, pair, engine):
    params, model, prompt = pair
    if engine == "dspark_fn":
        run, args = dspark_generate, (params, prompt, NEW_TOKENS)
    else:
        run, args = mlx_lm_generate, (model, prompt, NEW_TOKENS)
    run(*args)
    tokens = benchmark.pedantic(run, args=args, rounds=5, iterations=1)
    assert tokens == mlx_lm_generate(model, prompt, NEW_TOKENS)
