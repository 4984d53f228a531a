"""The two token mixers of Qwen3-Next / Qwen3.5 hybrid layers, over mlx-lm's
parameter trees: the gated delta net (``linear_attn``) and gated attention
(``self_attn``).

Gated delta net: one projection feeds a causal depthwise convolution (then
silu) over the q, k, v channels; q and k are L2-normalised per head (q also
scaled by ``Dk**-0.5``), and a state ``S [B, Hv, Dv, Dk]`` (float32) follows
the gated delta rule per token:

    S <- g * S;   S <- S + beta * (v - S k) k^T;   y = S q

with ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` and ``beta = sigmoid(b)``
per value head. Value heads share key heads in contiguous groups (value head
``h`` reads key head ``h // (Hv / Hk)``). ``y`` is RMS-normalised with a weight,
gated by ``silu(z)`` and projected out. Qwen3.5 projects q, k, v, z, b and a
separately; Qwen3-Next fuses them into two projections laid out per key head.

Gated attention: ``q_proj`` yields each head's query and an output gate
(interleaved per head); q and k are RMS-normalised per head, the first
``rotary_dims`` of each head rotated, and the attended values scaled by
``sigmoid(gate)`` before ``o_proj``.

Norm weights multiply as stored (``w``), as in mlx-lm's modules: its
``sanitize`` turns an HF checkpoint's ``1 + w`` norms (layer, final, q and k
norms) into plain ones when it loads them; the gated norm is plain in both.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..cache import write_rows
from .recurrent import convolve, scan

QK_NORM_EPS = 1e-6  # the delta net's L2-norm epsilon (added to sum(x^2)), not the config's


@dataclass(frozen=True)
class DeltaGeometry:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k (``key_dim`` each) then v."""
        return 2 * self.key_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dims: int
    rope: tuple  # sorted items of the rotary part's RoPE parameters


def delta_state(geometry: DeltaGeometry, batch: int, dtype) -> dict:
    """A delta-net layer's empty cache entry: the convolution's window of
    previous inputs (activation dtype) and the float32 delta-rule state."""
    g = geometry
    return {
        "conv": mx.zeros((batch, g.conv_kernel - 1, g.conv_dim), dtype),
        "ssm": mx.zeros((batch, g.num_v_heads, g.head_v_dim, g.head_k_dim), mx.float32),
    }


def delta_projections(geometry: DeltaGeometry, p: dict, x: mx.array):
    """``(qkv [B, L, conv_dim], z [B, L, Hv, Dv], b [B, L, Hv], a [B, L, Hv])`` of ``x [B, L, d]``."""
    g = geometry
    batch, length, _ = x.shape
    if "in_proj_qkvz" not in p:
        z = ops.linear(p["in_proj_z"], x).reshape(batch, length, g.num_v_heads, g.head_v_dim)
        return ops.linear(p["in_proj_qkv"], x), z, ops.linear(p["in_proj_b"], x), ops.linear(p["in_proj_a"], x)
    # Qwen3-Next: per key head, [q, k, v, z] and [b, a] of the value heads it serves.
    group = g.num_v_heads // g.num_k_heads
    qkvz = ops.linear(p["in_proj_qkvz"], x).reshape(batch, length, g.num_k_heads, -1)
    q, k, v, z = mx.split(qkvz, [g.head_k_dim, 2 * g.head_k_dim, 2 * g.head_k_dim + group * g.head_v_dim], axis=-1)
    b, a = mx.split(ops.linear(p["in_proj_ba"], x).reshape(batch, length, g.num_k_heads, -1), [group], axis=-1)
    qkv = mx.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)
    heads = (batch, length, g.num_v_heads)
    return qkv, z.reshape(*heads, g.head_v_dim), b.reshape(heads), a.reshape(heads)


def normalized_qk(q: mx.array, k: mx.array):
    """q and k L2-normalised per head, q also carrying the readout scale ``Dk**-0.5``."""
    inv_scale = q.shape[-1] ** -0.5
    eps = QK_NORM_EPS * inv_scale**2  # rms_norm adds eps to mean(x^2), the L2 norm to sum(x^2)
    return inv_scale**2 * ops.rms_norm(q, None, eps), inv_scale * ops.rms_norm(k, None, eps)


def decay(p: dict, a: mx.array) -> mx.array:
    """``g [B, L, Hv]`` (float32): how much of the state each token keeps."""
    return mx.exp(-mx.exp(p["A_log"].astype(mx.float32)) * nn.softplus(a + p["dt_bias"]))


def delta_rule_step(state, q, k, v, g, beta):
    """One token of the gated delta rule: ``(y [B, Hv, Dv], state [B, Hv, Dv, Dk])``."""
    state = state * g[..., None, None]
    remembered = (state * k[..., None, :]).sum(axis=-1)
    state = state + k[..., None, :] * ((v - remembered) * beta[..., None])[..., None]
    return (state * q[..., None, :]).sum(axis=-1).astype(q.dtype), state


def gated_rms_norm(weight: mx.array, x: mx.array, gate: mx.array, eps: float) -> mx.array:
    """``rms_norm(x) * silu(gate)``, the product in float32."""
    normed = ops.rms_norm(x, weight, eps).astype(mx.float32)
    return (nn.silu(gate.astype(mx.float32)) * normed).astype(x.dtype)


def gated_delta_net(geometry: DeltaGeometry, p: dict, x: mx.array, entry: dict, eps: float, keep):
    """The delta-net mixer of ``x [B, L, d]`` after the state in ``entry``:
    ``(output [B, L, d], entry)``, the entry pending without ``keep`` (``layers/recurrent.py``)."""
    g = geometry
    batch, length, _ = x.shape
    qkv, z, b, a = delta_projections(g, p, x)
    mixed, conv = convolve(entry["conv"], qkv, p["conv1d"]["weight"], p["conv1d"].get("bias"), keep)
    q, k, v = mx.split(nn.silu(mixed), [g.key_dim, 2 * g.key_dim], axis=-1)
    q = q.reshape(batch, length, g.num_k_heads, g.head_k_dim)
    k = k.reshape(batch, length, g.num_k_heads, g.head_k_dim)
    v = v.reshape(batch, length, g.num_v_heads, g.head_v_dim)
    q, k = normalized_qk(q, k)
    group = g.num_v_heads // g.num_k_heads
    q, k = mx.repeat(q, group, axis=2), mx.repeat(k, group, axis=2)
    y, ssm = scan(delta_rule_step, entry["ssm"], (q, k, v, decay(p, a), mx.sigmoid(b)), keep)
    out = gated_rms_norm(p["norm"]["weight"], y, z, eps)
    return ops.linear(p["out_proj"], out.reshape(batch, length, -1)), {"conv": conv, "ssm": ssm}


def partial_rope(x: mx.array, positions: mx.array, geometry: AttentionGeometry) -> mx.array:
    """Rotate the first ``rotary_dims`` of each head (half-split layout); the rest pass through."""
    inv_freq = ops.rope_inv_freq(geometry.rotary_dims, dict(geometry.rope))
    rotary, rest = mx.split(x, [geometry.rotary_dims], axis=-1)
    return mx.concatenate([ops.apply_rope(rotary, positions, inv_freq), rest], axis=-1)


def gated_attention(geometry: AttentionGeometry, p: dict, x, keys, values, start, positions, mask, eps: float):
    """Gated self-attention of ``x [B, L, d]``, writing its K/V into the
    buffers first: ``(output [B, L, d], keys, values)``."""
    g = geometry
    batch, length, _ = x.shape
    queries, gate = mx.split(ops.linear(p["q_proj"], x).reshape(batch, length, g.num_heads, -1), 2, axis=-1)
    q = ops.rms_norm(queries, p["q_norm"]["weight"], eps).transpose(0, 2, 1, 3)
    k = ops.rms_norm(ops.split_heads(ops.linear(p["k_proj"], x), g.num_kv_heads), p["k_norm"]["weight"], eps)
    v = ops.split_heads(ops.linear(p["v_proj"], x), g.num_kv_heads)
    keys = write_rows(keys, partial_rope(k, positions, g), start)
    values = write_rows(values, v, start)
    attended = ops.attention(partial_rope(q, positions, g), keys, values, mask, g.head_dim**-0.5)
    out = ops.merge_heads(attended) * mx.sigmoid(gate.reshape(batch, length, -1))
    return ops.linear(p["o_proj"], out), keys, values
