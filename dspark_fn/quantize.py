"""MLX affine quantization of a draft's linear layers, as a pure tree transform.

Quantized: every linear of the draft body (attention, MLP, ``fc``) whose input
width is a multiple of the group size. Kept in full precision: embeddings and
the output head (shared with the target), norms, the Markov tables (a lookup
and a low-rank r -> V map: small, and they steer every drafted token) and the
confidence head.
"""

import mlx.core as mx

from .ops import QUANT_GROUP_SIZE

KEEP_FULL_PRECISION = ("embed_tokens", "lm_head", "markov_head", "confidence_head")


def quantize_linear(p: dict, bits: int) -> dict:
    weight, scales, biases = mx.quantize(p["weight"], group_size=QUANT_GROUP_SIZE, bits=bits)
    return {**p, "weight": weight, "scales": scales, "biases": biases}


def is_quantizable(p: dict) -> bool:
    weight = p.get("weight")
    return (
        isinstance(weight, mx.array)
        and weight.ndim == 2
        and "scales" not in p
        and weight.shape[-1] % QUANT_GROUP_SIZE == 0
    )


def quantize_tree(tree, bits: int):
    if isinstance(tree, list):
        return [quantize_tree(item, bits) for item in tree]
    if not isinstance(tree, dict):
        return tree
    if is_quantizable(tree):
        return quantize_linear(tree, bits)
    return {key: quantize_tree(value, bits) for key, value in tree.items()}


def quantize_draft(draft_params: dict, bits: int) -> dict:
    """The draft tree with its body linears quantized to ``bits`` (4 or 8)."""
    if bits not in (4, 8):
        raise ValueError(f"--quant-draft takes 4 or 8 bits, not {bits}")
    return {
        key: value if key in KEEP_FULL_PRECISION else quantize_tree(value, bits)
        for key, value in draft_params.items()
    }
