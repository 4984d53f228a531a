"""Fresh draft weights in checkpoint layout (for training from scratch and for tests)."""

import math

import mlx.core as mx

from ..interfaces import DraftArch


def random_draft_weights(arch: DraftArch, spec, seed: int = 0, gain: float = 1.0) -> dict:
    """Every checkpoint tensor of ``spec``: matrices ~ N(0, gain^2 / fan_in),
    vectors (norm weights, scalars) = 1, biases = 0. Keys are checkpoint keys."""
    key = mx.random.key(seed)
    weights = {}
    for name, shape in sorted(arch.checkpoint_shapes(spec).items()):
        key, sub = mx.random.split(key)
        if name.endswith(".bias"):
            weights[name] = mx.zeros(shape)
        elif len(shape) == 1:
            weights[name] = mx.ones(shape)
        else:
            weights[name] = mx.random.normal(shape, key=sub) * (gain / math.sqrt(shape[-1]))
    return weights
