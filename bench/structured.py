"""Schema-constrained prompts: dspark's default policy with the grammar's
forced tokens as proposals against mlx-lm's constrained greedy
(``generate_step`` with the same llguidance mask as a logits processor), on
the embedded default (SmolLM2-135M + bundled draft), side by side in one
process.

The prompts (``schema_prompts.jsonl``) are held out from every bundled set:
each asks for one JSON document shaped like a public schema (GeoJSON,
schema.org Person / Event / Recipe / PostalAddress, package.json, a calendar
entry, a shop product, a tool call, a Compose service), with bounded strings
and arrays so that an answer ends within the token budget.

Three engines: mlx-lm, dspark's default policy (draft, copies and forced
tokens), and dspark with the draft as its only source (``proposals="draft"``:
no copies, no forced tokens; its draft is made a round ahead, before the
grammar has seen the anchor, so it drafts without a mask), which shows what
the point-mass sources buy. First an untimed pass runs every engine on every
prompt (compiling every width dspark meets) and measures, per prompt: the
tokens; whether every engine's tokens are identical (greedy under one mask
must be: a mismatch is printed with "!!! MISMATCH"); whether the answer
parses and validates; the share of the answer's tokens the grammar forces
(exactly one token allowed there); the share dspark emitted as accepted
forced proposals; tau per proposal source (draft, copy, forced; "plain
steps": rounds that verified nothing). Then ``REPEATS`` timed passes, the
engines taking turns first, each compared again token for token; tokens/s
is the median over the passes.

    python bench/structured.py                  # TOKENS=128 REPEATS=3
"""

import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)

from dspark_fn.benchmark import baseline_tokens, dspark_tokens, timed
from dspark_fn.catalog import load_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.constraints import Constraint, Grammar, Vocabulary, compile_constraint
from dspark_fn.stats import Tally
from report import machine

PROMPTS = Path(__file__).with_name("schema_prompts.jsonl")
TOKENS = int(os.environ.get("TOKENS", "128"))
REPEATS = int(os.environ.get("REPEATS", "3"))


def grammar_forced_share(grammar: Grammar, tokens: list) -> float:
    """Share of ``tokens`` that were the only token the grammar allowed where they stand."""
    matcher, forced = grammar.matcher(), 0
    for token in tokens:
        forced += matcher.forced(1) == [token]
        matcher.commit([token])
    return forced / len(tokens) if tokens else 0.0


def validates(text: str, schema: dict) -> str:
    """"yes", or why not (the answer cut by the token budget, or a schema error)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError:
        return "no (not whole JSON)"
    except jsonschema.ValidationError as error:
        return f"no ({error.message})"
    return "yes"


def mismatch(name: str, expected: list, tokens: list, tokenizer) -> None:
    at = next((i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b), min(len(expected), len(tokens)))
    print(f"!!! MISMATCH on {name!r} at token {at}: mlx-lm {expected[at:at + 8]} vs dspark {tokens[at:at + 8]}\n"
          f"!!!   mlx-lm: {tokenizer.decode(expected)!r}\n!!!   dspark: {tokenizer.decode(tokens)!r}",
          file=sys.stderr, flush=True)


def load():
    """The embedded default, mlx-lm's model on the same arrays, and the rows with their ids and grammars."""
    params, tokenizer, config = load_named(None)
    stop = stop_tokens(tokenizer)
    vocabulary = Vocabulary(tokenizer, params.spec.target.vocab_size, end_tokens=stop)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    for row in rows:
        row["ids"] = chat_tokens(tokenizer, row["prompt"])
        row["grammar"] = compile_constraint(Constraint.json_schema(row["schema"]), vocabulary)
    return params, mlx_lm_model(config, params.target), tokenizer, stop, rows


DSPARK = {"dspark": "auto", "dspark, draft only": "draft"}  # engine -> proposals (draft only: no copies, no forced)


def main() -> None:
    params, model, tokenizer, stop, rows = load()
    load_before = os.getloadavg()

    def engines(row, order, tallies=None):
        """Every engine on one row, in ``order``: {engine: (tokens, seconds)}."""
        runs = {"mlx-lm": lambda: baseline_tokens(model, row["ids"], TOKENS, set(stop), grammar=row["grammar"])}
        for name, proposals in DSPARK.items():
            runs[name] = partial(dspark_tokens, params, row["ids"], TOKENS, stop, tallies and tallies[name],
                                 constraint=row["grammar"], proposals=proposals)
        return {name: timed(runs[name]) for name in order}

    def compare(row, out, repeat) -> None:
        expected = out["mlx-lm"][0] if repeat is None else row["tokens"]
        for name, (tokens, _) in out.items():
            if tokens != expected:
                row["identical"] = False
                print(f"!!! MISMATCH ({'untimed pass' if repeat is None else f'repeat {repeat + 1}'})",
                      file=sys.stderr)
                mismatch(f"{row['name']}, {name}", expected, tokens, tokenizer)

    names = ["mlx-lm", *DSPARK]
    for row in rows:  # untimed: compiles every width met, and measures all but the speed
        row["tallies"] = {name: Tally() for name in DSPARK}
        row["identical"], row["seconds"] = True, {name: [] for name in names}
        out = engines(row, names, row["tallies"])
        compare(row, out, None)
        row["tokens"] = out["mlx-lm"][0]
        print(f"[untimed] {row['name']}: {len(row['tokens'])} tokens: {tokenizer.decode(row['tokens'])!r}",
              file=sys.stderr, flush=True)
    for repeat in range(REPEATS):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for row in rows:
            out = engines(row, order)
            compare(row, out, repeat)
            for name, (_, spent) in out.items():
                row["seconds"][name].append(spent)
        print(f"[repeat {repeat + 1}/{REPEATS} done]", file=sys.stderr, flush=True)
    report(rows, tokenizer, stop, load_before, os.getloadavg())


def report(rows, tokenizer, stop, load_before, load_after) -> None:
    print(f"Embedded default (SmolLM2-135M-Instruct + bundled draft), {len(rows)} schema-constrained prompts "
          f"(bench/schema_prompts.jsonl), greedy, at most {TOKENS} new tokens, tokens/s the median of {REPEATS} "
          f"timed passes, the engines taking turns first ({machine()}; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after)\n")
    print("| prompt | tokens | valid | forced by the grammar | emitted as forced proposals | "
          "τ draft (rounds) | τ copy (rounds) | τ forced (rounds) | plain steps | τ all | τ draft only | "
          "mlx-lm tok/s | dspark tok/s | ratio | draft only tok/s | ratio | identical |")
    print("|" + "---|" * 17)
    ratios = {name: [] for name in DSPARK}
    totals = {name: [0.0] * REPEATS for name in rows[0]["seconds"]}
    overall = {name: Tally() for name in DSPARK}
    for row in rows:
        tokens, tally = row["tokens"], row["tallies"]["dspark"]
        for name in DSPARK:
            overall[name].absorb(row["tallies"][name])
        text = tokenizer.decode([t for t in tokens if t not in stop])
        speed = {name: len(tokens) / statistics.median(spent) for name, spent in row["seconds"].items()}
        for name, spent in row["seconds"].items():
            totals[name] = [a + b for a, b in zip(totals[name], spent)]
        for name in DSPARK:
            ratios[name].append(speed[name] / speed["mlx-lm"])
        row["forced_share"] = grammar_forced_share(row["grammar"], tokens)
        print(f"| {row['name']} | {len(tokens)} | {validates(text, row['schema'])} | {row['forced_share']:.0%} | "
              f"{columns(tally)} | {row['tallies']['dspark, draft only'].tau:.2f} | {speed['mlx-lm']:.1f} | "
              f"{speed['dspark']:.1f} | {ratios['dspark'][-1]:.2f} | {speed['dspark, draft only']:.1f} | "
              f"{ratios['dspark, draft only'][-1]:.2f} | {'yes' if row['identical'] else '**NO**'} |")
    tokens = sum(len(row["tokens"]) for row in rows)
    speed = {name: statistics.median(tokens / s for s in spent) for name, spent in totals.items()}
    print(f"| **all** | {tokens} | | {statistics.median(row['forced_share'] for row in rows):.0%} (median) | "
          f"{columns(overall['dspark'])} | {overall['dspark, draft only'].tau:.2f} | {speed['mlx-lm']:.1f} | "
          f"{speed['dspark']:.1f} | {speed['dspark'] / speed['mlx-lm']:.2f} | {speed['dspark, draft only']:.1f} | "
          f"{speed['dspark, draft only'] / speed['mlx-lm']:.2f} | "
          f"{'yes' if all(row['identical'] for row in rows) else '**NO**'} |")
    print(f"\nMedian per prompt: forced by the grammar {statistics.median(row['forced_share'] for row in rows):.0%}, "
          f"ratio {statistics.median(ratios['dspark']):.2f} (default), "
          f"{statistics.median(ratios['dspark, draft only']):.2f} (draft only)")


def columns(tally: Tally) -> str:
    """The forced proposals' share of the emitted tokens, tau per source, plain steps, tau over all rounds."""
    plain = tally.by_source.get("none", Tally()).rounds
    return (f"{forced_proposals(tally):.0%} | {by_source(tally, 'draft')} | {by_source(tally, 'copy')} | "
            f"{by_source(tally, 'forced')} | {plain} | {tally.tau:.2f}")


def forced_proposals(tally: Tally) -> float:
    """Share of the emitted tokens that were forced proposals the verify accepted."""
    forced = tally.by_source.get("forced")
    return forced.accepted / tally.emitted if forced and tally.emitted else 0.0


def by_source(tally: Tally, source: str) -> str:
    part = tally.by_source.get(source)
    return f"{part.tau:.2f} ({part.rounds})" if part and part.rounds else "– (0)"


if __name__ == "__main__":
    main()
