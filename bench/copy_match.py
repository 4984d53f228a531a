"""Copy offers matched on the device (``copying.copy_offers`` over the
cache's token history, the way every round matches) beside the same match
on the host (``CopyIndex``: each row's dictionary of n-grams, extended with
a round's tokens, then looked up), by batch and capacity: milliseconds per
round, medians of ROUNDS rounds.

    python bench/copy_match.py

The history is the held-out split's prompts, tokenized one after another
(and again from the start past their end), so matches are found as in
decoding. Environment: CAPACITIES (default 256 1024 4096), BATCHES
(default 1 8), ROUNDS (default 50), SLOTS (default 6: the embedded draft's
block plus one), ADVANCE (tokens committed a round, default 3).
"""

import os
import statistics
import time

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls
import mlx.core as mx
import numpy as np

from dspark_fn.catalog import load_named
from dspark_fn.copying import CopyIndex, copy_offers
from workloads import held_out_prompts

CAPACITIES = [int(n) for n in os.environ.get("CAPACITIES", "256 1024 4096").split()]
BATCHES = [int(n) for n in os.environ.get("BATCHES", "1 8").split()]
ROUNDS = int(os.environ.get("ROUNDS", 50))
SLOTS = int(os.environ.get("SLOTS", 6))
ADVANCE = int(os.environ.get("ADVANCE", 3))


def held_out_tokens(tokenizer, count: int) -> list:
    """``count`` tokens of the held-out split's prompts, one after another
    (from the start again when they run out)."""
    tokens = [token for prompts in held_out_prompts().values() for prompt in prompts
              for token in tokenizer.encode(prompt)]
    return (tokens * (count // len(tokens) + 1))[:count]


def device_ms(tokens: list, batch: int, capacity: int) -> float:
    """A round's device match at each of ROUNDS lengths, evaluated."""
    history = mx.array(np.tile(np.array(tokens[:capacity], np.int32), (batch, 1)))
    start = capacity - ROUNDS * ADVANCE - SLOTS
    times = []
    for round_ in range(ROUNDS + 1):
        length = mx.full((batch,), start + round_ * ADVANCE, mx.int32)
        anchors = history[:, start + round_ * ADVANCE]
        begin = time.perf_counter()
        mx.eval(copy_offers(history, length, anchors, SLOTS))
        times.append(time.perf_counter() - begin)
    return 1000 * statistics.median(times[1:])  # the first call compiles


def host_ms(tokens: list, batch: int, capacity: int) -> float:
    """A round's host match: every row's index extended by ADVANCE tokens, then looked up."""
    start = capacity - ROUNDS * ADVANCE - SLOTS
    indexes = [CopyIndex(tokens[:start]) for _ in range(batch)]
    times = []
    for round_ in range(ROUNDS):
        committed = tokens[start + round_ * ADVANCE : start + (round_ + 1) * ADVANCE]
        begin = time.perf_counter()
        for index in indexes:
            index.extend(committed)
            index.lookup(SLOTS)
        times.append(time.perf_counter() - begin)
    return 1000 * statistics.median(times)


def main() -> None:
    _, tokenizer, _ = load_named(None)
    tokens = held_out_tokens(tokenizer, max(CAPACITIES))
    print(f"copy offers of {SLOTS} tokens, {ADVANCE} tokens committed a round, medians of {ROUNDS} rounds\n")
    print("| batch | capacity | device (copy_offers), ms a round | host (CopyIndex), ms a round |")
    print("|---|---|---|---|")
    for batch in BATCHES:
        for capacity in CAPACITIES:
            print(f"| {batch} | {capacity} | {device_ms(tokens, batch, capacity):.2f} | "
                  f"{host_ms(tokens, batch, capacity):.3f} |", flush=True)


if __name__ == "__main__":
    main()
