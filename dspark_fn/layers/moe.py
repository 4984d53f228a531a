"""DeepSeek-V4 mixture of experts.

Routing scores ``s = score(x W_gate^T)`` (V4: ``sqrt(softplus)``) pick the
top-k experts of ``s + e_score_correction_bias`` (the bias steers selection
only), or, on hash layers, the fixed experts ``tid2eid[token]``. The chosen
scores, normalised to sum 1 and times ``routed_scaling_factor``, weight the
experts; a shared expert is always added. Every expert is a SwiGLU whose gate
is clamped above and whose up projection is clamped both ways at
``swiglu_limit``.

The parameter sub-tree is mlx-vlm's: ``gate.{weight, e_score_correction_bias
| tid2eid}``, ``switch_mlp.{gate,up,down}_proj.weight`` stacked ``[E, ...]``,
``shared_experts.{gate,up,down}_proj.weight``.
"""

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .. import ops

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: mx.sqrt(nn.softplus(logits)),
    "sigmoid": mx.sigmoid,
    "softmax": lambda logits: mx.softmax(logits, axis=-1),
}


class MoEConfig(NamedTuple):
    top_k: int
    scoring: str
    norm_topk_prob: bool
    routed_scaling: float
    swiglu_limit: float


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    if limit > 0:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


def shared_expert(p: dict, x: mx.array, limit: float) -> mx.array:
    hidden = clamped_swiglu(ops.linear(p["gate_proj"], x), ops.linear(p["up_proj"], x), limit)
    return ops.linear(p["down_proj"], hidden)


def route(gate: dict, x: mx.array, config: MoEConfig, token_ids: mx.array):
    """``(experts [..., k] int32, weights [..., k] float32)``."""
    scores = SCORE_FUNCTIONS[config.scoring](ops.linear(gate, x).astype(mx.float32))
    if "tid2eid" in gate:
        experts = gate["tid2eid"][token_ids].astype(mx.int32)
    else:
        biased = scores + gate["e_score_correction_bias"]
        experts = mx.argpartition(-biased, kth=config.top_k - 1, axis=-1)[..., : config.top_k].astype(mx.int32)
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if config.scoring != "softmax" and config.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return experts, weights * config.routed_scaling


def expert_matmul(x: mx.array, p: dict, experts: mx.array) -> mx.array:
    """``x [..., k, 1, in] @ W[experts]^T`` for stacked expert weights ``[E, out, in]``
    (dense or MLX-quantized), without gathering whole weight tensors."""
    if "scales" not in p:
        return mx.gather_mm(x, p["weight"].swapaxes(-1, -2), rhs_indices=experts)
    quant = ops.quantization(p, x.shape[-1])
    return mx.gather_qmm(x, p["weight"], p["scales"], p.get("biases"), rhs_indices=experts, transpose=True,
                         **quant.kwargs())


def routed_experts(p: dict, x: mx.array, experts: mx.array, weights: mx.array, limit: float) -> mx.array:
    rows = x[..., None, None, :]
    gate = expert_matmul(rows, p["gate_proj"], experts)
    up = expert_matmul(rows, p["up_proj"], experts)
    out = expert_matmul(clamped_swiglu(gate, up, limit), p["down_proj"], experts)
    return (out[..., 0, :] * weights[..., None].astype(out.dtype)).sum(axis=-2)


def moe(p: dict, x: mx.array, config: MoEConfig, token_ids: mx.array | None = None) -> mx.array:
    """Routed experts plus the shared expert; ``token_ids`` only for hash layers."""
    experts, weights = route(p["gate"], x, config, token_ids)
    routed = routed_experts(p["switch_mlp"], x, experts, weights, config.swiglu_limit)
    return routed + shared_expert(p["shared_experts"], x, config.swiglu_limit)
