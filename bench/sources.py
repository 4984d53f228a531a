"""Where both proposal sources exist, which block keeps more: the draft's,
the copy's, or a merged one (the copied tokens, then the draft's)?

    python bench/sources.py
    N=4 TOKENS=128 DATASETS=gsm8k,mbpp python bench/sources.py

The embedded default decodes each prompt greedily with the draft alone,
verifying the whole block every round (the output is the target's greedy
text). Each round's draft block is then set beside the copy the context
offered at that point (``CopyIndex``), and each candidate is scored by how
many of its tokens the target's text keeps. The merged block takes the
copy's tokens up to where its source runs into the present (a copy's own
length, before it repeats itself), then the draft's tokens from that slot.
Rounds with no copy are counted apart.

Environment: N (prompts per dataset, default 4), TOKENS (default 128),
DATASETS (default all five).
"""

import os

from dspark_fn import generate
from dspark_fn.copying import CopyIndex
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.evaluate import first_turns
from dspark_fn.catalog import load_named
from report import machine

N = int(os.environ.get("N", 4))
TOKENS = int(os.environ.get("TOKENS", 128))
DATASETS = tuple(os.environ.get("DATASETS", "gsm8k,humaneval,math500,mbpp,mt-bench").split(","))


def kept(block: list, text: list) -> int:
    """Leading tokens of ``block`` that ``text`` continues with."""
    return next((i for i, (a, b) in enumerate(zip(block, text)) if a != b), min(len(block), len(text)))


def own_length(index: CopyIndex, match: int) -> int:
    """Tokens a copy takes from its source before running into the present."""
    context = index.tokens
    start = index.following[tuple(context[len(context) - match :])]
    return len(context) - start


def score_prompt(params, prompt: list, stop: list, totals: dict) -> None:
    events = list(generate(params, prompt, TOKENS, width=None, proposals="draft", stop_tokens=stop))
    text = [t for e in events for t in e.emitted]
    rounds = [e for e in events if e.kind == "round"]
    index, position = CopyIndex(prompt + text[:1]), 1
    for event in rounds:
        slots = len(event.drafted)
        copy = index.lookup(slots)
        truth = text[position : position + slots]
        if copy.match:
            own = min(own_length(index, copy.match), slots)
            merged = copy.tokens[:own] + event.drafted[own:]
            scores = {"draft": kept(event.drafted, truth), "copy": kept(copy.tokens, truth),
                      "merged": kept(merged, truth)}
            scores["better of the two"] = max(scores["draft"], scores["copy"])
            for name, value in scores.items():
                totals[name] = totals.get(name, 0) + value
            totals["rounds with a copy"] = totals.get("rounds with a copy", 0) + 1
        else:
            totals["draft, rounds without a copy"] = totals.get("draft, rounds without a copy", 0) + event.accepted
            totals["rounds without a copy"] = totals.get("rounds without a copy", 0) + 1
        index.extend(event.emitted)
        position += len(event.emitted)


def main() -> None:
    params, tokenizer, _ = load_named()
    stop = stop_tokens(tokenizer)
    print(f"embedded default, {N} prompts per dataset, {TOKENS} new tokens, greedy, whole block verified "
          f"({machine()})\n")
    print("| dataset | rounds with a copy | kept per round: draft | copy | merged | better of the two | "
          "rounds without a copy: draft kept |")
    print("|---|---|---|---|---|---|---|")
    for dataset in DATASETS:
        totals: dict = {}
        for text in first_turns(dataset, N):
            score_prompt(params, chat_tokens(tokenizer, text), stop, totals)
        rounds = totals.get("rounds with a copy", 0)
        share = rounds / max(rounds + totals.get("rounds without a copy", 0), 1)
        mean = {name: totals.get(name, 0) / max(rounds, 1) for name in ("draft", "copy", "merged", "better of the two")}
        alone = totals.get("draft, rounds without a copy", 0) / max(totals.get("rounds without a copy", 0), 1)
        print(f"| {dataset} | {share:.0%} | {mean['draft']:.2f} | {mean['copy']:.2f} | {mean['merged']:.2f} | "
              f"{mean['better of the two']:.2f} | {alone:.2f} |", flush=True)


if __name__ == "__main__":
    main()
