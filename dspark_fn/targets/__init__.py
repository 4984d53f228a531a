"""Target adapters: pure forwards with hidden-state taps over an mlx-lm parameter tree.

An adapter is one module exposing ``ADAPTER``; registering a family is one
line in the registry below. The round kernel only ever calls the adapter.
"""

import mlx.core as mx

from ..interfaces import TargetAdapter
from ..registry import TEXT_FAMILY, Registry, family_of
from . import deepseek_v4, gemma4, lfm2, llama, nemotron_h, qwen3_5

TARGET_REGISTRY = Registry(
    "target",
    {
        "deepseek_v4": deepseek_v4.ADAPTER,
        "gemma4_text": gemma4.ADAPTER,
        "lfm2": lfm2.ADAPTER,
        "lfm2_moe": lfm2.ADAPTER,
        "llama": llama.ADAPTER,
        "mistral": llama.ADAPTER,
        "nemotron_h": nemotron_h.ADAPTER,
        "qwen2": llama.ADAPTER,
        "qwen3": llama.ADAPTER,
        "qwen3_5_moe_text": qwen3_5.ADAPTER,
        "qwen3_5_text": qwen3_5.ADAPTER,
        "qwen3_next": qwen3_5.ADAPTER,
    },
)


def text_model_config(config: dict) -> dict:
    """The config of the model a target runs: for a multimodal release (the
    text model under ``text_config``) its text model's, as mlx-lm builds it
    (a top-level ``vocab_size`` wins; a top-level ``quantization`` applies);
    any other config as it is."""
    if config.get("model_type") not in TEXT_FAMILY or "text_config" not in config:
        return config
    text = dict(config["text_config"], model_type=family_of(config["model_type"]))
    for key in ("vocab_size", "quantization"):
        if key in config:
            text[key] = config[key]
    return text


def target_module(target_params: dict, key: str) -> dict:
    """The target's embedding or output head (``{"weight"}``, plus ``scales``
    and ``biases`` when quantized), for drafts that share them. Nemotron-H
    keeps its layers under ``backbone`` and names its embedding ``embeddings``."""
    model = target_params.get("model", target_params.get("backbone", target_params))
    if key == "lm_head.weight" and "lm_head" in target_params:
        return target_params["lm_head"]
    return model["embed_tokens"] if "embed_tokens" in model else model["embeddings"]


def activation_dtype(target_params: dict):
    """The dtype a target computes in: its embedding's (its scales' when
    affine-quantized; bfloat16 for microscaling formats, whose scales are
    exponents)."""
    embedding = target_module(target_params, "embed_tokens.weight")
    if "scales" not in embedding:
        return embedding["weight"].dtype
    return embedding["scales"].dtype if "biases" in embedding else mx.bfloat16


def register_target(model_type: str, adapter: TargetAdapter) -> None:
    """Register a target adapter under ``model_type``."""
    TARGET_REGISTRY.register(model_type, adapter)


def resolve_target(config: dict) -> TargetAdapter:
    """The ``TargetAdapter`` of a target config (by its ``model_type``); ``ValueError`` names the known ones."""
    return TARGET_REGISTRY.resolve(config)
