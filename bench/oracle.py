"""What the runtime delivers at the acceptance a strong draft reaches: oracle
blocks verified by ``verify_block`` on the embedded default target, with the
acceptance under control.

    python bench/oracle.py
    TAUS=2,4 TOKENS=64 python bench/oracle.py

For each tau every round verifies ``w`` tokens: the anchor, then tau - 1 of
the target's own greedy tokens, then a wrong one (and more wrong ones up to
``w``), so every round emits exactly tau tokens. Two widths: ``w = tau``
(a draft whose length schedule verifies exactly what is kept) and the whole
block (``w = G + 1``). Against plain decoding (mlx-lm greedy on the same
weights, seconds per token ``T(step)``) it reports

- speedup: oracle rounds alone (no draft pass);
- with a draft: the same rounds plus one pass of the bundled draft
  ``T(draft)`` each, what a draft of this acceptance would give here;
- ideal: ``tau * T(step) / (T(draft) + T(verify w))`` from the kernels'
  times alone (no host work, no synchronisation);
- efficiency: "with a draft" over "ideal".

Environment: TAUS (default 2,3,4,5,6), TOKENS (new tokens per run, default
128), REPEATS (default 3; medians).
"""

import os
import statistics
import time

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx

from dspark_fn import init_cache, prefill, propose, verify, verify_block
from dspark_fn.benchmark import baseline_tokens, timed
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.chat import chat_tokens
from dspark_fn.evaluate import first_turns
from dspark_fn.catalog import load_named
from dspark_fn.buffers import capacity_for
from dspark_fn.prefilling import prefill_slots
from dspark_fn.rounds import no_proposal
from workloads import fastest_seconds
from report import machine

TAUS = [int(t) for t in os.environ.get("TAUS", "2,3,4,5,6").split(",")]
TOKENS = int(os.environ.get("TOKENS", 128))
REPEATS = int(os.environ.get("REPEATS", 3))


def oracle_block(anchor: int, truth: list, tau: int, width: int, vocab: int) -> list:
    """``[anchor, truth[0] .. truth[tau - 2], wrong ...]`` of ``width`` tokens."""
    right = truth[: tau - 1]
    wrong = [(t + 1) % vocab for t in truth[tau - 1 : width - 1]]
    return [anchor] + (right + wrong)[: width - 1]


def oracle_run(params, prompt: list, truth: list, tau: int, width: int, capacity: int) -> tuple[float, list]:
    """Seconds to emit ``TOKENS`` tokens in oracle rounds (one host
    synchronisation a round, as ``generate``), and the tokens."""
    vocab = params.spec.target.vocab_size
    cache, first = prefill(params, init_cache(params, 1, capacity), [prompt])
    mx.eval(cache, first)
    emitted = first.tolist()
    start = time.perf_counter()
    while len(emitted) < TOKENS:
        block = mx.array([oracle_block(emitted[-1], truth[len(emitted) :], tau, width, vocab)], mx.int32)
        cache, result = verify_block(params, cache, block)
        mx.eval(cache, result)
        emitted += result.emitted[0, : result.count.item()].tolist()
    return time.perf_counter() - start, emitted[:TOKENS]


def kernel_seconds(params, context: int, widths) -> dict:
    """Fastest draft pass and verify of each width at ``context`` committed tokens."""
    capacity = capacity_for(context + max(widths))
    state = {"cache": init_cache(params, 1, capacity)._replace(length=mx.array([context], mx.int32))}
    tokens = mx.zeros((1,), mx.int32)
    proposal = propose(params, state["cache"], tokens)

    def verify_round(width):
        cache, result = verify(params, state.pop("cache"), tokens, proposal if width > 1 else no_proposal(1), width)
        state["cache"] = cache._replace(length=mx.array([context], mx.int32))
        return result, state["cache"]

    runs = {"draft": lambda: propose(params, state["cache"], tokens)}
    runs |= {width: lambda width=width: verify_round(width) for width in widths}
    return fastest_seconds(runs)


def main() -> None:
    params, tokenizer, config = load_named()
    model = mlx_lm_model(config, params.target)
    block = params.spec.block_size
    prompt = chat_tokens(tokenizer, first_turns("gsm8k", 1)[0])
    truth = baseline_tokens(model, prompt, TOKENS + block + 1, set())
    capacity = capacity_for(max(prefill_slots(len(prompt)), len(prompt) + TOKENS + 2 * (block + 1)))
    baseline_tokens(model, prompt, 8, set())  # compile mlx-lm's graph outside the timings
    step = statistics.median(timed(baseline_tokens, model, prompt, TOKENS, set())[1] for _ in range(REPEATS)) / TOKENS
    widths = sorted({min(tau, block + 1) for tau in TAUS} | {block + 1})
    kernels = kernel_seconds(params, len(prompt) + TOKENS // 2, widths)
    draft = kernels["draft"]
    print(f"embedded default (SmolLM2-135M + bundled draft, block {block}), gsm8k prompt of {len(prompt)} tokens, "
          f"{TOKENS} new tokens, medians of {REPEATS} ({machine()})\n")
    print(f"plain decoding (mlx-lm greedy) {1e3 * step:.1f} ms/token; draft pass {1e3 * draft:.1f} ms; verify "
          + ", ".join(f"w={w} {1e3 * kernels[w]:.1f} ms" for w in widths) + "\n")
    print("| tau | w | ms/round | speedup (oracle alone) | with a draft | ideal | efficiency | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for tau in TAUS:
        for width in sorted({min(tau, block + 1), block + 1}):
            if tau > width:
                continue
            oracle_run(params, prompt, truth, tau, width, capacity)  # compiles this width
            runs = [oracle_run(params, prompt, truth, tau, width, capacity) for _ in range(REPEATS)]
            seconds = statistics.median(r[0] for r in runs)
            rounds = -(-(TOKENS - 1) // tau)
            per_round = seconds / rounds
            alone = (TOKENS - 1) / seconds * step
            with_draft = tau * step / (per_round + draft)
            ideal = tau * step / (draft + kernels[width])
            identical = all(r[1] == truth[:TOKENS] for r in runs)
            print(f"| {tau} | {width} | {1e3 * per_round:.1f} | {alone:.2f}x | {with_draft:.2f}x | {ideal:.2f}x | "
                  f"{with_draft / ideal:.0%} | {identical} |", flush=True)


if __name__ == "__main__":
    main()
