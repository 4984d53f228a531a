"""Manifold-constrained hyper-connections (DeepSeek-V4 mHC).

The residual stream is widened to ``hc`` parallel copies ``X [..., hc, d]``.
Around every sub-layer ``F``, a token-dependent mix (computed from the
weightless-RMS-normed flattened streams) collapses them to one input,
``x = sum_i pre_i X_i``, and writes back ``X'_j = post_j F(x) + sum_i C_ij X_i``
where ``C`` is pushed toward a doubly stochastic matrix by Sinkhorn
iterations. The final head collapses with ``pre`` alone.

A sub-tree here is ``{"fn": [m, hc*d], "base": [m], "scale": [3] or [1]}``.
"""

from typing import NamedTuple

import mlx.core as mx

from .. import ops


class HyperConfig(NamedTuple):
    streams: int  # hc_mult
    sinkhorn_iters: int
    eps: float  # hc_eps: added to pre, to C and to every normaliser
    norm_eps: float  # rms_norm_eps of the mixing input


def expand(x: mx.array, streams: int) -> mx.array:
    """``[..., d] -> [..., hc, d]``: every stream starts as the same copy."""
    return mx.broadcast_to(x[..., None, :], (*x.shape[:-1], streams, x.shape[-1]))


def _mix(p: dict, streams: mx.array, norm_eps: float) -> mx.array:
    flat = streams.reshape(*streams.shape[:-2], -1).astype(mx.float32)
    return ops.rms_norm(flat, None, norm_eps) @ p["fn"].T


def sinkhorn(logits: mx.array, iters: int, eps: float) -> mx.array:
    """Row softmax, then alternate column/row normalisation (``iters`` column passes)."""
    comb = mx.softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def collapse(pre: mx.array, streams: mx.array) -> mx.array:
    return (pre[..., None] * streams.astype(mx.float32)).sum(axis=-2).astype(streams.dtype)


def pre_mix(p: dict, streams: mx.array, config: HyperConfig):
    """``(x [..., d], post [..., hc], comb [..., hc, hc])`` for one sub-layer."""
    hc = config.streams
    mix = _mix(p, streams, config.norm_eps)
    scale, base = p["scale"], p["base"]
    pre = mx.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + config.eps
    post = 2 * mx.sigmoid(mix[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = mix[..., 2 * hc :] * scale[2] + base[2 * hc :]
    comb = sinkhorn(logits.reshape(*logits.shape[:-1], hc, hc), config.sinkhorn_iters, config.eps)
    return collapse(pre, streams), post, comb


def post_mix(y: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """``X'_j = post_j y + sum_i C_ij X_i``."""
    carried = (comb[..., :, :, None] * streams.astype(mx.float32)[..., :, None, :]).sum(axis=-3)
    return (post[..., None] * y.astype(mx.float32)[..., None, :] + carried).astype(streams.dtype)


def head(p: dict, streams: mx.array, config: HyperConfig) -> mx.array:
    """The final collapse: ``sum_i pre_i X_i`` with no Sinkhorn mixing."""
    mix = _mix(p, streams, config.norm_eps)
    pre = mx.sigmoid(mix * p["scale"][0] + p["base"]) + config.eps
    return collapse(pre, streams)
