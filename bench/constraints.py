"""What a constraint costs a round, on the embedded default (SmolLM2-135M +
bundled draft, 49,152-token vocabulary), measured side by side:

- device: the verify kernel as shipped (the allowed-token bits are an input
  of every verify: all ones without a constraint) against the same kernel
  body with no mask at all, at batch 1 and 8 and widths 1, 4 and 6, at a
  512-token context;
- device, the masking alone: what the verify adds per round (the bits
  unpacked, the logits masked) against a plain argmax over the same logits,
  fastest of 300 runs: the whole kernel's difference is within the noise
  of a shared machine, this is not;
- host: building a round's bits for B constrained rows (``verify_masks``
  along a 6-token proposal, ``draft_masks``) and advancing the matchers by 3
  committed tokens, under the issue-tracker schema of
  ``bench/grammar_engines.py``.

Times are the fastest of several runs taking turns (``workloads.fastest_seconds``).

    python bench/constraints.py
    PART=host python bench/constraints.py        # or PART=device; PASSES=25 on a busy machine
"""

import os

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
import numpy as np

from dspark_fn import init_cache, propose
from dspark_fn.catalog import load_named
from dspark_fn.constraints import Constraint, Vocabulary, commit, compile_constraint, draft_masks, verify_masks
from workloads import fastest_seconds
from dspark_fn.kernel import compiled
from dspark_fn.rounds import verify_and_commit
from dspark_fn.sampling import GREEDY, allowed_tokens, batch_sampling, constrained, every_token
from dspark_fn.types import Params
from grammar_engines import SCHEMAS

CONTEXT = 512
BATCHES = (1, 8)
WIDTHS = (1, 4, 6)  # the bundled draft's block of 5, verified whole
PASSES = int(os.environ.get("PASSES", 9))
GREEDY_MODE = batch_sampling(GREEDY, 1).mode


def verify_kernels(params: Params, width: int):
    """The verify's body with the bits as input (as shipped) and without any mask."""
    spec = params.spec

    def body(target, draft, cache, block, rows, masks):
        allowed = None if masks is None else allowed_tokens(masks, spec.target.vocab_size)
        committed, verdict, _ = verify_and_commit(Params(spec, target, draft), cache, block, None, rows, GREEDY_MODE,
                                                  None, None, allowed)
        return committed.length, verdict.emitted

    masked = compiled(f"bench-masked-{width}", body)
    plain = compiled(f"bench-plain-{width}", lambda t, d, c, b, r: body(t, d, c, b, r, None))
    return masked, plain



def device(params: Params) -> None:
    print("| batch | width | verify, bits as input (ms) | verify, no mask (ms) | ratio |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        cache = init_cache(params, batch, 1024)._replace(length=mx.full((batch,), CONTEXT, mx.int32))
        rows = batch_sampling(GREEDY, batch).rows
        proposal = propose(params, cache, mx.zeros((batch,), mx.int32))
        for width in WIDTHS:
            block = mx.concatenate([mx.zeros((batch, 1), mx.int32), proposal.tokens[:, : width - 1]], axis=1)
            masks = every_token((batch, width), params.spec.target.vocab_size)
            masked, plain = verify_kernels(params, width)
            runs = {
                "masked": lambda: masked(params.target, params.draft, cache, block, rows, masks),
                "plain": lambda: plain(params.target, params.draft, cache, block, rows),
            }
            best = fastest_seconds(runs, passes=PASSES)
            print(f"| {batch} | {width} | {best['masked'] * 1e3:.2f} | {best['plain'] * 1e3:.2f} | "
                  f"{best['masked'] / best['plain']:.3f} |")


def masking_alone(vocab_size: int) -> None:
    print("| batch | width | argmax of masked logits (µs) | argmax alone (µs) | the masking (µs) |")
    print("|---|---|---|---|---|")
    masked = mx.compile(lambda logits, masks: mx.argmax(constrained(logits, allowed_tokens(masks, vocab_size)), -1))
    plain = mx.compile(lambda logits: mx.argmax(logits, -1))
    for batch in BATCHES:
        for width in WIDTHS:
            logits, masks = mx.random.normal((batch, width, vocab_size)), every_token((batch, width), vocab_size)
            best = fastest_seconds({"masked": lambda: masked(logits, masks), "plain": lambda: plain(logits)}, 300)
            print(f"| {batch} | {width} | {best['masked'] * 1e6:.0f} | {best['plain'] * 1e6:.0f} | "
                  f"{(best['masked'] - best['plain']) * 1e6:.0f} |")


def host(tokenizer, vocab_size: int) -> None:
    schema, instance, _ = SCHEMAS["issue (nested, enums, arrays, nullable $ref)"]
    vocabulary = Vocabulary(tokenizer, vocab_size)
    grammar = compile_constraint(Constraint.json_schema(schema), vocabulary)
    tokens = tokenizer._tokenizer.encode(instance, add_special_tokens=False)
    print("| rows | verify_masks, width 6 (ms) | draft_masks (ms) | commit 3 tokens (ms) |")
    print("|---|---|---|---|")
    for batch in BATCHES:
        starts = [b % (len(tokens) - 12) for b in range(batch)]
        matchers = []
        for start in starts:
            matcher = grammar.matcher()
            matcher.commit(tokens[:start])
            matchers.append(matcher)
        proposals = np.array([tokens[s: s + 5] for s in starts])

        def advance():  # commit 3 tokens, then undo through fresh copies kept aside
            twins = [m.copy() for m in matchers]
            commit(twins, [tokens[s: s + 3] for s in starts])

        runs = {
            "verify": lambda: mx.array(verify_masks(matchers, proposals, vocab_size)),
            "draft": lambda: mx.array(draft_masks(matchers, 5, vocab_size)),
            "copy": lambda: [m.copy() for m in matchers] and mx.array(0),
            "commit": lambda: advance() or mx.array(0),
        }
        best = fastest_seconds(runs, passes=9)
        print(f"| {batch} | {best['verify'] * 1e3:.3f} | {best['draft'] * 1e3:.3f} | "
              f"{(best['commit'] - best['copy']) * 1e3:.3f} |")


def main():
    params, tokenizer, config = load_named(None)
    if os.environ.get("PART", "both") in ("both", "device"):
        device(params)
        print()
        masking_alone(config["vocab_size"])
        print()
    if os.environ.get("PART", "both") in ("both", "host"):
        host(tokenizer, config["vocab_size"])


if __name__ == "__main__":
    main()
