"""Cost of each compiled kernel on the embedded default (SmolLM2-135M + bundled draft),
at several committed context lengths, next to mlx-lm's own decode step.

    python bench/kernels.py                 # contexts 256, 1024, 4096
    CONTEXTS=256,1024 python bench/kernels.py

Each kernel runs on a cache whose committed length is the context (the buffer
contents do not change the cost); times are the fastest of several runs,
taking turns so a burst of load elsewhere cannot skew one entry.
"""

import os

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn.speculate import capacity_for, init_cache, no_proposal, propose, verify
from dspark_fn.benchmark import mlx_lm_model
from dspark_fn.models import load_named
from dspark_fn.schedule import fastest_seconds

CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "256,1024,4096").split(",")]


def mlx_lm_step(model, context: int):
    """One mlx-lm decode step after ``context`` cached tokens."""
    cache = make_prompt_cache(model)
    for begin in range(0, context, 512):
        mx.eval(model(mx.zeros((1, min(512, context - begin)), mx.int32), cache=cache))
    token = mx.zeros((1, 1), mx.int32)

    def step():
        out = model(token, cache=cache)
        for c in cache:
            c.offset -= 1  # stay at the same context length
        return out

    return step


def kernel_runs(params, context: int, widths) -> dict:
    """Our kernels at ``context`` committed positions, in the capacity generate
    would pick. Each verify threads the cache through as ``generate`` does
    (the old buffers are dropped, so K/V writes happen in place), then
    resets the length so every run sees the same context."""
    capacity = capacity_for(context + max(widths))
    state = {"cache": init_cache(params, 1, capacity)._replace(length=mx.array([context], mx.int32))}
    tokens = mx.zeros((1,), mx.int32)
    proposal = propose(params, state["cache"], tokens)
    mx.eval(proposal)

    def verify_round(width):
        source = proposal if width > 1 else no_proposal(1)
        cache, result = verify(params, state.pop("cache"), tokens, source, width)
        state["cache"] = cache._replace(length=mx.array([context], mx.int32))
        return result, state["cache"]

    runs = {"draft": lambda: propose(params, state["cache"], tokens)}
    runs |= {f"verify {width}": lambda width=width: verify_round(width) for width in widths}
    return runs, capacity


def main() -> None:
    params, _, config = load_named()
    model = mlx_lm_model(config, params.target)
    widths = (1, 2, 3, 4, 6)
    print("| context | capacity | mlx-lm step | " + " | ".join(["draft"] + [f"verify {w}" for w in widths]) + " |")
    print("|---|---|---|" + "---|" * (len(widths) + 1))
    for context in CONTEXTS:
        runs, capacity = kernel_runs(params, context, widths)
        runs["mlx-lm step"] = mlx_lm_step(model, context)
        ms = {name: 1e3 * seconds for name, seconds in fastest_seconds(runs).items()}
        cells = [ms["mlx-lm step"], ms["draft"]] + [ms[f"verify {w}"] for w in widths]
        print(f"| {context} | {capacity} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
