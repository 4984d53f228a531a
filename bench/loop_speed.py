"""The README's own decoding loop beside ``generate`` and mlx-lm greedy, on
the held-out split (``corpus/held-out.jsonl``), the same fp32 weights, one
process, each family's prompts through all three in turn, medians of
REPEATS; every engine's tokens compared with mlx-lm's.

The loop is the README's, as printed: ``speculate(params, cache, tokens)``
with no other argument, after ``init_cache`` and ``prefill``; it stops at
the end-of-turn token and grows the cache as the README shows.

    python bench/loop_speed.py                 # every family, 6 prompts, 96 tokens, 3 repeats

Environment: FAMILIES (default all five), N (prompts a family, default 6),
TOKENS (default 96), REPEATS (default 3). ``bench/test_bench_loop.py`` runs
the same three engines under pytest-benchmark.
"""

import os
import statistics
import time

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls
from dspark_fn.benchmark import baseline_tokens, dspark_tokens
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.checkpoints import mlx_lm_model
from workloads import held_out_prompts

FAMILIES = os.environ.get("FAMILIES", "gsm8k,humaneval,mbpp,math500,mt-bench").split(",")
N = int(os.environ.get("N", 6))
TOKENS = int(os.environ.get("TOKENS", 96))
REPEATS = int(os.environ.get("REPEATS", 3))


def readme_loop(params, prompt: list, max_new_tokens: int, stop: set) -> list:
    """The README's loop: prefill, then ``speculate(params, cache, tokens)``
    until the end of the turn or the budget, growing the cache when full."""
    cache = dspark_fn.init_cache(params, batch_size=1, capacity=256)
    cache, tokens = dspark_fn.prefill(params, cache, prompt, grow=True)
    out = tokens.tolist()
    while not stop & set(out) and len(out) < max_new_tokens:
        if cache.capacity - int(cache.length[0]) <= params.spec.block_size:  # room for the widest round
            cache = dspark_fn.grow_cache(params, cache, 2 * cache.capacity)
        cache, step = dspark_fn.speculate(params, cache, tokens)
        out += step.emitted[0, : step.count.item()].tolist()
        tokens = step.next_tokens
    return cut(out, max_new_tokens, stop)


def cut(tokens: list, budget: int, stop: set) -> list:
    """Tokens up to the first stop token (kept) and the budget."""
    tokens = tokens[:budget]
    end = next((i for i, token in enumerate(tokens) if token in stop), None)
    return tokens if end is None else tokens[: end + 1]


def engines(params, model) -> dict:
    """Each engine as ``(prompt, max_new_tokens, stop) -> tokens``."""
    return {
        "mlx-lm greedy": lambda prompt, n, stop: baseline_tokens(model, prompt, n, stop),
        "README loop": lambda prompt, n, stop: readme_loop(params, prompt, n, stop),
        "generate": lambda prompt, n, stop: dspark_tokens(params, prompt, n, stop),
    }


def family_speeds(runs: dict, prompts: list, stop: set) -> tuple[dict, bool]:
    """Tokens/s of each engine over ``prompts`` per repeat (the order rotating
    by repeat), and whether every engine gave mlx-lm's tokens."""
    names = list(runs)
    speeds, identical = {name: [] for name in names}, True
    for repeat in range(REPEATS):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        counts = {name: [0, 0.0] for name in names}
        answers = {name: [] for name in names}
        for prompt in prompts:
            for name in order:
                start = time.perf_counter()
                tokens = runs[name](prompt, TOKENS, stop)
                counts[name][1] += time.perf_counter() - start
                counts[name][0] += len(tokens)
                answers[name].append(tokens)
        identical &= all(answers[name] == answers["mlx-lm greedy"] for name in names)
        for name, (count, seconds) in counts.items():
            speeds[name].append(count / seconds)
    return {name: statistics.median(values) for name, values in speeds.items()}, identical


def main() -> None:
    params, tokenizer, config = load_named()
    model = mlx_lm_model(config, params.target)
    stop = set(stop_tokens(tokenizer))
    runs = engines(params, model)
    families = held_out_prompts()
    warm = chat_tokens(tokenizer, "Warm up: say hello.")
    for run in runs.values():  # compile outside the timings
        run(warm, 16, stop)
    print(f"held-out split, embedded default, greedy, {N} prompts a family, {TOKENS} new tokens, "
          f"medians of {REPEATS}\n")
    print("| family | mlx-lm tokens/s | README loop tokens/s (vs mlx-lm) | generate tokens/s (vs mlx-lm) | "
          "loop / generate | identical |\n|---|---|---|---|---|---|", flush=True)
    for family in FAMILIES:
        prompts = [chat_tokens(tokenizer, text) for text in families[family][:N]]
        speeds, identical = family_speeds(runs, prompts, stop)
        base, loop, gen = (speeds[name] for name in ("mlx-lm greedy", "README loop", "generate"))
        print(f"| {family} | {base:.1f} | {loop:.1f} ({loop / base:.2f}x) | {gen:.1f} ({gen / base:.2f}x) | "
              f"{loop / gen:.2f} | {'yes' if identical else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
