"""What a round costs on this machine, learned as rounds run.

The planner compares rounds by tokens per second, so it needs each
verify width's cost and the draft pass's, for the batch size at hand
(``schedule.CostCurve``). Nothing is timed up front: a round's cost starts
from a prior made from the pair's shape and is refined by the measured
time of every round, so the first answer waits on no benchmark and the
widths follow the machine when its load changes.

- The prior: bytes and floating-point operations per verified token. A
  forward reads every weight once (``bytes``) and does ``2 x parameters``
  operations per token; a draft pass reads the draft's weights and drafts
  ``block_size`` tokens per row. ``OPS_PER_BYTE`` says how many operations
  cost as much as reading a byte (a CPU computes little per byte it
  reads; a GPU much more). Only ratios matter before the first
  measurement; the first measurement gives the prior its scale.
- The measurements (``timed``): a round's seconds but its draft passes (the
  verify and the host's own work, which every round pays) by its width,
  a draft pass's seconds, kept per batch size and sampling mode, the newest
  ``WINDOW`` of each, each with the round it was taken in: a measurement
  ``n`` rounds old (of any kind and batch) weighs ``FORGET ** n``. So what
  has not been measured lately, such as a draft pass the planner stopped
  choosing while the machine was busy, fades into the prior scaled to what
  the newest rounds measured, and is chosen (and measured) again when that
  says it pays. A verify's cost is first a line, ``plain + token x (width -
  1)``: the two fitted by least squares over every width's times with the
  prior as ``PRIOR_WEIGHT`` rounds' worth of evidence for each, so a width
  never run is priced from the prior scaled to the machine. A machine's
  costs need not be a line (a wide verify can cost little more than a
  narrower one), so each width is then priced from its own times, with its
  point on the line as its prior, ``PRIOR_WEIGHT`` rounds' worth: a width
  run often is priced from what it costs, one run seldom from what the
  others say. The draft pass is the weighted mean of its times with the
  prior likewise. Rounds in which a kernel compiled are not measured.
- Over several ranks every rank plans with rank 0's shape and times
  (``sharding.agree``): the ranks must take the same decisions, or they
  would run different kernels and wait on each other for ever.

A new policy starts from what the last policy of the same pair learned in
this process (``remembered``), so a loop that makes a cache per prompt
plans its first rounds with measured costs too. Two ways to plan without
the clock, for runs that must take the same decisions every time (seeded
samples repeat only where the decisions do): ``fixed`` as a ``CostCurve``
gives the costs outright; ``fixed="prior"`` plans at the pair's prior and
keeps no measurement, so the decisions are the same on every run and machine.
"""

import hashlib
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .schedule import CostCurve
from .sharding import agree
from .types import Params

FORGET = 0.85  # a measurement one round older weighs this much less: some ten rounds of memory
WINDOW = 32  # measurements kept per batch size, sampling mode and kind
PRIOR_WEIGHT = 0.5  # rounds of evidence the prior counts as, for each fitted cost
PRIOR = "prior"  # the fixed costs that are the pair's shape prior: ``RoundCosts.start(params, PRIOR)``
LEARNED: dict = {}  # a pair's signature -> the costs its rounds last learned in this process
CPU_OPS_PER_BYTE = 8.0  # operations that cost as much as reading a byte of weights, on a CPU
GPU_OPS_PER_BYTE = 60.0


class Shape(NamedTuple):
    """What a pair's forwards move and compute: bytes of weights read and
    operations per token of the target, and per draft pass and row."""

    target_bytes: float
    target_ops: float  # per verified token
    draft_bytes: float
    draft_ops: float  # per draft pass and row (its whole block)
    signature: str  # the pair's: both specs and every tensor's name, shape and dtype

    @classmethod
    def of(cls, params: Params) -> "Shape":
        def arrays(tree) -> list:
            return [(name, value) for name, value in tree_flatten(tree) if isinstance(value, mx.array)]

        target, draft = arrays(params.target), arrays(params.draft)
        described = repr((params.spec.target, params.spec.draft, [(n, a.shape, a.dtype) for n, a in target + draft]))
        sizes = [float(sum(a.nbytes for _, a in target)), 2.0 * sum(a.size for _, a in target),
                 float(sum(a.nbytes for _, a in draft)), 2.0 * sum(a.size for _, a in draft) * params.spec.block_size]
        if mx.distributed.init().size() > 1:  # each rank holds a share: all plan from rank 0's, as they must agree
            sizes = agree(sizes).tolist()
        return cls(*sizes, hashlib.sha256(described.encode()).hexdigest())

    def prior(self, batch: int) -> np.ndarray:
        """``(plain step, each further verified token, draft pass)`` in units of
        a byte read, for a batch of ``batch`` rows."""
        per_byte = GPU_OPS_PER_BYTE if mx.default_device() == mx.gpu else CPU_OPS_PER_BYTE
        token = batch * self.target_ops / per_byte
        return np.array([self.target_bytes + token, token, self.draft_bytes + batch * self.draft_ops / per_byte])


def weights(ages: np.ndarray) -> np.ndarray:
    """What each measurement weighs, by its age in rounds: ``FORGET ** age``."""
    return FORGET ** np.asarray(ages, float)


class RoundCosts(NamedTuple):
    """The cost model of one pair: its shape's prior and the measurements so
    far, by ``(batch, sampled)``. Updates return a new record."""

    shape: Shape
    verifies: dict = {}  # (batch, sampled) -> ((width - 1, seconds, round), ...) newest first
    drafts: dict = {}  # (batch, sampled) -> ((seconds, round), ...) newest first
    fixed: CostCurve | str | None = None  # a CostCurve, PRIOR (nothing measured, ever) or None (learned)
    rounds: int = 0  # rounds seen, timed or not: the clock the measurements' ages are read on

    @classmethod
    def start(cls, params: Params, fixed: CostCurve | str | None = None) -> "RoundCosts":
        """Fixed costs (a ``CostCurve`` or ``PRIOR``), or the last learned in
        this process for the pair (else nothing measured yet)."""
        if not (fixed is None or fixed == PRIOR or isinstance(fixed, CostCurve)):
            raise ValueError(f"costs must be a CostCurve, {PRIOR!r} (plan at the pair's shape prior, the same "
                             f"decisions every run) or None (learned as rounds run), got {fixed!r}")
        shape = Shape.of(params)
        if fixed is None and shape.signature in LEARNED:
            return LEARNED[shape.signature]
        return cls(shape, {}, {}, fixed)

    def remembered(self) -> "RoundCosts":
        """These costs, kept as the start of the pair's next policy in this process (fixed ones are not)."""
        if self.fixed is None:
            LEARNED[self.shape.signature] = self
        return self

    def timed(self, batch: int, sampled: bool, width: int | None = None, verify: float | None = None,
              draft: float | None = None) -> "RoundCosts":
        """One round later, with a verify of ``width`` that took ``verify``
        seconds and/or a draft pass that took ``draft`` seconds, in a batch of
        ``batch`` rows (neither, for a round that says nothing of its costs)."""
        key, now = (batch, sampled), self.rounds + 1
        if self.fixed is not None:  # fixed costs: the clock says nothing to them
            return self._replace(rounds=now)
        verifies, drafts = self.verifies, self.drafts
        if verify is not None:
            verifies = verifies | {key: (((width - 1, verify, now),) + verifies.get(key, ()))[:WINDOW]}
        if draft is not None:
            drafts = drafts | {key: (((draft, now),) + drafts.get(key, ()))[:WINDOW]}
        return self._replace(verifies=verifies, drafts=drafts, rounds=now)

    def curve(self, batch: int, sampled: bool, widths: tuple) -> CostCurve:
        """The cost of a draft pass and of a verify of each of ``widths``, now."""
        if isinstance(self.fixed, CostCurve):
            missing = sorted(set(widths) - set(self.fixed.verify))
            if missing:
                raise ValueError(f"the fixed costs give no verify cost for width(s) {missing}: give one for each of "
                                 f"{list(widths)}")
            return self.fixed
        prior = self.shape.prior(batch)
        verifies = np.array(self.verifies.get((batch, sampled), ()), float).reshape(-1, 3)
        drafts = np.array(self.drafts.get((batch, sampled), ()), float).reshape(-1, 2)
        verify_weights, draft_weights = weights(self.rounds - verifies[:, 2]), weights(self.rounds - drafts[:, 1])
        ratios = np.concatenate([verifies[:, 1] / (prior[0] + prior[1] * verifies[:, 0]), drafts[:, 0] / prior[2]])
        scale = machine_scale(ratios, np.concatenate([verify_weights, draft_weights]))
        plain, token = fitted_line(verifies[:, :2], verify_weights, scale * prior[:2])
        draft = shrunk_mean(drafts[:, 0], draft_weights, scale * prior[2], PRIOR_WEIGHT)
        own = {width: verifies[:, 0] == width - 1 for width in widths}
        return CostCurve(draft, {width: shrunk_mean(verifies[own[width], 1], verify_weights[own[width]],
                                                    plain + token * (width - 1), PRIOR_WEIGHT) for width in widths})


def machine_scale(ratios: np.ndarray, w: np.ndarray) -> float:
    """Seconds per prior unit: the mean of what was measured over what the
    prior says (``ratios``), each weighing ``w``; 1 before any measurement."""
    return float(w @ ratios / w.sum()) if w.sum() > 0 else 1.0


def shrunk_mean(seconds: np.ndarray, w: np.ndarray, prior: float, prior_weight: float) -> float:
    """The mean of ``seconds``, each weighing ``w``, with ``prior`` counted as
    ``prior_weight`` more of them: the prior alone when nothing was measured."""
    return float((w @ seconds + prior_weight * prior) / (w.sum() + prior_weight))


def fitted_line(points: np.ndarray, w: np.ndarray, prior: np.ndarray) -> tuple[float, float]:
    """``(plain, token)`` minimising the squared error of ``plain + token x
    extra`` over ``points [N, 2]`` (extra tokens, seconds), each weighing
    ``w``, plus ``PRIOR_WEIGHT`` times the squared distance to ``prior``;
    neither below zero."""
    extra, seconds = points[:, 0], points[:, 1]
    normal = np.array([[w.sum(), w @ extra], [w @ extra, w @ extra**2]]) + PRIOR_WEIGHT * np.eye(2)
    target = np.array([w @ seconds, w @ (extra * seconds)]) + PRIOR_WEIGHT * prior
    plain, token = np.linalg.solve(normal, target)
    return max(float(plain), 1e-9), max(float(token), 0.0)
