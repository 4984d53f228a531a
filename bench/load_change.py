"""The widths the README's loop chooses when the machine gets busier mid-run.

One long generation through ``speculate(params, cache, tokens)`` on the
embedded default; after ROUNDS rounds, BUSY processes that spin on the
CPU start, and after as many more rounds they stop. Printed for each
stretch: the rounds, the kernels compiled in it, the share of rounds at
each width and source, the tokens per second, and the round costs the policy had learned by its end
(a draft pass and a verify of each width, ms).

    python bench/load_change.py                 # ROUNDS=60 a stretch, BUSY=2 spinning processes

Environment: ROUNDS (default 60), BUSY (default 2), PROMPT (default a
chat question).
"""

import multiprocessing
import os
import time
from collections import Counter

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens
from dspark_fn.kernel import compilations
from dspark_fn.schedule import Settings

ROUNDS = int(os.environ.get("ROUNDS", 60))
BUSY = int(os.environ.get("BUSY", 2))
PROMPT = os.environ.get("PROMPT", "Write a long, detailed essay on the history of the bicycle, with dates.")


def spin() -> None:
    while True:
        pass


def stretch(params, cache, tokens, rounds: int) -> tuple:
    """``rounds`` rounds of the README's loop: ``(cache, tokens, widths, sources, emitted, seconds)``."""
    widths, sources, emitted, start = Counter(), Counter(), 0, time.perf_counter()
    for _ in range(rounds):
        if int(cache.length.max()) + params.spec.block_size + 1 > cache.capacity:
            cache = dspark_fn.grow_cache(params, cache, 2 * cache.capacity)
        cache, step = dspark_fn.speculate(params, cache, tokens)
        widths[step.emitted.shape[1]] += 1
        sources[step.sources[0] or "none"] += 1
        emitted += step.count.item()
        tokens = step.next_tokens
    return cache, tokens, widths, sources, emitted, time.perf_counter() - start


def shares(counts: Counter) -> str:
    total = sum(counts.values())
    return ", ".join(f"{key} {count / total:.0%}" for key, count in sorted(counts.items(), key=str))


def main() -> None:
    params, tokenizer, _ = load_named()
    buckets = Settings(params.spec.block_size).buckets
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 1024), chat_tokens(tokenizer, PROMPT))
    cache, tokens, *_ = stretch(params, cache, tokens, 12)  # compile the kernels outside the stretches
    print(f"| stretch | rounds | kernels compiled | widths | sources | tokens/s | learned costs, ms: draft / verify by width |")
    print("|---|---|---|---|---|---|---|")
    for name in ("quiet", f"{BUSY} spinning processes", "quiet again"):
        spinning = [multiprocessing.Process(target=spin, daemon=True) for _ in range(BUSY if "spinning" in name else 0)]
        for process in spinning:
            process.start()
        compiled = compilations()
        cache, tokens, widths, sources, emitted, seconds = stretch(params, cache, tokens, ROUNDS)
        compiled = compilations() - compiled  # rounds that compiled a kernel teach nothing of costs
        for process in spinning:
            process.terminate()
        curve = cache.policy.costs.curve(1, False, buckets)
        costs = f"{1e3 * curve.draft:.0f} / " + " ".join(f"{w}: {1e3 * s:.0f}" for w, s in curve.verify.items())
        print(f"| {name} | {ROUNDS} | {compiled} | {shares(widths)} | {shares(sources)} | {emitted / seconds:.1f} | {costs} |",
              flush=True)


if __name__ == "__main__":
    main()
