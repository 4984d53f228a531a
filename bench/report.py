"""Measurements for BENCHMARK.md, printed as markdown. Each section runs its
comparisons side by side in one process.

    python bench/report.py core        # compiled vs eager round; dspark vs mlx-lm greedy (parity fixture)
    python bench/report.py default     # embedded SmolLM2 pair: tau per dataset, greedy and T=1; speedup
    python bench/report.py quant       # tau of the default draft: float vs 8-bit vs 4-bit
    python bench/report.py speed       # default policy vs mlx-lm greedy on every bundled set (DRAFTS, PROPOSALS too)
    python bench/report.py context     # default policy vs mlx-lm greedy after long prompts
    python bench/report.py precision   # target x draft precision: speedup, tau, memory

Environment: N (prompts per dataset, default 50), TOKENS (new tokens, default 128),
SPEED_N (prompts for the speed comparison, default 10), REPEATS (default 3),
DRAFTS (comma-separated draft directories that `speed` measures after the bundled one,
e.g. from `dspark train`), DATASETS (comma-separated bundled sets for `speed`, default all five),
PROPOSALS (comma-separated proposal sources that `speed` measures: auto, draft, copy; default auto),
TEMPERATURE (`speed` samples at it in both engines, mlx-lm with its own sampler; default 0: greedy; not TEMP,
which names the temporary directory).
"""

import os
import platform
import sys
import time

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx

from workloads import dspark_generate, eager, fixture_pair, median_seconds, mlx_lm_generate

from dspark_fn import Sampling
from dspark_fn.benchmark import run_bench, run_side_by_side
from dspark_fn.checkpoints import mlx_lm_model
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.evaluate import first_turns
from dspark_fn.catalog import load_named
from dspark_fn.quantize import quantize_draft
from dspark_fn import generate
from dspark_fn.stats import Tally

N = int(os.environ.get("N", 50))
TOKENS = int(os.environ.get("TOKENS", 128))
SPEED_N = int(os.environ.get("SPEED_N", 10))
REPEATS = int(os.environ.get("REPEATS", 3))
BATCH = 10


def machine() -> str:
    blas = dspark_fn.blas.in_use().label
    return f"{platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} ({mx.default_device()}), {blas}"


def core() -> None:
    params, model, prompt = fixture_pair()
    n = 128
    runs = {
        "dspark_fn compiled": lambda: dspark_generate(params, prompt, n),
        "dspark_fn eager (mx.compile off)": lambda: eager(dspark_generate)(params, prompt, n),
        "mlx-lm greedy generate_step": lambda: mlx_lm_generate(model, prompt, n),
    }
    for run in runs.values():
        run()
    print(f"qwen3_tiny parity fixture, {n} new tokens, median of {REPEATS * 3} runs ({machine()})\n")
    print("| engine | ms | tokens/s |\n|---|---|---|")
    for name, run in runs.items():
        seconds = median_seconds(run, REPEATS * 3)
        print(f"| {name} | {seconds * 1e3:.1f} | {n / seconds:.0f} |")


def dataset_tau(params, tokenizer, dataset: str, sampling: Sampling) -> Tally:
    """Tau over ``N`` prompts, run in batches (each row's rounds are its own)."""
    prompts = [chat_tokens(tokenizer, text) for text in first_turns(dataset, N)]
    acceptance = Tally()
    for begin in range(0, len(prompts), BATCH):
        batch = prompts[begin : begin + BATCH]
        for event in generate(params, batch, TOKENS, stop_tokens=stop_tokens(tokenizer), sampling=sampling, seed=begin):
            acceptance.count(event)
    return acceptance


def default() -> None:
    params, tokenizer, config = load_named()
    print(f"embedded default (SmolLM2-135M-Instruct + bundled draft), {N} prompts per dataset, "
          f"{TOKENS} new tokens, chat template, thinking off ({machine()})\n")
    print("| dataset | sampling | tau | acceptance | per-slot acceptance |\n|---|---|---|---|---|")
    for dataset in ("gsm8k", "humaneval", "mt-bench"):
        for label, sampling in (("greedy", Sampling()), ("T=1", Sampling(1.0))):
            started = time.perf_counter()
            a = dataset_tau(params, tokenizer, dataset, sampling)
            slots = " ".join(f"{x:.2f}" for x in a.per_slot)
            print(f"| {dataset} | {label} | {a.tau:.2f} | {a.acceptance_rate:.0%} | {slots} |", flush=True)
            print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    print(f"\nSpeed, greedy, {SPEED_N} prompts per dataset, one prompt at a time, medians of {REPEATS} repeats:\n")
    print("| dataset | mlx-lm greedy tokens/s | dspark_fn tokens/s | speedup | tau | identical |\n|---|---|---|---|---|---|")
    model = mlx_lm_model(config, params.target)
    for dataset in ("gsm8k", "humaneval", "mt-bench"):
        prompts = [chat_tokens(tokenizer, text) for text in first_turns(dataset, SPEED_N)]
        s = run_bench(params, model, prompts, TOKENS, stop_tokens(tokenizer), repeats=REPEATS).summary()
        print(f"| {dataset} | {s['baseline_tokens_per_s']:.1f} | {s['dspark_tokens_per_s']:.1f} | "
              f"{s['speedup']:.2f}x | {s['tau']:.2f} | {s['identical']} |", flush=True)


DATASETS = tuple(os.environ.get("DATASETS", "gsm8k,humaneval,math500,mbpp,mt-bench").split(","))
PROPOSALS = tuple(os.environ.get("PROPOSALS", "auto").split(","))
TEMPERATURE = float(os.environ.get("TEMPERATURE", 0))  # speed: both engines sample at it (0: greedy)


def source_cells(summary: dict) -> str:
    """Share of rounds and tau per proposal source: draft, copy, none (plain steps)."""
    sources = summary["sources"]
    share = " / ".join(f"{sources.get(name, {}).get('share', 0.0):.0%}" for name in ("draft", "copy", "none"))
    tau = " / ".join(f"{sources[name]['tau']:.2f}" if name in sources else "-" for name in ("draft", "copy"))
    return f"{share} | {tau}"


def long_prompt(tokenizer, length: int) -> list[int]:
    """A chat prompt of about ``length`` tokens: code from the humaneval set, then a request."""
    parts, text = first_turns("humaneval"), ""
    while len(tokenizer.encode(text)) < length - 40:
        text += parts[len(text) % len(parts)] + "\n"
    ids = tokenizer.encode(text)[: length - 40]
    return chat_tokens(tokenizer, tokenizer.decode(ids) + "\nExplain what the last function does.")


def context() -> None:
    params, tokenizer, config = load_named()
    model = mlx_lm_model(config, params.target)
    new = 64
    print(f"embedded default, default policy, greedy, one long prompt, {new} new tokens, "
          f"medians of {REPEATS} repeats ({machine()})\n")
    print("| prompt tokens | mlx-lm greedy tokens/s | dspark_fn tokens/s | speedup | identical |\n|---|---|---|---|---|")
    for length in (256, 1024, 4096):
        prompt = long_prompt(tokenizer, length)
        s = run_bench(params, model, [prompt], new, stop_tokens(tokenizer), repeats=REPEATS).summary()
        print(f"| {len(prompt)} | {s['baseline_tokens_per_s']:.1f} | {s['dspark_tokens_per_s']:.1f} | "
              f"{s['speedup']:.2f}x | {s['identical']} |", flush=True)


def precision() -> None:
    """Target precision x draft precision on the embedded default: speedup over
    mlx-lm greedy on the same (quantized) target, tau and memory."""
    import dspark_fn.catalog as catalog
    from dspark_fn.quantize import quantize_draft
    from mlx.utils import tree_flatten

    print(f"embedded default, gsm8k, {SPEED_N} prompts, {TOKENS} new tokens, greedy, default policy, medians of "
          f"{REPEATS} repeats ({machine()})\n")
    print("| target | draft | mlx-lm greedy tokens/s | dspark_fn tokens/s | speedup | tau | memory (MB) | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for target_bits in (None, 8, 4):
        params, tokenizer, config = catalog.load_named(quant_target=target_bits)
        model = mlx_lm_model(config, params.target)
        prompts = [chat_tokens(tokenizer, text) for text in first_turns("gsm8k", SPEED_N)]
        for draft_bits in (None, 8, 4):
            pair = params if draft_bits is None else params._replace(draft=quantize_draft(params.draft, draft_bits))
            s = run_bench(pair, model, prompts, TOKENS, stop_tokens(tokenizer), repeats=REPEATS).summary()
            arrays = {id(a): a for _, a in tree_flatten((pair.target, pair.draft))}
            memory = sum(a.nbytes for a in arrays.values()) / 2**20
            label = lambda bits: "float32" if bits is None else f"{bits}-bit"  # noqa: E731
            print(f"| {label(target_bits)} | {label(draft_bits)} | {s['baseline_tokens_per_s']:.1f} | "
                  f"{s['dspark_tokens_per_s']:.1f} | {s['speedup']:.2f}x | {s['tau']:.2f} | {memory:.0f} | "
                  f"{s['identical']} |", flush=True)


def speed() -> None:
    """Default settings (no flags) against mlx-lm greedy on the same target:
    each repeat runs every prompt through mlx-lm once, then through the bundled
    draft and each draft in DRAFTS (the numbers that decide whether a newly
    trained draft replaces the default), medians of repeats; under each of
    PROPOSALS; with the share of rounds and tau per proposal source."""
    drafts = [None] + [d for d in os.environ.get("DRAFTS", "").split(",") if d]
    pairs = {d or "bundled": load_named(None, d) for d in drafts}
    _, tokenizer, config = pairs["bundled"]
    model = mlx_lm_model(config, pairs["bundled"][0].target)
    sampled = {"sampling": Sampling(temperature=TEMPERATURE)} if TEMPERATURE else {}
    decoding = f"temperature {TEMPERATURE} (tokens not compared)" if TEMPERATURE else "greedy"
    print(f"embedded target, default policy, {decoding}, {SPEED_N} prompts per dataset, {TOKENS} new tokens, "
          f"medians of {REPEATS} repeats ({machine()})\n")
    print(f"| dataset | draft | proposals | mlx-lm {'sampled' if TEMPERATURE else 'greedy'} tokens/s | dspark_fn tokens/s | "
          "speedup | tau | "
          "rounds: draft / copy / none | tau: draft / copy | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    candidates = {name: params for name, (params, _, _) in pairs.items()}
    for dataset in DATASETS:
        prompts = [chat_tokens(tokenizer, text) for text in first_turns(dataset, SPEED_N)]
        for proposals in PROPOSALS:
            results = run_side_by_side(candidates, model, prompts, TOKENS, stop_tokens(tokenizer), repeats=REPEATS,
                                       proposals=proposals, **sampled)
            for name, result in results.items():
                s = result.summary()
                print(f"| {dataset} | {name} | {proposals} | {s['baseline_tokens_per_s']:.1f} | "
                      f"{s['dspark_tokens_per_s']:.1f} | {s['speedup']:.2f}x | {s['tau']:.2f} | {source_cells(s)} | "
                      f"{s['identical']} |", flush=True)


def quant() -> None:
    params, tokenizer, _ = load_named()
    print(f"embedded default, gsm8k, {N} prompts, {TOKENS} new tokens, greedy ({machine()})\n")
    print("| draft | tau | acceptance |\n|---|---|---|")
    for label, bits in (("float32", None), ("8-bit", 8), ("4-bit", 4)):
        variant = params if bits is None else params._replace(draft=quantize_draft(params.draft, bits))
        a = dataset_tau(variant, tokenizer, "gsm8k", Sampling())
        print(f"| {label} | {a.tau:.2f} | {a.acceptance_rate:.0%} |", flush=True)


if __name__ == "__main__":
    sections = {"core": core, "default": default, "quant": quant, "speed": speed, "context": context,
                "precision": precision}
    for name in sys.argv[1:] or sections:
        sections[name]()
        print()
