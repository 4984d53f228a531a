"""OpenBLAS's thread count against the cores actually free, for both engines.

For each number of processes spinning on the CPU beside it (BUSY, default
0 1 2) and each OpenBLAS thread count (THREADS, default 1 2), a fresh
process (the thread count is read when OpenBLAS loads) decodes the same
prompts with mlx-lm greedy and with ``generate`` on the embedded default,
and prints tokens/s for each: the medians of REPEATS passes.

    python bench/busy_cpu.py

Environment: BUSY, THREADS (space-separated), PROMPTS (default 3 gsm8k and
mt-bench prompts of the held-out split), TOKENS (default 64), REPEATS
(default 3).
"""

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

BUSY = [int(n) for n in os.environ.get("BUSY", "0 1 2").split()]
THREADS = [int(n) for n in os.environ.get("THREADS", "1 2").split()]
TOKENS = int(os.environ.get("TOKENS", 64))
REPEATS = int(os.environ.get("REPEATS", 3))


def spin() -> None:
    while True:
        pass


def measure() -> dict:
    """In a process of its own: tokens/s of each engine, medians over REPEATS passes."""
    import dspark_fn  # noqa: F401  before mlx
    from dspark_fn.benchmark import baseline_tokens, dspark_tokens
    from dspark_fn.catalog import load_named
    from dspark_fn.chat import chat_tokens, stop_tokens
    from dspark_fn.checkpoints import mlx_lm_model
    from workloads import held_out_prompts

    params, tokenizer, config = load_named()
    model = mlx_lm_model(config, params.target)
    stop = set(stop_tokens(tokenizer))
    split = held_out_prompts()
    prompts = [chat_tokens(tokenizer, text) for family in ("gsm8k", "mt-bench") for text in split[family][:2]]
    engines = {"mlx-lm": lambda p: baseline_tokens(model, p, TOKENS, stop),
               "generate": lambda p: dspark_tokens(params, p, TOKENS, stop)}
    for run in engines.values():
        run(prompts[0])
    speeds = {name: [] for name in engines}
    for _ in range(REPEATS):
        for name, run in engines.items():
            start, count = time.perf_counter(), sum(len(run(p)) for p in prompts)
            speeds[name].append(count / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in speeds.items()}


def main() -> None:
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
        return
    print("| processes spinning beside | OpenBLAS threads | mlx-lm tokens/s | generate tokens/s |\n|---|---|---|---|")
    for busy in BUSY:
        for threads in THREADS:
            spinning = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
            for process in spinning:
                process.start()
            try:
                done = subprocess.run([sys.executable, __file__, "--measure"], capture_output=True, text=True,
                                      env=os.environ | {"OPENBLAS_NUM_THREADS": str(threads)}, check=True)
            finally:
                for process in spinning:
                    process.terminate()
            speeds = json.loads(done.stdout.splitlines()[-1])
            print(f"| {busy} | {threads} | {speeds['mlx-lm']:.1f} | {speeds['generate']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
