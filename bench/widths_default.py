"""Verify width on the embedded default: the target alone (mlx-lm greedy) vs
dspark_fn at fixed widths and ``auto``, same prompts, one process.

    python bench/widths_default.py            # 4 gsm8k prompts x 96 tokens, 2 passes
"""

from dspark_fn.benchmark import baseline_tokens, dspark_tokens, timed
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.evaluate import first_turns
from dspark_fn.catalog import load_named
from dspark_fn.stats import Tally

PROMPTS, TOKENS, PASSES = 4, 96, 2
WIDTHS = {"width 1": 1, "width 3": 3, "width 4": 4, "width 6 (whole block)": 6, "auto": "auto"}


def main() -> None:
    params, tokenizer, config = load_named()
    model = mlx_lm_model(config, params.target)
    prompts = [chat_tokens(tokenizer, text) for text in first_turns("gsm8k", PROMPTS)]
    stop = set(stop_tokens(tokenizer))
    for width in WIDTHS.values():  # trace and measure costs outside the timings
        dspark_tokens(params, prompts[0], 8, stop, width=width)
    baseline_tokens(model, prompts[0], 8, stop)
    print("| engine | " + " | ".join(f"pass {i + 1} tokens/s" for i in range(PASSES)) + " | tau |")
    print("|---|" + "---|" * (PASSES + 1))
    rows = {"mlx-lm greedy": [], **{name: [] for name in WIDTHS}}
    taus = {}
    for _ in range(PASSES):
        count = seconds = 0
        for prompt in prompts:
            tokens, spent = timed(baseline_tokens, model, prompt, TOKENS, stop)
            count, seconds = count + len(tokens), seconds + spent
        rows["mlx-lm greedy"].append(count / seconds)
        for name, width in WIDTHS.items():
            count, seconds, acceptance = 0, 0.0, Tally()
            for prompt in prompts:
                tokens, spent = timed(dspark_tokens, params, prompt, TOKENS, stop, acceptance, width=width)
                count, seconds = count + len(tokens), seconds + spent
            rows[name].append(count / seconds)
            taus[name] = acceptance.tau
    for name, speeds in rows.items():
        tau = f"{taus[name]:.2f}" if name in taus else "1"
        print(f"| {name} | " + " | ".join(f"{s:.1f}" for s in speeds) + f" | {tau} |")


if __name__ == "__main__":
    main()
