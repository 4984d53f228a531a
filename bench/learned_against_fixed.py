"""``generate`` with the round costs learned as rounds run against the same
``generate`` with fixed costs, in one process, prompt by prompt in turn:
do the decisions the learned costs lead to lose speed on some family?

With fixed costs the planner decides the same in every run (and, with
02639e2's calibrated costs, the default here, exactly as that commit's
planner did: BENCHMARK 0w), so the only difference between the two columns
is the costs the decisions are taken from. Taking turns prompt by prompt
in one process, both meet the same stretch of the machine's load, which a
comparison between processes cannot arrange.

    python bench/learned_against_fixed.py      # every family, N=4 prompts, 128 tokens, REPEATS=2

Environment: FAMILIES (default all five), N (default 4), TOKENS (default
128), REPEATS (default 2), COSTS (JSON: the fixed costs, a draft pass's
seconds and each verify width's).
"""

import os
import statistics

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls
from dspark_fn.benchmark import dspark_tokens
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.stats import Tally
from workloads import cost_curve, held_out_prompts, in_turn

FAMILIES = os.environ.get("FAMILIES", "gsm8k,humaneval,mbpp,math500,mt-bench").split(",")
N = int(os.environ.get("N", 4))
TOKENS = int(os.environ.get("TOKENS", 128))
REPEATS = int(os.environ.get("REPEATS", 2))
CALIBRATED = '{"draft": 0.0112, "verify": {"1": 0.0675, "2": 0.08, "3": 0.0944, "4": 0.1107, "6": 0.1179}}'


def main() -> None:
    params, tokenizer, _ = load_named()
    stop = set(stop_tokens(tokenizer))
    engines = {"learned": {}, "fixed": {"costs": cost_curve(os.environ.get("COSTS", CALIBRATED))}}
    warm = chat_tokens(tokenizer, "Warm up: say hello.")
    for options in engines.values():
        dspark_tokens(params, warm, 16, stop, **options)
    prompts = held_out_prompts()
    print(f"held-out split, embedded default, {N} prompts a family, {TOKENS} new tokens, greedy, "
          f"{REPEATS} repeats\n\n| family | learned: tokens/s (each repeat) | fixed: tokens/s (each repeat) | "
          f"learned / fixed (median) | rounds learned / fixed | identical |\n|---|---|---|---|---|---|")
    for family in FAMILIES:
        texts = [chat_tokens(tokenizer, text) for text in prompts[family][:N]]
        tallies = {name: Tally() for name in engines}
        runs = {name: (lambda prompt, name=name: dspark_tokens(params, prompt, TOKENS, stop,
                                                               acceptance=tallies[name], **engines[name]))
                for name in engines}
        speeds, answers = {name: [] for name in engines}, {name: [] for name in engines}
        for repeat in range(REPEATS):
            speed, answer = in_turn(runs, texts, first=repeat)
            for name in engines:
                speeds[name].append(speed[name])
                answers[name] += answer[name]
        ratios = [learned / fixed for learned, fixed in zip(speeds["learned"], speeds["fixed"])]
        cells = [f"{statistics.median(speeds[name]):.1f} ({', '.join(f'{s:.1f}' for s in speeds[name])})"
                 for name in engines]
        print(f"| {family} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.2f} | "
              f"{tallies['learned'].rounds / REPEATS:.0f} / {tallies['fixed'].rounds / REPEATS:.0f} | "
              f"{'yes' if answers['learned'] == answers['fixed'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
