"""How much a round costs on this machine.

The cost curve (draft kernel, verify kernel of each width) is timed once per
model, device, batch size and sampling mode at a reference context, and kept
in ``~/.cache/dspark_fn``; ``measured_costs`` is what the driver's
``schedule.Planner`` plans "auto" rounds with. Over several ranks every rank
times the kernels together (they hold collectives) and all take rank 0's curve.
"""

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .buffers import init_cache
from .rounds import no_proposal, propose, verify
from .sampling import GREEDY, batch_sampling
from .schedule import CostCurve
from .sharding import agree
from .types import Params

COST_CAPACITY = 512  # cost curves are measured at this context (a typical chat turn)
CACHE_DIR_ENV = "DSPARK_FN_CACHE"


def fastest_seconds(runs: dict, passes: int = 7) -> dict:
    """Fastest wall time of each ``mx.eval(run())``, after one warm-up each
    (which compiles). The runs take turns, pass after pass, so a burst of
    load elsewhere on the machine cannot skew one entry alone."""
    for run in runs.values():
        mx.eval(run())
    best = {name: float("inf") for name in runs}
    for _ in range(passes):
        for name, run in runs.items():
            start = time.perf_counter()
            mx.eval(run())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def monotone(verify_seconds: dict) -> dict:
    """Verifying more tokens never costs less: a running maximum over the
    widths, so timing noise cannot invert the curve."""
    slowest, curve = 0.0, {}
    for width in sorted(verify_seconds):
        slowest = max(slowest, verify_seconds[width])
        curve[width] = slowest
    return curve


def cost_cache_path() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "dspark_fn"
    return Path(root) / "verify_costs.json"


def device_key() -> str:
    """The running machine: host, architecture, MLX device and version."""
    return f"{platform.node()}|{platform.machine()}|{mx.default_device()}|mlx {mx.__version__}"


def cost_key(model: str, batch: int, capacity: int, sampling) -> str:
    digest = hashlib.sha256(model.encode()).hexdigest()[:16]
    return f"{digest}|{device_key()}|batch {batch}|capacity {capacity}|{sampling}"


def cached_costs(key: str, measure: Callable[[], CostCurve], path: Path | None = None) -> CostCurve:
    """The cost curve stored under ``key``, measured (and stored) on first use."""
    path = path or cost_cache_path()
    stored = json.loads(path.read_text()) if path.is_file() else {}
    if key in stored:
        return CostCurve.from_json(stored[key])
    curve = measure()
    stored = json.loads(path.read_text()) if path.is_file() else {}  # others may have written meanwhile
    stored[key] = curve.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(stored, indent=1, sort_keys=True))
    os.replace(scratch, path)
    return curve


def measure_costs(params: Params, batch_size: int, widths, sampling=GREEDY) -> CostCurve:
    """Time the draft kernel and the verify kernel of each width on this machine."""
    cache = init_cache(params, batch_size, COST_CAPACITY)
    cache = cache._replace(length=mx.full((batch_size,), COST_CAPACITY // 2, mx.int32))
    tokens = mx.zeros((batch_size,), mx.int32)
    proposal = propose(params, cache, tokens, sampling)

    def verify_round(width):
        source = proposal if width > 1 else no_proposal(batch_size)
        return verify(params, cache, tokens, source, width, sampling=sampling)

    runs = {width: lambda width=width: verify_round(width) for width in widths}
    seconds = fastest_seconds(runs | {"draft": lambda: propose(params, cache, tokens, sampling)})
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
    ``widths``: measured on first use and cached per model, device, batch
    size and sampling settings (over several ranks, rank 0's, timed by all)."""
    measure = lambda: measure_costs(params, batch_size, widths, sampling)  # noqa: E731
    if mx.distributed.init().size() > 1:  # a cache hit on one rank only would leave the others timing alone
        return agreed(measure())
    key = cost_key(model_signature(params), batch_size, COST_CAPACITY, batch_sampling(sampling, batch_size)[1])
    return cached_costs(key, measure)
