"""DeepSeek's FP8/FP4 release format as MLX microscaling weights.

DeepSeek-V4 releases store most projections as FP8 (``F8_E4M3`` bytes) with
one power-of-two scale (``F8_E8M0``) per 128 x 128 block, and routed experts
as FP4 (``I8``, two e2m1 values a byte, low nibble first) with one such scale
per 32 values; each ``X.weight`` has its scale at ``X.scale``. MLX runs both
without dequantizing: ``mxfp8`` and ``mxfp4`` keep one uint8 exponent per 32
values of a row, so a block scale is repeated over its rows and its four
groups of 32 columns, and the bytes are only reinterpreted as uint32 words.
"""

import mlx.core as mx

GROUP = 32  # values per MLX microscaling scale


def scaled_weights(weights: dict) -> set:
    """Prefixes ``X.`` of every ``X.weight`` that comes with an ``X.scale``."""
    return {key[: -len("scale")] for key in weights if key.endswith(".scale") and key[: -len("scale")] + "weight" in weights}


def block_scales(scale: mx.array, rows: int, columns: int, block: int) -> mx.array:
    """Per-32-column scales ``[rows, columns / 32]`` of one scale per ``block x block`` tile."""
    return mx.repeat(mx.repeat(scale, block // GROUP, axis=-1), block, axis=-2)[..., :rows, : columns // GROUP]


def to_mlx(weights: dict, block: int = 128) -> dict:
    """The tensors with every FP8/FP4 ``X.weight`` + ``X.scale`` pair as an
    MLX ``X.weight`` (uint32 words) + ``X.scales`` (uint8 exponents); other
    tensors unchanged."""
    paired = scaled_weights(weights)
    converted = {}
    for key, value in weights.items():
        prefix = key.rpartition(".")[0] + "."
        if prefix not in paired:
            converted[key] = value
        elif key.endswith(".weight"):
            scale = weights[prefix + "scale"]
            converted[key] = value.view(mx.uint32)
            if value.dtype == mx.uint8:  # FP8 e4m3, block scales
                converted[prefix + "scales"] = block_scales(scale, value.shape[-2], value.shape[-1], block)
            elif value.dtype == mx.int8:  # FP4 e2m1 pairs, a scale per 32 values
                converted[prefix + "scales"] = scale
            else:
                raise ValueError(f"{key} has a .scale companion but dtype {value.dtype}: expected FP8 (uint8) "
                                 f"or FP4 (int8)")
    return converted
