"""Verify width (fixed vs auto) and batching (one batch vs sequential runs vs
mlx-lm's batched greedy), on one tiny random target, in one process.

Run: python -m pytest bench/test_bench_sampling.py --benchmark-only (about two minutes)

The target is a random qwen3 from tests/helpers.py with its attention damped,
so a bigram draft of it is right part of the time (random weights otherwise
never agree). ``extra_info`` of every result holds tau (tokens per verify
round) and tokens/s (all rows' tokens over the median time).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import dspark_fn
from dspark_fn import Sampling
from dspark_fn.stats import Tally

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import build_bigram_draft, build_target, damp_attention, random_prompt, target_config  # noqa: E402

NEW_TOKENS = 96
CONFIG = target_config("qwen3", vocab=256, hidden=64, layers=6)
SAMPLINGS = {"greedy": Sampling(), "T=1": Sampling(1.0)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_sampling")
    model = build_target(root / "target", CONFIG, seed=3, gain=2.0)
    damp_attention(root / "target", model, 0.05)
    build_bigram_draft(root / "draft", CONFIG, model, [1], layers=1, taps=(1, 3), block_size=7)
    return model, dspark_fn.load(root / "target", root / "draft")


def prompts_for(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    return [random_prompt(rng, int(length), CONFIG["vocab_size"]) for length in rng.integers(8, 40, size=batch)]


def dspark_rows(params, prompts, acceptance=None, **options):
    """Every row's tokens and the acceptance over all rounds of one batched run."""
    rows, acceptance = [[] for _ in prompts], acceptance or Tally()
    for event in dspark_fn.generate(params, prompts, NEW_TOKENS, **options):
        rows[event.tag] += event.emitted
        acceptance.count(event)
    return rows, acceptance


def dspark_sequential(params, prompts, **options):
    acceptance = Tally()
    return [dspark_rows(params, [prompt], acceptance, **options)[0][0] for prompt in prompts], acceptance


def mlx_lm_batched(model, prompts):
    """mlx-lm's own batched greedy decoding (``BatchGenerator``)."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=NEW_TOKENS, stop_tokens=[])
    uids = generator.insert(prompts, [NEW_TOKENS] * len(prompts))
    rows = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            rows[response.uid].append(int(response.token))
    generator.close()
    return [rows[uid] for uid in uids], None


def measure(benchmark, run, rows_count: int):
    run()  # warm-up: compiles, and measures the cost curve for "auto"
    rows, acceptance = benchmark.pedantic(run, rounds=3, iterations=1)
    tokens = sum(len(row) for row in rows)
    assert tokens == rows_count * NEW_TOKENS
    benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median
    if acceptance is not None:
        benchmark.extra_info["tau"] = acceptance.tau
    return rows


@pytest.mark.benchmark(group="verify width: fixed vs auto")
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("width", [1, 2, 4, 8, "auto"], ids=str)
def test_verify_width(benchmark, pair, width, sampling):
    _, params = pair
    (prompt,) = prompts_for(1)
    measure(benchmark, lambda: dspark_rows(params, [prompt], width=width, sampling=SAMPLINGS[sampling], seed=1), 1)


@pytest.mark.benchmark(group="batched greedy")
@pytest.mark.parametrize("engine", ["dspark batched", "dspark sequential", "mlx-lm batched"])
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_batched(benchmark, pair, batch, engine):
    model, params = pair
    prompts = prompts_for(batch)
    runs = {
        "dspark batched": lambda: dspark_rows(params, prompts, width="auto"),
        "dspark sequential": lambda: dspark_sequential(params, prompts, width="auto"),
        "mlx-lm batched": lambda: mlx_lm_batched(model, prompts),
    }
    rows = measure(benchmark, runs[engine], batch)
    if engine != "mlx-lm batched":
        alone = [dspark_rows(params, [p])[0][0] for p in prompts]
        assert rows == alone  # greedy: each row equals its own single-prompt run
