"""How much a round costs on this machine.

The cost curve (draft kernel, verify kernel of each width) is timed once per
model, machine, MLX device, BLAS, batch size and sampling mode at a reference
context, and kept in ``verify_costs.json`` in the cache folder (``cachedir``):
the same model costs a round several times more on MLX's bundled BLAS than on
OpenBLAS, so each BLAS has its own curve and the gate declines drafting where
that BLAS makes it not pay. The first timing also compiles the kernels; it
shows its progress on stderr. ``measured_costs`` is what the driver's
``schedule.Planner`` plans "auto" rounds with. Over several ranks every rank
times the kernels together (they hold collectives) and all take rank 0's curve.
"""

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .blas import in_use
from .buffers import init_cache
from .cachedir import cache_root, mlx_kernel_dir
from .progress import Status, about, duration
from .rounds import no_proposal, propose, verify
from .sampling import GREEDY, batch_sampling
from .schedule import CostCurve
from .sharding import agree
from .types import Params

COST_CAPACITY = 512  # cost curves are measured at this context (a typical chat turn)


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


class CalibrationStatus:
    """The first timing's status line: kernels compiled of all, and what is
    left estimated from the compiles and timed passes seen so far."""

    def __init__(self, kernels: int, passes: int, status: Status | None = None):
        self.kernels, self.passes, self.status = kernels, passes, status or Status()
        self.seconds = {"compile": [], "run": []}
        self.started = time.monotonic()
        self.status.show(f"dspark_fn: timing this machine's round costs, once per model, machine and BLAS "
                         f"({in_use().label}): compiling kernel 1 of {kernels}")

    def __call__(self, kind: str, seconds: float) -> None:
        self.seconds[kind].append(seconds)
        compiled, timed = len(self.seconds["compile"]), len(self.seconds["run"])
        if not timed:
            return
        left = ((self.kernels - compiled) * statistics.mean(self.seconds["compile"])
                + (self.kernels * self.passes - timed) * statistics.mean(self.seconds["run"]))
        stage = f"compiled {compiled} of {self.kernels} kernels" if compiled < self.kernels else "timing the kernels"
        self.status.show(f"dspark_fn: timing this machine's round costs, once per model, machine and BLAS "
                         f"({in_use().label}): {stage}, {about(left)} left")

    def done(self, where: Path) -> None:
        kernels = mlx_kernel_dir(mx.__version__)
        self.status.done(f"dspark_fn: round costs timed in {duration(time.monotonic() - self.started)}; kept in "
                         f"{where}" + (f" (MLX keeps the compiled kernels in {kernels})" if kernels.is_dir() else ""))


def monotone(verify_seconds: dict) -> dict:
    """Verifying more tokens never costs less: a running maximum over the
    widths, so timing noise cannot invert the curve."""
    slowest, curve = 0.0, {}
    for width in sorted(verify_seconds):
        slowest = max(slowest, verify_seconds[width])
        curve[width] = slowest
    return curve


def cost_cache_path() -> Path:
    return cache_root() / "verify_costs.json"


def device_key() -> str:
    """The running machine: host, architecture, MLX device and version, and
    the BLAS serving MLX's CPU matmuls."""
    return f"{platform.node()}|{platform.machine()}|{mx.default_device()}|mlx {mx.__version__}|{in_use().name}"


COST_METHOD = "cache handed on"  # how the kernels are timed; curves timed otherwise are timed again


def cost_key(model: str, batch: int, capacity: int, sampling) -> str:
    digest = hashlib.sha256(model.encode()).hexdigest()[:16]
    return f"{digest}|{device_key()}|batch {batch}|capacity {capacity}|{sampling}|{COST_METHOD}"


def stored_curves(path: Path) -> dict:
    """The cost cache's curves by key; a ``ValueError`` when the file holds
    something else (edited by hand, damaged on disk)."""
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError:
        entries = None  # refused below with any other layout
    if not isinstance(entries, dict) or not all(isinstance(entry, dict) for entry in entries.values()):
        raise ValueError("not a JSON object of cost curves")
    return entries


def kept_curves(path: Path) -> dict:
    """The curves kept at ``path``: none without a file, and none from a
    file that holds something else (said on stderr; the next curve measured
    replaces it, as curves are only ever a measurement away)."""
    if not path.is_file():
        return {}
    try:
        return stored_curves(path)
    except ValueError as error:
        print(f"dspark_fn: the cost cache {path} is unreadable ({error}); measuring again and replacing it",
              file=sys.stderr)
        return {}


def cached_costs(key: str, measure: Callable[[], CostCurve], path: Path | None = None) -> CostCurve:
    """The cost curve stored under ``key``, measured (and stored) on first use."""
    path = path or cost_cache_path()
    stored = kept_curves(path)
    if key in stored:
        return CostCurve.from_json(stored[key])
    curve = measure()
    stored = kept_curves(path)  # others may have written meanwhile
    measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
    stored[key] = curve.to_json() | {"machine": device_key(), "measured": measured}
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(stored, indent=1, sort_keys=True))
    os.replace(scratch, path)
    return curve


PASSES = 7  # timed calls of each kernel; the fastest counts


def measured_in_view(params: Params, batch_size: int, widths, sampling) -> CostCurve:
    """``measure_costs`` with its progress on stderr, ending with where the curve is kept."""
    status = CalibrationStatus(len(widths) + 1, PASSES)
    curve = measure_costs(params, batch_size, widths, sampling, status)
    status.done(cost_cache_path())
    return curve


def measure_costs(params: Params, batch_size: int, widths, sampling=GREEDY, report=None) -> CostCurve:
    """Time the draft kernel and the verify kernel of each width on this
    machine (``report``: see ``fastest_seconds``)."""
    length = mx.full((batch_size,), COST_CAPACITY // 2, mx.int32)
    held = [init_cache(params, batch_size, COST_CAPACITY)._replace(length=length)]
    tokens = mx.zeros((batch_size,), mx.int32)
    proposal = propose(params, held[0], tokens, sampling)
    mx.eval(proposal)

    def verify_round(width):
        # Each call takes the only reference to the cache and leaves the updated one, as the driver's rounds
        # do: MLX then writes the verified positions in place. Timed against a cache that stays referenced,
        # every call would copy the whole cache, a constant that hides how the cost grows with the width.
        source = proposal if width > 1 else no_proposal(batch_size)
        updated, result = verify(params, held.pop(), tokens, source, width, sampling=sampling)
        held.append(updated._replace(length=length))
        return result, updated

    runs = {width: lambda width=width: verify_round(width) for width in widths}
    runs["draft"] = lambda: propose(params, held[0], tokens, sampling)
    seconds = fastest_seconds(runs, PASSES, report)
    return CostCurve(seconds.pop("draft"), monotone(seconds))


def agreed(costs: CostCurve) -> CostCurve:
    """Rank 0's curve on every rank of the group."""
    widths = sorted(costs.verify)
    values = agree([costs.draft] + [costs.verify[width] for width in widths]).tolist()
    return CostCurve(values[0], dict(zip(widths, values[1:])))


def model_signature(params: Params) -> str:
    """What a verify costs depends on: both specs and every tensor's shape and
    dtype (so a quantized draft is timed apart from its float original)."""
    tensors = tree_flatten((params.target, params.draft))
    return repr((params.spec.target, params.spec.draft, [(k, v.shape, v.dtype) for k, v in tensors]))


def measured_costs(params: Params, batch_size: int, widths: tuple, sampling=GREEDY) -> CostCurve:
    """The cost curve of ``params`` at ``batch_size`` rows for the verify
    ``widths``: measured on first use (its progress on stderr) and cached per
    model, device, BLAS, batch size and sampling settings (over several
    ranks, rank 0's, timed by all)."""
    if mx.distributed.init().size() > 1:  # a cache hit on one rank only would leave the others timing alone
        return agreed(measure_costs(params, batch_size, widths, sampling))
    key = cost_key(model_signature(params), batch_size, COST_CAPACITY, batch_sampling(sampling, batch_size)[1])
    return cached_costs(key, lambda: measured_in_view(params, batch_size, widths, sampling))
