"""Workloads measured by the benchmarks: each returns the tokens it produced.

Used by the pytest-benchmark suites and by ``bench/report.py``; every
comparison runs both sides on the same weights and prompt in one process.
"""

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
from dspark_fn.schedule import CostCurve

ROOT = Path(__file__).resolve().parents[1]
PARITY = Path(os.environ.get("DSPARK_PARITY_DIR", ROOT / "tests" / "fixtures" / "parity"))
HELD_OUT = ROOT / "corpus" / "held-out.jsonl"  # prompts no draft was trained or tuned on


def held_out_prompts() -> dict:
    """``{family: [first turn, ...]}`` of the held-out split."""
    families = defaultdict(list)
    for line in HELD_OUT.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            families[row["family"]].append(row["turns"][0])
    return families


def cost_curve(text: str) -> CostCurve:
    """A ``CostCurve`` from JSON: ``{"draft": seconds, "verify": {"width": seconds, ...}}``."""
    costs = json.loads(text)
    return CostCurve(costs["draft"], {int(width): seconds for width, seconds in costs["verify"].items()})


def in_turn(runs: dict, prompts: list, first: int = 0) -> tuple[dict, dict]:
    """Every run of ``runs`` (name -> ``run(prompt) -> tokens``) over
    ``prompts``, the runs taking turns prompt by prompt: prompt ``i`` starts
    from run ``(first + i) % len(runs)``, so each run meets the machine's
    drift from every place in the order. ``({name: tokens/s}, {name: [tokens of each prompt]})``."""
    names = list(runs)
    counts, answers = {name: [0, 0.0] for name in names}, {name: [] for name in names}
    for index, prompt in enumerate(prompts):
        lead = (first + index) % len(names)
        for name in names[lead:] + names[:lead]:
            start = time.perf_counter()
            tokens = runs[name](prompt)
            counts[name][1] += time.perf_counter() - start
            counts[name][0] += len(tokens)
            answers[name].append(tokens)
    return {name: produced / seconds for name, (produced, seconds) in counts.items()}, answers


def fixture_pair(case: str = "qwen3_tiny"):
    """``(params, mlx-lm model, prompt)`` of a parity fixture."""
    from mlx_lm.utils import load_model

    root = PARITY / case
    params = dspark_fn.load(root / "target", root / "draft")
    model, _ = load_model(root / "target")
    prompt = json.loads((root / "trace.json").read_text())["prompt_ids"]
    return params, model, prompt


def dspark_generate(params, prompt, n, **kwargs) -> list[int]:
    return [t for event in dspark_fn.generate(params, prompt, n, **kwargs) for t in event.emitted]


def mlx_lm_generate(model, prompt, n) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


def eager(fn):
    """Run ``fn`` with ``mx.compile`` turned off (the same code, uncompiled)."""

    def run(*args, **kwargs):
        mx.disable_compile()
        try:
            return fn(*args, **kwargs)
        finally:
            mx.enable_compile()

    return run


def median_seconds(fn, repeats: int, warmups: int = 0) -> float:
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seconds_of(run: Callable) -> float:
    start = time.perf_counter()
    mx.eval(run())
    return time.perf_counter() - start


def fastest_seconds(runs: dict, passes: int = 7, report: Callable[[str, float], None] | None = None) -> dict:
    """Fastest wall time of each ``mx.eval(run())`` over ``passes``, after one
    warm-up each (which compiles; the first pass follows it at once). The
    other passes take turns, so a burst of load elsewhere on the machine
    cannot skew one entry alone. ``report(kind, seconds)`` hears of each
    call: "compile" for a warm-up, "run" for a timed pass."""
    report = report or (lambda kind, seconds: None)
    best = {}
    for name, run in runs.items():
        report("compile", seconds_of(run))
        best[name] = seconds_of(run)
        report("run", best[name])
    for _ in range(passes - 1):
        for name, run in runs.items():
            seconds = seconds_of(run)
            best[name] = min(best[name], seconds)
            report("run", seconds)
    return best
