"""MLX affine quantization of a pair, as pure tree transforms.

Draft (``quantize_draft``): every linear of the draft body (attention, MLP,
``fc``) whose input width is a multiple of the group size. Kept in full
precision: embeddings and the output head (shared with the target), norms,
the Markov tables (a lookup and a low-rank r -> V map: small, and they steer
every drafted token) and the confidence head.

Target (``quantize_target``): exactly what ``mlx_lm.convert -q`` does to the
same model (``nn.quantize`` over mlx-lm's own module tree: every linear and
embedding whose input width the group size divides, with the settings the
model's ``quant_predicate`` asks for, e.g. 8-bit MoE routers), so the result
is the quantized checkpoint people download, and greedy output is mlx-lm's
greedy output on it.
"""

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

GROUP_SIZE = 64
BITS = (4, 8)
KEEP_FULL_PRECISION = ("embed_tokens", "lm_head", "markov_head", "confidence_head")


def check_bits(bits: int, what: str) -> None:
    if bits not in BITS:
        raise ValueError(f"--quant-{what} takes 4 or 8 bits, not {bits}")


def quantize_linear(p: dict, bits: int) -> dict:
    weight, scales, biases = mx.quantize(p["weight"], group_size=GROUP_SIZE, bits=bits)
    return {**p, "weight": weight, "scales": scales, "biases": biases}


def is_quantizable(p: dict) -> bool:
    weight = p.get("weight")
    return (
        isinstance(weight, mx.array)
        and weight.ndim == 2
        and "scales" not in p
        and weight.shape[-1] % GROUP_SIZE == 0
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
    check_bits(bits, "draft")
    return {
        key: value if key in KEEP_FULL_PRECISION else quantize_tree(value, bits)
        for key, value in draft_params.items()
    }


def convert_predicate(model, layout: dict):
    """``mlx_lm.convert -q``'s choice per module: quantizable modules whose
    input width the group size divides, as the model's own ``quant_predicate``
    (if any) says; settings other than the default are noted in ``layout``."""
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module) -> bool | dict:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % GROUP_SIZE:
            return False
        choice = own(path, module) if own is not None else True
        if isinstance(choice, dict):
            layout[path] = choice
        return choice

    return predicate


def quantize_target(config: dict, target_params: dict, bits: int) -> tuple[dict, dict]:
    """``(params, config)`` of a float target quantized as ``mlx_lm.convert -q`` would."""
    import mlx.nn as nn

    from .checkpoints import mlx_lm_model
    from .targets import mlx_lm_wrapper

    check_bits(bits, "target")
    if config.get("quantization"):
        raise ValueError("the target is already quantized; --quant-target takes a float checkpoint")
    model = mlx_lm_model(config, target_params)
    layout = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    nn.quantize(model, group_size=GROUP_SIZE, bits=bits, class_predicate=convert_predicate(model, layout))
    params = tree_unflatten(tree_flatten(model.parameters()))
    wrapper = mlx_lm_wrapper(config["model_type"])
    if wrapper is not None:  # mlx-lm built the text model inside its release
        params = params[wrapper.text]
    return params, {**config, "quantization": layout}
