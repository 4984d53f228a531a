"""DSpark draft architectures, chosen by the checkpoint's ``model_type``.

Adding a backbone is one module exposing ``ARCH`` and one line below.
"""

from ..registry import Registry
from . import deepseek_v4, gemma4, qwen3
from .base import DraftArch

ARCH_REGISTRY = Registry(
    "draft",
    {
        "deepseek_v4": deepseek_v4.ARCH,
        "gemma4_text": gemma4.ARCH,
        "qwen3": qwen3.ARCH,
    },
)


def register_arch(model_type: str, arch: DraftArch) -> None:
    """Register a draft architecture under ``model_type``."""
    ARCH_REGISTRY.register(model_type, arch)


def resolve_arch(config: dict) -> DraftArch:
    """The ``DraftArch`` of a draft config (by its ``model_type``); ``ValueError`` names the known ones."""
    return ARCH_REGISTRY.resolve(config)
