"""Speculation over several processes: decoding speed, the memory of each
rank, and the bytes each verify moves between the ranks, on the embedded
default (SmolLM2-135M-Instruct, float32, the bundled draft).

    python bench/distributed.py                                    # one process
    mlx.launch -n 2 --backend ring python bench/distributed.py     # tensor parallel
    mlx.launch -n 2 --backend ring python bench/distributed.py --pipeline

Speed: greedy decoding of ``TOKENS`` tokens of a gsm8k prompt with the
default policy, median of ``REPEATS`` runs after a warm-up. Memory: the
target bytes each rank holds and MLX's peak. Traffic: every collective a
verify kernel of each width issues is recorded while it is traced (its
kind and payload); a ring all_sum or all_gather of ``n`` bytes sends about
``2 (N - 1) / N * n`` (all_sum) or ``(N - 1) / N * n`` (all_gather) bytes
from each rank, so the totals project onto a Thunderbolt or Ethernet link.
Rank 0 prints one JSON line.
"""

import json
import os
import statistics
import sys
import time
from collections import Counter

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx

from dspark_fn import rounds
from dspark_fn.distributed import load_sharded, rank_report, world
from dspark_fn.catalog import load_named
from dspark_fn.sharding import resident_bytes

TOKENS = int(os.environ.get("TOKENS", "48"))
REPEATS = int(os.environ.get("REPEATS", "3"))
WIDTHS = (1, 2, 4, 6)
PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def recorded_collectives(traffic: Counter):
    """Wrap the collectives so each call adds its payload to ``traffic`` (called while kernels trace)."""
    for name in ("all_sum", "all_gather"):
        original = getattr(mx.distributed, name)

        def recording(x, *args, _original=original, _name=name, **kwargs):
            traffic[_name] += x.nbytes
            return _original(x, *args, **kwargs)

        setattr(mx.distributed, name, recording)


def verify_traffic(params, traffic: Counter) -> dict:
    """Collective payload bytes of one verify of each width (batch 1, a 256-token context)."""
    cache = dspark_fn.init_cache(params, 1, 512)
    cache = cache._replace(length=mx.full((1,), 256, mx.int32))
    tokens = mx.zeros((1,), mx.int32)
    proposal = rounds.propose(params, cache, tokens)
    per_width = {}
    for width in WIDTHS:
        traffic.clear()
        source = proposal if width > 1 else rounds.no_proposal(1)
        mx.eval(rounds.verify(params, cache, tokens, source, width))
        per_width[width] = dict(traffic)
    return per_width


def main() -> None:
    from dspark_fn.chat import chat_tokens, stop_tokens

    group = world()
    size, pipeline = group.size(), "--pipeline" in sys.argv
    traffic = Counter()
    recorded_collectives(traffic)
    if size > 1:
        params, tokenizer, _ = load_sharded(group, dtype=mx.float32, pipeline=pipeline)
    else:
        params, tokenizer, _ = load_named(dtype=mx.float32)
    prompt, stops = chat_tokens(tokenizer, PROMPT, think=False), stop_tokens(tokenizer)
    per_width = verify_traffic(params, traffic)

    def run():
        return [t for e in dspark_fn.generate(params, prompt, TOKENS, stop_tokens=stops) for t in e.emitted]

    tokens = run()
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    ranks = rank_report(params, group) if size > 1 else [{"rank": 0, "target_bytes": resident_bytes(params.target)}]
    report = {
        "ranks": size, "split": "pipeline" if pipeline else ("tensor" if size > 1 else "none"),
        "tokens": tokens, "tokens_per_s": len(tokens) / statistics.median(seconds),
        "peak_memory_bytes": mx.get_peak_memory(), "target_bytes": ranks,
        "verify_collective_bytes": per_width,
    }
    if group.rank() == 0:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
