"""What a round of ``generate`` costs when the decisions are held fixed:
the first N held-out prompts of one family, 128 tokens each, greedy, with
the round costs given (``COSTS``, so the planner decides the same in every
run and every tree) or learned (``COSTS`` unset); two passes, each printing
tokens/s, rounds, tau, milliseconds a round and the rounds by source, and
(costs learned) the costs learned by the end of the pass.

    python bench/same_decisions.py
    COSTS='{"draft": 0.0112, "verify": {"1": 0.0675, "2": 0.08, "3": 0.0944, "4": 0.1107, "6": 0.1179}}' \\
        python bench/same_decisions.py
    PYTHONPATH=<an earlier checkout> python bench/same_decisions.py     # the same in another tree

Environment: FAMILY (default gsm8k), N (default 3), COSTS (JSON: a draft
pass's seconds and each verify width's).
"""

import os
import time

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls
from dspark_fn.benchmark import dspark_tokens
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.costs import RoundCosts
from dspark_fn.schedule import width_buckets
from dspark_fn.stats import Tally
from workloads import cost_curve, held_out_prompts

FAMILY = os.environ.get("FAMILY", "gsm8k")
N = int(os.environ.get("N", 3))
TOKENS = 128


def given_costs() -> dict:
    return {"costs": cost_curve(os.environ["COSTS"])} if os.environ.get("COSTS") else {}


def main() -> None:
    params, tokenizer, _ = load_named()
    stop, options = set(stop_tokens(tokenizer)), given_costs()
    prompts = [chat_tokens(tokenizer, text) for text in held_out_prompts()[FAMILY][:N]]
    dspark_tokens(params, chat_tokens(tokenizer, "Warm up: say hello."), 16, stop, **options)
    for _ in range(2):
        tally, produced, start = Tally(), 0, time.perf_counter()
        for prompt in prompts:
            produced += len(dspark_tokens(params, prompt, TOKENS, stop, acceptance=tally, **options))
        seconds = time.perf_counter() - start
        print(f"{produced / seconds:.1f} tokens/s, {tally.rounds} rounds, tau {tally.emitted / tally.rounds:.2f}, "
              f"{1e3 * seconds / tally.rounds:.0f} ms a round | {tally.sources_line()}", flush=True)
        if not options:
            print(f"  learned, ms: {learned_line(params)}", flush=True)


def learned_line(params) -> str:
    """The costs the pair's rounds have learned in this process, for one greedy row."""
    curve = RoundCosts.start(params).curve(1, False, width_buckets(params.spec.block_size))
    widths = " ".join(f"{width}: {1e3 * seconds:.0f}" for width, seconds in curve.verify.items())
    return f"draft {1e3 * curve.draft:.1f} / verify by width {widths}"


if __name__ == "__main__":
    main()
