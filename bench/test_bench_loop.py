"""The README's own loop (``speculate(params, cache, tokens)``) beside
``generate`` and mlx-lm greedy, on held-out prompts of every family, the
embedded default's weights, under pytest-benchmark; every engine's tokens
are compared with mlx-lm's.

Run: python -m pytest bench/test_bench_loop.py --benchmark-only
(``bench/loop_speed.py`` prints the same comparison as a table, by family.)
"""

import pytest

from loop_speed import engines
from workloads import held_out_prompts

FAMILIES = ("gsm8k", "humaneval", "mbpp", "math500", "mt-bench")
PROMPTS = 2  # a family
TOKENS = 96


@pytest.fixture(scope="module")
def default_pair():
    from dspark_fn.catalog import load_named
    from dspark_fn.chat import chat_tokens, stop_tokens
    from dspark_fn.checkpoints import mlx_lm_model
    from dspark_fn.gguf import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except (FileNotFoundError, ValueError) as missing:
        pytest.skip(f"the embedded default is not installed ({missing})")
    params, tokenizer, config = load_named()
    runs = engines(params, mlx_lm_model(config, params.target))
    prompts = {family: [chat_tokens(tokenizer, text) for text in texts[:PROMPTS]]
               for family, texts in held_out_prompts().items()}
    stop = set(stop_tokens(tokenizer))
    for run in runs.values():  # compile outside the timings
        run(prompts["gsm8k"][0], 16, stop)
    return runs, prompts, stop


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", ["mlx-lm greedy", "README loop", "generate"])
def test_loop(benchmark, default_pair, family, engine):
    runs, prompts, stop = default_pair
    benchmark.group = f"held-out {family}: the README's loop vs generate vs mlx-lm"

    def answers():
        return [runs[engine](prompt, TOKENS, stop) for prompt in prompts[family]]

    tokens = benchmark.pedantic(answers, rounds=3, iterations=1)
    assert tokens == [runs["mlx-lm greedy"](prompt, TOKENS, stop) for prompt in prompts[family]]
