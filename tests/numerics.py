"""Tolerances derived from the computation they check, not from one machine's result.

Two float32 evaluations of the same math differ only by rounding, and the
rounding depends on the summation order each BLAS kernel, fusion or thread
split picks (OpenBLAS chooses its kernels by CPU). A reduction of length
``n`` accumulates a relative error of about ``sqrt(n) * eps`` (a random walk
of per-addition roundings); ``depth`` reductions in sequence add their errors.
Relative to the scale of the result, that gives

    bound = SAFETY * depth * sqrt(reduction) * eps_fp32 * max|expected|

``SAFETY`` covers the tail of the rounding distribution. Measured drifts sit
one to two orders of magnitude below the bound on every BLAS tried, while the
known broken variants (a dropped norm, a wrong window, a missing Markov term)
move results by 1e-2 relative or more, two orders above it.
"""

import math

import mlx.core as mx
import numpy as np

FP32_EPS = float(np.finfo(np.float32).eps)
SAFETY = 4.0
# Reductions a pre-norm decoder layer puts in sequence: the q/k/v projection,
# q·k, the attention-weighted sum, the output projection, gate/up, down.
REDUCTIONS_PER_LAYER = 6


def fp32_bound(expected, *, layers: int, reduction: int) -> float:
    """Largest |actual - expected| two fp32 evaluations of ``layers`` decoder
    layers whose longest sum has ``reduction`` terms may show."""
    scale = float(np.abs(np.asarray(expected)).max())
    depth = REDUCTIONS_PER_LAYER * layers
    return SAFETY * depth * math.sqrt(reduction) * FP32_EPS * max(scale, 1.0)


def assert_fp32_close(actual, expected, what: str, *, layers: int, reduction: int) -> None:
    actual, expected = np.asarray(mx.array(actual)), np.asarray(mx.array(expected))
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bound = fp32_bound(expected, layers=layers, reduction=reduction)
    err = float(np.abs(actual - expected).max())
    assert err <= bound, f"{what}: max |diff| {err:.2e} > {bound:.2e} (fp32 bound for {layers} layers, sums of {reduction})"
