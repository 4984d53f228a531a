"""Target adapters: pure forwards with hidden-state taps over an mlx-lm parameter tree.

An adapter is one module exposing ``ADAPTER``; registering a family is one
line in the registry below. The round kernel only ever calls the adapter.
"""

from . import deepseek_v4, gemma4, llama
from .base import TargetAdapter

TARGET_REGISTRY: dict[str, TargetAdapter] = {
    "deepseek_v4": deepseek_v4.ADAPTER,
    "gemma4_text": gemma4.ADAPTER,
    "llama": llama.ADAPTER,
    "mistral": llama.ADAPTER,
    "qwen2": llama.ADAPTER,
    "qwen3": llama.ADAPTER,
}


def register_target(model_type: str, adapter: TargetAdapter) -> None:
    TARGET_REGISTRY[model_type] = adapter


def resolve_target(config: dict) -> TargetAdapter:
    model_type = config.get("model_type")
    if model_type not in TARGET_REGISTRY:
        raise ValueError(
            f"unknown target model_type {model_type!r}; supported target families: "
            f"{', '.join(sorted(TARGET_REGISTRY))}"
        )
    return TARGET_REGISTRY[model_type]
