"""How many drafted tokens to verify each round (spec §5 and §7).

A round drafts the whole block, then the host reads the confidences
``c_k`` and picks each row's proposal length ``limit_r`` and the verify
width (a compiled bucket ``>= 1 + max limit_r``); the verify kernel accepts
at most ``limit_r`` drafts per row. Three rules, combinable:

- fixed: ``limit = width - 1``;
- threshold (§5): ``limit_r`` = the first slot with ``c_k < threshold``;
- auto (§7, Algorithm 1): maximise expected tokens per second,
  ``Θ(ℓ) = Σ_r (1 + Σ_{k<=ℓ} a_{r,k}) / cost(bucket(1 + ℓ))`` with prefix
  survival ``a_{r,k} = Π_{i<=k} c_{r,i}`` and the measured round cost of
  each width, admitting slot levels ``ℓ = 1, 2, ...`` in order and stopping
  at the first level that does not improve ``Θ``.

Why auto stays lossless: ``c_k`` is computed from the block hidden state and
the token drafted at slot ``k - 1``, so ``a_{r,k}`` is a function of the
drafts before slot ``k``. Thanks to the early stop, whether slot ``k`` is
verified is decided from ``a_{·,1..k}`` alone, never from ``x_k`` itself
(a global argmax over ``ℓ`` would look at ``a_{k+1}``, which depends on
``x_k``: spec Appendix A). The same holds for the threshold cut. Each row's
decision may also depend on the other rows, which are independent of it.

The verify kernels run one width for the whole batch, so the cost of a
round depends on the width only; candidates that share a slot level share
their cost, which is why the levels (not single tokens) are the greedy
steps. For one row this is exactly the paper's Algorithm 1 (its candidates,
sorted by ``a``, are the slots in order). Rows a bucket rounds up past their
``limit`` verify those extra drafts for free but do not keep them.

Where the decision sits: ``generate`` evaluates the verify of round r and
the draft of round r + 1 together (one host sync per round), then plans
round r + 1 from that draft's own confidences before launching its verify.
So the width follows the current proposal (the paper's Algorithm 1), not a
lagged one, at no extra sync. The round cost is ``draft + verify(width)``.

Whether to draft at all (``DraftGate``, the "auto" policy): a round that
does not draft costs one plain target step, ``verify(1)``, and still writes
the draft's context, so drafting can resume at once. Before launching the
draft of round r + 1 the gate compares, from what rounds up to r - 1 showed,

    max_ℓ (1 + Σ_{k<=ℓ} Π_{i<=k} α_i) / (draft + verify(bucket(ℓ + 1)))   vs   1 / verify(1)

where ``α_k`` is the measured rate at which slot k was accepted when slots
< k were (an average over the first rounds, then an exponential moving
average with weight ``ACCEPTANCE_EMA``), and the costs are the measured
curve. Drafting that pays continues; otherwise the round is plain, and a
probe round drafts again after 1, 2, 4, ... up to ``PROBE_LIMIT`` plain
rounds, so a stretch of easy text is found at a bounded cost. The gate
reads only finished rounds, never the tokens of the round it decides, so
it changes the speed, not the output.
"""

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

WIDTH_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CACHE_DIR_ENV = "DSPARK_FN_CACHE"


def width_buckets(block_size: int, fixed: int | None = None) -> tuple:
    """The verify widths compiled for a draft of ``block_size`` (plus ``fixed``)."""
    widest = block_size + 1
    widths = {w for w in WIDTH_LADDER if w <= widest} | {widest}
    if fixed is not None:
        widths.add(fixed)
    return tuple(sorted(widths))


def bucket_for(width: int, buckets: tuple) -> int:
    return next(b for b in buckets if b >= width)


def threshold_lengths(confidences: np.ndarray, threshold: float) -> np.ndarray:
    """``[B]``: number of leading slots with ``c_k >= threshold`` (spec §5)."""
    passed = np.cumprod(confidences >= threshold, axis=1)
    return passed.sum(axis=1)


@dataclass(frozen=True)
class CostCurve:
    """Seconds for one draft block and one verify of each compiled width."""

    draft: float
    verify: dict

    def round_cost(self, width: int) -> float:
        return self.draft + self.verify[width]

    def to_json(self) -> dict:
        return {"draft": self.draft, "verify": {str(w): t for w, t in self.verify.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(data["draft"], {int(w): t for w, t in data["verify"].items()})


def scheduled_length(survival: np.ndarray, costs: CostCurve, buckets: tuple) -> int:
    """Algorithm 1 with its early stop over slot levels: the proposal length ℓ.

    ``survival [B, G]`` holds ``a_{r,k}`` of the rows that take part (zero
    where a row may not go). Level ``k`` is admitted only if it raises
    ``Θ``; the first level that does not ends the search.
    """
    expected = float(survival.shape[0])  # every row emits its target token
    best = expected / costs.round_cost(bucket_for(1, buckets))
    length = 0
    for level in range(1, survival.shape[1] + 1):
        expected += float(survival[:, level - 1].sum())
        value = expected / costs.round_cost(bucket_for(level + 1, buckets))
        if value <= best:
            break
        best, length = value, level
    return length


@dataclass(frozen=True)
class VerifyPolicy:
    """Turns one round's draft confidences into ``(width, limits)``."""

    max_width: int
    buckets: tuple
    threshold: float = 0.0
    costs: CostCurve | None = None  # set: choose the length by Algorithm 1 ("auto")

    def plan(self, confidences: np.ndarray, active: np.ndarray) -> tuple[int, np.ndarray]:
        """``confidences [B, G]`` (sigmoid of the confidence logits), ``active [B]``
        rows still generating -> verify width and per-row proposal lengths."""
        batch, slots = confidences.shape
        limits = np.full(batch, self.max_width - 1)
        if self.threshold > 0:
            limits = np.minimum(limits, threshold_lengths(confidences, self.threshold))
        if self.costs is not None:
            allowed = np.arange(slots)[None, :] < limits[:, None]
            survival = np.cumprod(confidences, axis=1) * allowed
            length = scheduled_length(survival[active][:, : self.max_width - 1], self.costs, self.buckets)
            limits = np.minimum(limits, length)
        widest = int(limits[active].max()) if active.any() else 0
        return bucket_for(widest + 1, self.buckets), limits.astype(np.int32)

    def gate(self) -> "DraftGate | None":
        """A fresh gate for one generation under "auto"; ``None`` for fixed
        widths, which draft every round (``max_width > 1``) or never."""
        if self.costs is None or self.max_width == 1:
            return None
        return DraftGate.start(self.costs, self.buckets, self.max_width - 1)


ACCEPTANCE_EMA = 0.2
PROBE_LIMIT = 16


@dataclass
class DraftGate:
    """Host-side memory of the "auto" policy: measured per-slot acceptance and
    the probe schedule. ``draft_next`` decides the coming round;
    ``observe`` learns from a finished drafted round."""

    costs: CostCurve
    buckets: tuple
    acceptance: np.ndarray  # [G] alpha_k, measured
    observed: np.ndarray  # [G] rounds that measured slot k
    plain_rounds: int = 0
    probe_interval: int = 1

    @classmethod
    def start(cls, costs: CostCurve, buckets: tuple, max_drafts: int) -> "DraftGate":
        # Untried slots count as always accepted, so the first rounds draft and measure.
        return cls(costs, buckets, np.ones(max_drafts), np.zeros(max_drafts))

    def expected_speed(self) -> tuple[float, float]:
        """``(drafting, plain)`` tokens per second predicted for the next round."""
        emitted = 1 + np.cumsum(np.cumprod(self.acceptance))
        drafting = max(
            emitted[drafts - 1] / self.costs.round_cost(bucket_for(drafts + 1, self.buckets))
            for drafts in range(1, len(emitted) + 1)
        )
        return drafting, 1 / self.costs.verify[bucket_for(1, self.buckets)]

    def draft_next(self) -> bool:
        drafting, plain = self.expected_speed()
        if drafting > plain:
            self.probe_interval = 1
            return True
        if self.plain_rounds >= self.probe_interval:
            self.plain_rounds = 0
            self.probe_interval = min(2 * self.probe_interval, PROBE_LIMIT)
            return True
        self.plain_rounds += 1
        return False

    def observe(self, accepted: np.ndarray, limits: np.ndarray, confidences: np.ndarray) -> None:
        """A drafted round: row r verified ``limits[r]`` drafts and kept
        ``accepted[r]``. Slot k counts for the rows that reached it (every
        earlier slot accepted): verified, it was accepted or not; left
        unverified by the plan, its draft confidence stands in for the
        outcome (the plan cut it because that confidence was low)."""
        for slot in range(len(self.acceptance)):
            reached = accepted >= slot
            count = int(reached.sum())
            if not count:
                continue
            verified = limits > slot
            outcome = np.where(verified, accepted > slot, confidences[:, slot])[reached]
            self.observed[slot] += count
            weight = max(ACCEPTANCE_EMA, count / self.observed[slot])
            self.acceptance[slot] += weight * (float(outcome.mean()) - self.acceptance[slot])


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
