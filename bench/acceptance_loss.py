"""Where a draft loses acceptance, per task family, on the held-out split
(``corpus/held-out.jsonl``: prompts no shipped draft trained on).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/acceptance_loss.py
    DRAFT=RUN/draft TOKENS=128 FAMILIES=mt-bench,gsm8k python bench/acceptance_loss.py

Each prompt (chat template, greedy) is decoded twice with the same draft:

- the default policy (``generate`` with no options: copies beside the draft,
  the gate): tau, and the share of rounds that verified the draft, a copy,
  or nothing (the gate declined: a plain target step);
- the draft alone, verifying its whole block every round
  (``proposals="draft"``, ``width=None``): the draft's own quality, with no
  gate between it and the target. Per slot k, the acceptance given slot
  k - 1 was accepted; the share of rounds whose first rejected slot asked for
  a token outside the draft vocabulary (no draft could have proposed it);
  tau by position in the answer.

From the target's greedy tokens alone (the output of both decodes): the share
inside the draft vocabulary, inside the corpus's 8,192 and 16,384 most frequent
answer tokens, and the tau a perfect draft limited to the draft vocabulary
would reach (each round keeps the next in-vocabulary tokens up to the block).

The gate drafts when the measured acceptance predicts more tokens per second
than a plain step; "break-even alpha_1" is the first-slot acceptance at which
a one-token draft round pays, from this machine's cost curve.

Environment: DRAFT (default: the shipped draft), TOKENS (default 128),
FAMILIES (default all five), SPLIT (default corpus/held-out.jsonl), JSON (a
path: the per-family numbers are written there too).
"""

import gzip
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

import dspark_fn
from dspark_fn import generate
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.drafts.heads import DRAFT_VOCAB_KEY
from dspark_fn.drafts.vocab import frequent_tokens
from dspark_fn.schedule import Settings, bucket_for
from report import machine

ROOT = Path(__file__).resolve().parents[1]
DRAFT = os.environ.get("DRAFT")
TOKENS = int(os.environ.get("TOKENS", 128))
SPLIT = Path(os.environ.get("SPLIT", ROOT / "corpus" / "held-out.jsonl"))
CORPUS = ROOT / "corpus" / "smollm2-135m-answers.jsonl.gz"
FAMILIES = os.environ.get("FAMILIES", "gsm8k,humaneval,math500,mbpp,mt-bench").split(",")
POSITION_BINS = (0, 32, 64, 96, 128)
WIDER_VOCABS = (8192, 16384)


def split_prompts() -> dict:
    """``{family: [prompt text]}`` of the held-out split."""
    rows = [json.loads(line) for line in SPLIT.read_text().splitlines() if line.strip()]
    families = defaultdict(list)
    for row in rows:
        families[row["family"]].append(row["turns"][0])
    return families


def corpus_vocabularies(held_out: set, vocab_size: int, stops) -> dict:
    """The corpus's most frequent answer tokens (held-out prompts' answers left out), per size."""
    with gzip.open(CORPUS, "rt") as handle:
        answers = [row["answer"] for row in map(json.loads, handle) if tuple(row["prompt"]) not in held_out]
    return {size: set(frequent_tokens(answers, size, vocab_size, stops).tolist()) for size in WIDER_VOCABS}


def vocabulary_capped_tau(tokens: list, inside: set, drafts: int) -> float:
    """Tau of a perfect draft that can only propose ``inside`` tokens: each
    round emits the in-vocabulary run after the anchor (up to ``drafts``) and
    one more token."""
    position, rounds = 0, 0
    while position < len(tokens):
        run = 0
        while run < drafts and position + run < len(tokens) and tokens[position + run] in inside:
            run += 1
        position += run + 1
        rounds += 1
    return len(tokens) / max(rounds, 1)


def default_policy(params, prompt: list, stops, totals: dict) -> None:
    for event in generate(params, prompt, TOKENS, stop_tokens=stops):
        if event.kind != "round":
            continue
        source = event.source or "none"
        totals["rounds"] += 1
        totals["emitted"] += len(event.emitted)
        totals[f"rounds {source}"] += 1
        totals[f"emitted {source}"] += len(event.emitted)


def draft_alone(params, prompt: list, stops, vocab: set, totals: dict) -> list:
    """The draft's whole block every round; returns the target's greedy tokens."""
    text, position = [], 0
    for event in generate(params, prompt, TOKENS, width=None, proposals="draft", stop_tokens=stops):
        text += event.emitted
        if event.kind != "round":
            position += len(event.emitted)
            continue
        slots = len(event.drafted)
        totals["slots"] = max(totals.get("slots", 0), slots)
        for slot in range(min(event.accepted + 1, slots)):
            totals[f"reached {slot}"] += 1
            totals[f"accepted {slot}"] += slot < event.accepted
        if event.accepted < slots and len(event.emitted) == event.accepted + 1:
            totals["rejections"] += 1
            totals["rejections outside vocab"] += event.emitted[-1] not in vocab
        bin_ = np.searchsorted(POSITION_BINS, position, side="right") - 1
        totals[f"rounds at {bin_}"] += 1
        totals[f"emitted at {bin_}"] += len(event.emitted)
        totals["draft rounds"] += 1
        totals["draft emitted"] += len(event.emitted)
        position += len(event.emitted)
    return text


def break_even_alpha(costs, buckets) -> float:
    """First-slot acceptance at which a round with one draft emits as fast as a plain step."""
    return costs.round_cost(bucket_for(2, buckets)) / costs.verify[bucket_for(1, buckets)] - 1


def learned_costs(params, prompt: list, buckets: tuple, rounds: int = 48):
    """The round costs the policy learned over ``rounds`` rounds of the README's loop from ``prompt``."""
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 512), prompt)
    for _ in range(rounds):
        cache, step = dspark_fn.speculate(params, cache, tokens)
        tokens = step.next_tokens
    return cache.policy.costs.curve(1, False, buckets)


def family_row(family: str, totals: dict, coverage: dict, capped: list) -> dict:
    share = lambda a, b: totals[a] / max(totals[b], 1)  # noqa: E731
    slots = totals.get("slots", 0)
    return {
        "family": family,
        "prompts": totals["prompts"],
        "target tokens": coverage["tokens"],
        "in draft vocab": coverage["draft"] / coverage["tokens"],
        **{f"in top {size}": coverage[size] / coverage["tokens"] for size in WIDER_VOCABS},
        "vocab-capped tau": float(np.mean(capped)),
        "tau (default policy)": share("emitted", "rounds"),
        "rounds draft / copy / none": [share(f"rounds {s}", "rounds") for s in ("draft", "copy", "none")],
        "tau where drafted": share("emitted draft", "rounds draft"),
        "tau where copied": share("emitted copy", "rounds copy"),
        "tau (draft alone)": share("draft emitted", "draft rounds"),
        "alpha per slot": [share(f"accepted {k}", f"reached {k}") for k in range(slots)],
        "rejections outside vocab": share("rejections outside vocab", "rejections"),
        "tau by position": [share(f"emitted at {b}", f"rounds at {b}") for b in range(len(POSITION_BINS) - 1)],
    }


def markdown(rows: list) -> str:
    """The per-family numbers as BENCHMARK.md's table."""
    percent = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = ["| family | prompts | target tokens in draft vocab / top 8,192 / top 16,384 | vocab-capped tau | "
             "tau, default policy | rounds: draft / copy / none | tau where drafted / copied | tau, draft alone | "
             "alpha per slot (given the slot before) | rejections outside vocab | tau by position: 0-31 / 32-63 / "
             "64-95 / 96-127 |", "|" + "---|" * 11]
    for row in rows:
        lines.append(
            f"| {row['family']} | {row['prompts']} | {percent(row['in draft vocab'])} / {percent(row['in top 8192'])} / "
            f"{percent(row['in top 16384'])} | {row['vocab-capped tau']:.2f} | {row['tau (default policy)']:.2f} | "
            + " / ".join(f"{100 * x:.0f}%" for x in row["rounds draft / copy / none"])
            + f" | {row['tau where drafted']:.2f} / {row['tau where copied']:.2f} | {row['tau (draft alone)']:.2f} | "
            + " / ".join(f"{x:.2f}" for x in row["alpha per slot"])
            + f" | {percent(row['rejections outside vocab'])} | "
            + " / ".join(f"{x:.2f}" for x in row["tau by position"]) + " |")
    return "\n".join(lines)


def main() -> None:
    params, tokenizer, _ = load_named(None, DRAFT)
    stops = stop_tokens(tokenizer)
    families = split_prompts()
    vocab = set(np.array(params.draft[DRAFT_VOCAB_KEY]).tolist()) if DRAFT_VOCAB_KEY in params.draft else None
    vocab = vocab if vocab is not None else set(range(params.spec.target.vocab_size))
    held_out = {tuple(chat_tokens(tokenizer, text)) for texts in families.values() for text in texts}
    wider = corpus_vocabularies(held_out, params.spec.target.vocab_size, stops)
    buckets = Settings(params.spec.block_size).buckets
    costs = learned_costs(params, chat_tokens(tokenizer, families[FAMILIES[0]][0]), buckets)
    print(f"# {machine()}; draft {DRAFT or 'shipped default'} ({len(vocab)}-token vocabulary); {TOKENS} tokens; "
          f"break-even alpha_1 {break_even_alpha(costs, buckets):.2f}")
    rows = []
    for family in FAMILIES:
        totals, coverage, capped = defaultdict(int), defaultdict(int), []
        for text in families[family]:
            prompt = chat_tokens(tokenizer, text)
            totals["prompts"] += 1
            default_policy(params, prompt, stops, totals)
            tokens = draft_alone(params, prompt, stops, vocab, totals)[1:]
            coverage["tokens"] += len(tokens)
            coverage["draft"] += sum(t in vocab for t in tokens)
            for size, inside in wider.items():
                coverage[size] += sum(t in inside for t in tokens)
            capped.append(vocabulary_capped_tau(tokens, vocab, totals["slots"]))
        rows.append(family_row(family, totals, coverage, capped))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    if os.environ.get("JSON"):
        Path(os.environ["JSON"]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
