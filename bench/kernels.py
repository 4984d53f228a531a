"""Cost of each compiled kernel on the embedded default (SmolLM2-135M + bundled draft),
at several committed context lengths, next to mlx-lm's own decode step; and
the prefill of prompts of several lengths next to mlx-lm's, in either
smallest chunk (the BLAS in use decides which one ``prefill`` takes).

    python bench/kernels.py                 # contexts 256, 1024, 4096; prompts 69, 200
    CONTEXTS=256,1024 PROMPTS=69 python bench/kernels.py

Each kernel runs on a cache whose committed length is the context (the buffer
contents do not change the cost); times are the fastest of several runs,
taking turns so a burst of load elsewhere cannot skew one entry.
"""

import dataclasses
import os
import time

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn import generate, init_cache, propose, verify
from dspark_fn.buffers import capacity_for
from dspark_fn.prefilling import LINEAR_PREFILL_CHUNK, LONG_PREFILL_CHUNK, PREFILL_CHUNK, prefill, smallest_chunk
from dspark_fn.rounds import no_proposal
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.drafts.heads import DRAFT_VOCAB_KEY
from dspark_fn.catalog import load_named
from workloads import fastest_seconds

CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "256,1024,4096").split(",")]
PROMPTS = [int(c) for c in os.environ.get("PROMPTS", "69,200").split(",")]


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


def host_ms_per_round(params, context: int, rounds: int = 40) -> float:
    """Driver time outside ``mx.eval`` (graph building, planning, events) per
    round of ``generate`` at the default policy."""
    evaluate, inside = mx.eval, [0.0]

    def timed_eval(*args):
        start = time.perf_counter()
        evaluate(*args)
        inside[0] += time.perf_counter() - start

    prompt = [1] * context
    list(generate(params, prompt, 8))  # compile outside the measurement
    mx.eval = timed_eval
    try:
        start = time.perf_counter()
        count = sum(event.kind == "round" for event in generate(params, prompt, rounds))
        total = time.perf_counter() - start
    finally:
        mx.eval = evaluate
    return 1e3 * (total - inside[0]) / count


def full_vocabulary(params):
    """The same draft proposing from the whole vocabulary (Markov rows outside
    the subset zero), to time the draft head it replaces."""
    spec = params.spec
    ids = params.draft[DRAFT_VOCAB_KEY]
    draft = {key: value for key, value in params.draft.items() if key != DRAFT_VOCAB_KEY}
    draft["lm_head"] = spec.target_adapter.layout.head_module(params.target)
    rows = draft["markov_head"]["markov_w2"]["weight"]
    full = mx.zeros((spec.target.vocab_size, rows.shape[1]), rows.dtype)
    full[ids] = rows
    draft["markov_head"] = {**draft["markov_head"], "markov_w2": {"weight": full}}
    draft_spec = dataclasses.replace(spec.draft, draft_vocab_size=0)
    return params._replace(spec=dataclasses.replace(spec, draft=draft_spec), draft=draft)


def prefill_runs(params, model, length: int) -> dict:
    """Prefilling a ``length``-token prompt (under 256 tokens: longer ones
    start with 256-token chunks either way) into an empty cache: mlx-lm's one
    forward, and ours in chunks of each smallest size."""
    if length >= LONG_PREFILL_CHUNK:
        raise SystemExit(f"PROMPTS: lengths under {LONG_PREFILL_CHUNK}, got {length}")
    prompt = list(range(1, length + 1))

    def ours(smallest):
        return lambda: prefill(params, init_cache(params, 1, capacity_for(length)), prompt, chunk_size=smallest)

    def mlx_lm():
        return model(mx.array([prompt]), cache=make_prompt_cache(model))

    return {"mlx-lm": mlx_lm, f"chunks of {PREFILL_CHUNK}": ours(PREFILL_CHUNK),
            f"chunks of {LINEAR_PREFILL_CHUNK}": ours(LINEAR_PREFILL_CHUNK)}


def main() -> None:
    params, _, config = load_named()
    model = mlx_lm_model(config, params.target)
    print(f"BLAS: {dspark_fn.blas.in_use().label}; prefill's smallest chunk here: {smallest_chunk()}")
    print(f"| prompt | mlx-lm prefill ms | chunks of {PREFILL_CHUNK} ms | chunks of {LINEAR_PREFILL_CHUNK} ms |")
    print("|---|---|---|---|")
    for length in PROMPTS:
        ms = {name: 1e3 * seconds for name, seconds in fastest_seconds(prefill_runs(params, model, length)).items()}
        print(f"| {length} | " + " | ".join(f"{value:.0f}" for value in ms.values()) + " |", flush=True)
    reduced = params.spec.draft.draft_vocab_size
    whole = full_vocabulary(params) if reduced else None
    widths = (1, 2, 3, 4, 6)
    drafts = [f"draft ({reduced} tokens)", "draft (full vocabulary)"] if reduced else ["draft"]
    print("| context | capacity | mlx-lm step | " + " | ".join(drafts + [f"verify {w}" for w in widths]) + " | host per round |")
    print("|---|---|---|" + "---|" * (len(drafts) + len(widths) + 1))
    for context in CONTEXTS:
        runs, capacity = kernel_runs(params, context, widths)
        runs[drafts[0]] = runs.pop("draft")
        if whole is not None:
            runs[drafts[1]] = kernel_runs(whole, context, (1,))[0]["draft"]
        runs["mlx-lm step"] = mlx_lm_step(model, context)
        ms = {name: 1e3 * seconds for name, seconds in fastest_seconds(runs).items()}
        cells = [ms["mlx-lm step"]] + [ms[d] for d in drafts] + [ms[f"verify {w}"] for w in widths]
        cells.append(host_ms_per_round(params, context))
        print(f"| {context} | {capacity} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
