"""Stateless tensor operations shared by every target and draft.

Parameters are plain dicts in checkpoint layout (``{"weight": ..., "bias": ...}``),
so each op takes the sub-tree it needs and the activations.
"""

import math
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

# Markers a tensor-parallel target's modules carry (``sharding.py``): their
# values are unused, their presence says what a rank's share of the module is.
PARTIAL_SUM = "partial_sum"  # a linear over this rank's input columns: its outputs sum over the ranks
VOCAB_SHARD = "vocab_shard"  # a table of this rank's vocabulary rows (value: the first row's id)

QUANT_BITS = (2, 3, 4, 5, 6, 8)
# Microscaling modes: power-of-two uint8 scales, no biases; (group, bits) -> mode.
MICROSCALING = {(32, 8): "mxfp8", (32, 4): "mxfp4", (16, 4): "nvfp4"}


class Quantization(NamedTuple):
    group_size: int
    bits: int
    mode: str

    def kwargs(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def quantization(p: dict, columns: int) -> Quantization:
    """How an MLX-quantized weight whose rows hold ``columns`` values is
    stored: packed width and scale count give bits and group size, and
    float scales with biases mean affine, uint8 scales without biases a
    microscaling float format (mxfp8, mxfp4, nvfp4). A quantized tree needs
    no side metadata (any group size, mixed layouts)."""
    packed, groups = p["weight"].shape[-1], p["scales"].shape[-1]
    bits, odd_bits = divmod(packed * 32, columns)
    group, odd_group = divmod(columns, groups)
    if not (odd_bits or odd_group):
        if "biases" in p and bits in QUANT_BITS:
            return Quantization(group, bits, "affine")
        if "biases" not in p and p["scales"].dtype == mx.uint8 and (group, bits) in MICROSCALING:
            return Quantization(group, bits, MICROSCALING[group, bits])
    raise ValueError(
        f"a weight packed as {tuple(p['weight'].shape)} with {groups} scales per row is not an MLX "
        f"quantization of {columns} columns (supported: affine with bits {QUANT_BITS} and any group size; "
        f"{', '.join(f'{mode} (group {g}, {b} bits)' for (g, b), mode in MICROSCALING.items())})"
    )


def quantize_as_stored(model, flat: dict) -> None:
    """Make each module of the ``mlx.nn`` ``model`` that ``flat`` (its
    tensors by dotted name) stores quantized into its quantized module, with
    the group size and bits its arrays say (mixed layouts included)."""
    import mlx.nn as nn

    def stored(path: str, module) -> dict | bool:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in flat:
            return False
        parts = {name: flat[f"{path}.{name}"] for name in ("weight", "scales", "biases") if f"{path}.{name}" in flat}
        return quantization(parts, module.weight.shape[-1]).kwargs()

    nn.quantize(model, class_predicate=stored)


def linear(p: dict, x: mx.array) -> mx.array:
    """``x @ W.T (+ b)`` for a dense or an MLX-quantized weight; a rank's
    share of a tensor-parallel weight is summed or gathered over the ranks."""
    if "scales" in p:
        quant = quantization(p, x.shape[-1])
        y = mx.quantized_matmul(x, p["weight"], p["scales"], p.get("biases"), transpose=True, **quant.kwargs())
    else:
        y = x @ p["weight"].T
    if PARTIAL_SUM in p:
        y = mx.distributed.all_sum(y)
    if VOCAB_SHARD in p:  # each rank holds a stretch of the output rows: gather them in rank order
        y = mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(y, -1, 0)), 0, -1)
    if "bias" in p:
        y = y + p["bias"]
    return y


def grouped_linear(p: dict, x: mx.array) -> mx.array:
    """``x [..., G, L, in] @ W[g].T`` per group for ``W [G, out, in]`` (dense or MLX-quantized)."""
    if "scales" not in p:
        return x @ p["weight"].swapaxes(-1, -2)
    groups = mx.broadcast_to(mx.arange(p["weight"].shape[0]), x.shape[:-2])
    quant = quantization(p, x.shape[-1])
    return mx.gather_qmm(x, p["weight"], p["scales"], p.get("biases"), rhs_indices=groups, transpose=True,
                         **quant.kwargs())


def embed(p: dict, ids: mx.array, dim: int) -> mx.array:
    """Rows ``ids`` of a dense or an MLX-quantized ``[V, dim]`` table (of a
    vocabulary-sharded one: each rank looks up its own rows, zeros for the
    others', and the ranks sum)."""
    if VOCAB_SHARD in p:
        local = ids - p[VOCAB_SHARD]
        owned = (local >= 0) & (local < p["weight"].shape[0])
        table = {key: value for key, value in p.items() if key != VOCAB_SHARD}
        rows = embed(table, mx.where(owned, local, 0), dim)
        return mx.distributed.all_sum(mx.where(owned[..., None], rows, 0))
    if "scales" in p:
        quant = quantization(p, dim)
        biases = p["biases"][ids] if "biases" in p else None
        return mx.dequantize(p["weight"][ids], p["scales"][ids], biases, **quant.kwargs())
    return p["weight"][ids]


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm computed in float32; ``weight=None`` is the weightless variant."""
    return mx.fast.rms_norm(x, weight, eps)


def silu_glu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def gelu_tanh_glu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


GLU_ACTIVATIONS = {
    "silu": silu_glu,
    "swish": silu_glu,
    "gelu_pytorch_tanh": gelu_tanh_glu,
    "gelu_tanh": gelu_tanh_glu,
}


def glu_mlp(p: dict, x: mx.array, activation: str = "silu") -> mx.array:
    """``down(act(gate x) * up x)``: SwiGLU for llama/qwen, GeGLU for gemma."""
    glu = GLU_ACTIVATIONS[activation]
    return linear(p["down_proj"], glu(linear(p["gate_proj"], x), linear(p["up_proj"], x)))


def softcap(logits: mx.array, cap: float | None) -> mx.array:
    return logits if not cap else cap * mx.tanh(logits / cap)


def rope_parameters(config: dict) -> dict:
    """HF ``rope_parameters`` (transformers 5) or the older flat keys, as one dict."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def rope_inv_freq(head_dim: int, rope: dict) -> mx.array:
    """Inverse frequencies ``[head_dim // 2]`` for an HF ``rope_parameters`` dict.

    Supports ``default``, ``linear``, ``llama3``, ``yarn`` (frequencies only,
    as DeepSeek-V4 uses it: no attention rescaling) and gemma's
    ``proportional`` (partial rotary: the tail frequencies are zero, i.e.
    identity rotation).
    """
    theta = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    half = head_dim // 2
    exponents = mx.arange(0, half, dtype=mx.float32) * 2 / head_dim
    if kind == "proportional":
        rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim) // 2
        inv = 1.0 / (theta ** exponents[:rotated]) / float(rope.get("factor", 1.0))
        return mx.concatenate([inv, mx.zeros((half - rotated,), mx.float32)])
    inv = 1.0 / (theta**exponents)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv, rope)
    if kind in ("yarn", "deepseek_yarn"):
        return _yarn_scaled(inv, rope, head_dim, theta)
    raise ValueError(
        f"unsupported rope_type {kind!r}; supported: default, linear, llama3, yarn, proportional"
    )


def _llama3_scaled(inv: mx.array, rope: dict) -> mx.array:
    factor = float(rope["factor"])
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    original = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    scaled = mx.where(wavelen > original / low, inv / factor, inv)
    is_medium = (wavelen <= original / low) & (wavelen >= original / high)
    return mx.where(is_medium, blended, scaled)


def _yarn_scaled(inv: mx.array, rope: dict, dims: int, theta: float) -> mx.array:
    """Interpolate the slow frequencies by ``factor``, keep the fast ones, and
    ramp linearly between the dims that turn ``beta_fast`` and ``beta_slow``
    times over the original context."""
    factor = float(rope["factor"])
    original = float(rope["original_max_position_embeddings"])

    def dim_turning(turns: float) -> float:
        return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_turning(float(rope.get("beta_fast", 32)))), 0)
    high = min(math.ceil(dim_turning(float(rope.get("beta_slow", 1)))), dims - 1)
    high = high if high != low else high + 0.001
    kept = 1 - mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    return inv / factor * (1 - kept) + inv * kept


def apply_rope(x: mx.array, positions: mx.array, inv_freq: mx.array) -> mx.array:
    """Half-split (HF layout) rotary embedding of ``x [B, H, L, D]`` at
    ``positions [B, L]``, or ``[B, L, D / 2]`` with a position per frequency
    (multimodal RoPE, whose frequencies follow different axes of an image).

    Positions are data, so the same compiled kernel serves every offset and
    every row of a batch at its own offset.
    """
    per_frequency = positions if positions.ndim == 3 else positions[..., None]
    angles = per_frequency.astype(mx.float32)[:, None] * inv_freq
    cos, sin = mx.cos(angles), mx.sin(angles)
    first, second = mx.split(x, 2, axis=-1)
    rotated = mx.concatenate(
        [first * cos - second * sin, second * cos + first * sin], axis=-1
    )
    return rotated.astype(x.dtype)


def split_heads(x: mx.array, num_heads: int) -> mx.array:
    """``[B, L, H*D] -> [B, H, L, D]``."""
    batch, length, _ = x.shape
    return x.reshape(batch, length, num_heads, -1).transpose(0, 2, 1, 3)


def merge_heads(x: mx.array) -> mx.array:
    """``[B, H, L, D] -> [B, L, H*D]``."""
    batch, _, length, _ = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def attention(q, k, v, mask: mx.array, scale: float) -> mx.array:
    """Grouped-query attention of ``q [B, H, Lq, D]`` over ``k, v [B, H_kv, Lk, D]``;
    ``mask`` is boolean ``[B, 1, Lq, Lk]`` (or broadcastable to it).

    GPUs run MLX's fused kernel. On the CPU that kernel falls back to
    unfused ops; grouping the query heads that share a key head into one
    matrix product measures 1.3-2x faster there (``bench/kernels.py``).
    """
    if mx.default_device() == mx.gpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return grouped_attention(q, k, v, mask, scale)


def grouped_attention(q, k, v, mask: mx.array, scale: float) -> mx.array:
    """The same attention as two matrix products per key head: the ``G``
    query heads of a group and their ``Lq`` rows form one ``[G * Lq, D]`` block."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped = (q * scale).reshape(batch, kv_heads, group * length, dim)
    scores = grouped @ k.swapaxes(-1, -2)
    keys = k.shape[2]
    mask = mx.broadcast_to(mask, (mask.shape[0], 1, length, keys))[:, :, None]
    mask = mx.broadcast_to(mask, (mask.shape[0], 1, group, length, keys)).reshape(-1, 1, group * length, keys)
    scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v).reshape(batch, heads, length, -1).astype(q.dtype)
