"""The Mamba-2 mixer as pure functions over its parameter dict (mlx-lm's
``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``).

One projection gives a gate, the convolution's input and a step size per
head. The causal depthwise convolution (then SiLU) yields the heads' inputs
``x`` and the per-group ``B`` and ``C``. Each head keeps a state
``[head_dim, state_size]`` that decays by ``exp(dt * A)`` and takes in
``dt * x ⊗ B`` every token; its output reads the state with ``C`` and adds
the skip ``D * x``. Heads share ``B`` and ``C`` within their group. The
gated RMSNorm normalises each group of channels separately.

Step sizes, decays and the state are float32 whatever the activations are,
as in mlx-lm's ``ssm.py``; the outputs return to the activation dtype.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from .recurrent import convolve, scan


@dataclass(frozen=True)
class Mamba2Spec:
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int  # groups of heads sharing B and C (and norm groups)
    conv_kernel: int
    eps: float
    time_step_limit: tuple  # (min, max) of dt

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_size(self) -> int:
        """Channels through the convolution: ``x``, then ``B`` and ``C`` of every group."""
        return self.inner_size + 2 * self.num_groups * self.state_size


def init_state(spec: Mamba2Spec, batch: int, dtype=mx.float32) -> dict:
    """Zero state: the convolution's previous inputs ``[B, K - 1, conv]`` in
    ``dtype`` and the SSM state ``[B, heads, head_dim, state_size]`` in float32."""
    return {
        "conv": mx.zeros((batch, spec.conv_kernel - 1, spec.conv_size), dtype),
        "ssm": mx.zeros((batch, spec.num_heads, spec.head_dim, spec.state_size), mx.float32),
    }


def step_sizes(spec: Mamba2Spec, p: dict, dt: mx.array) -> mx.array:
    """``dt [B, L, heads]`` in float32: softplus of the projection plus ``dt_bias``, clipped to the limit."""
    low, high = spec.time_step_limit
    return mx.clip(nn.softplus(dt.astype(mx.float32) + p["dt_bias"]), low, high)


def state_update(spec: Mamba2Spec):
    """The per-token update for ``recurrent.scan``: ``(state, x [B, H, Dh],
    B, C [B, G, N], dt, decay [B, H]) -> (state · C [B, H, Dh], state)``."""
    per_group = spec.num_heads // spec.num_groups

    def by_head(shared: mx.array) -> mx.array:
        return mx.repeat(shared, per_group, axis=1)  # head h reads group h // per_group

    def update(state, x, B, C, dt, decay):
        inflow = (dt[..., None] * x)[..., None] * by_head(B)[:, :, None, :]
        state = decay[..., None, None] * state + inflow
        return (state @ by_head(C)[..., None])[..., 0], state

    return update


def gated_norm(spec: Mamba2Spec, weight: mx.array, y: mx.array, gate: mx.array) -> mx.array:
    """``weight * rms_norm(silu(gate) * y)`` with each group of channels normalised on its own."""
    gated = nn.silu(gate) * y
    grouped = gated.reshape(*gated.shape[:-1], spec.num_groups, -1)
    return weight * ops.rms_norm(grouped, None, spec.eps).reshape(gated.shape)


def mixer(spec: Mamba2Spec, p: dict, x: mx.array, state: dict, keep: mx.array | None):
    """The mixer over ``x [B, L, d]`` after ``state``: ``(output [B, L, d], cache entry)``.
    ``keep`` as in ``recurrent.convolve`` / ``recurrent.scan``."""
    batch, length, _ = x.shape
    inner, groups = spec.inner_size, spec.num_groups * spec.state_size
    gate, conv_input, dt = mx.split(ops.linear(p["in_proj"], x), [inner, inner + spec.conv_size], axis=-1)
    conv = p["conv1d"]
    mixed, window = convolve(state["conv"], conv_input, conv["weight"], conv.get("bias"), keep)
    heads_in, B, C = mx.split(nn.silu(mixed), [inner, inner + groups], axis=-1)
    heads_in = heads_in.reshape(batch, length, spec.num_heads, spec.head_dim)
    B = B.reshape(batch, length, spec.num_groups, spec.state_size)
    C = C.reshape(batch, length, spec.num_groups, spec.state_size)
    dt = step_sizes(spec, p, dt)
    decay = mx.exp(dt * -mx.exp(p["A_log"]).astype(mx.float32))
    read, ssm = scan(state_update(spec), state["ssm"], (heads_in, B, C, dt, decay), keep)
    y = read.astype(x.dtype) + heads_in * p["D"].astype(x.dtype)[:, None]
    y = gated_norm(spec, p["norm"]["weight"], y.reshape(batch, length, inner), gate)
    return ops.linear(p["out_proj"], y), {"conv": window, "ssm": ssm}
