"""The store as a live proposal source, side by side: on the held-out split
(``corpus/held-out.jsonl``: prompts whose answers the shipped store does not
hold), each family's prompts run through mlx-lm, the default without a store
(``--store none``) and the default with the shipped store (read, not learned:
every prompt sees the same store), in one run, medians of REPEATS; then, for
the server's case, each family's prompts answered twice by one decoder whose
store learns (an empty store first), the second pass's τ and time against the
first's.

    python bench/store_speed.py                # greedy, every family
    TEMPERATURE=0.7 python bench/store_speed.py

Environment: FAMILIES (default all five), N (prompts a family, default 8),
TOKENS (default 128), REPEATS (default 2), TEMPERATURE (default 0: greedy,
tokens compared with mlx-lm's), REPEATED (default 1; 0 leaves out the
learning store's two passes).
"""

import os
import time

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls
from dspark_fn.benchmark import run_side_by_side
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.sampling import Sampling
from dspark_fn.sources import StoredAnswers, default_sources
from dspark_fn.stats import Tally
from dspark_fn.store import DEFAULT_IDENTITY, DEFAULT_STORE, Store, load
from workloads import held_out_prompts

FAMILIES = os.environ.get("FAMILIES", "gsm8k,mbpp,math500,humaneval,mt-bench").split(",")
N = int(os.environ.get("N", 8))
TOKENS = int(os.environ.get("TOKENS", 128))
REPEATS = int(os.environ.get("REPEATS", 2))
TEMPERATURE = float(os.environ.get("TEMPERATURE", 0))
REPEATED = os.environ.get("REPEATED", "1") == "1"  # 0: the side-by-side table alone


def shares(summary: dict) -> str:
    """Share of rounds and τ per source: draft, copy, store, none."""
    sources = summary["sources"]
    return " / ".join(f"{name} {sources[name]['share']:.0%} τ {sources[name]['tau']:.2f}"
                      for name in ("draft", "copy", "store", "none") if name in sources)


def side_by_side(params, model, tokenizer, prompts: list, shipped: Store) -> None:
    sampled = {"sampling": Sampling(temperature=TEMPERATURE)} if TEMPERATURE else {}
    candidates = {
        "no store": (params, {"sources": default_sources()}),
        "shipped store": (params, {"sources": default_sources() + (StoredAnswers(shipped, learning=False),)}),
    }
    return run_side_by_side(candidates, model, prompts, TOKENS, stop_tokens(tokenizer), repeats=REPEATS, **sampled)


def repeated(params, tokenizer, prompts: list) -> tuple:
    """One learning store, the prompts answered twice: (τ, seconds) of each pass."""
    store = Store(params.spec.target.vocab_size, DEFAULT_IDENTITY)
    sources = default_sources(store)
    passes = []
    for _ in range(2):
        tally, start = Tally(), time.perf_counter()
        for prompt in prompts:
            for event in dspark_fn.generate(params, prompt, TOKENS, stop_tokens=stop_tokens(tokenizer),
                                            sources=sources):
                tally.count(event)
        passes.append((tally, time.perf_counter() - start))
    return passes


def main() -> None:
    params, tokenizer, config = load_named()
    model = mlx_lm_model(config, params.target)
    shipped = load(DEFAULT_STORE, params.spec.target.vocab_size, DEFAULT_IDENTITY)
    families = held_out_prompts()
    decoding = f"temperature {TEMPERATURE}" if TEMPERATURE else "greedy"
    print(f"held-out split, embedded default, {decoding}, {N} prompts a family, {TOKENS} new tokens, "
          f"medians of {REPEATS}\n")
    print("| family | mlx-lm tokens/s | no store: tokens/s, speedup, τ | shipped store: tokens/s, speedup, τ | "
          "identical | rounds with the store |\n|---|---|---|---|---|---|")
    for family in FAMILIES:
        prompts = [chat_tokens(tokenizer, text) for text in families[family][:N]]
        results = side_by_side(params, model, tokenizer, prompts, shipped)
        plain, stored = (results[name].summary() for name in ("no store", "shipped store"))
        identical = plain["identical"] and stored["identical"]
        print(f"| {family} | {plain['baseline_tokens_per_s']:.1f} | {plain['dspark_tokens_per_s']:.1f}, "
              f"{plain['speedup']:.2f}×, {plain['tau']:.2f} | {stored['dspark_tokens_per_s']:.1f}, "
              f"{stored['speedup']:.2f}×, {stored['tau']:.2f} | {identical} | {shares(stored)} |", flush=True)
    if TEMPERATURE or not REPEATED:
        return
    print("\nA store that learns, each family's prompts answered twice (an empty store first):\n")
    print("| family | first pass: τ, seconds | second pass: τ, seconds | second pass's rounds |\n|---|---|---|---|")
    for family in FAMILIES:
        prompts = [chat_tokens(tokenizer, text) for text in families[family][:N]]
        (first, first_s), (second, second_s) = repeated(params, tokenizer, prompts)
        print(f"| {family} | {first.tau:.2f}, {first_s:.1f} | {second.tau:.2f}, {second_s:.1f} | "
              f"{shares(second.summary())} |", flush=True)


if __name__ == "__main__":
    main()
