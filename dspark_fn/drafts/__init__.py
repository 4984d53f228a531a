"""DSpark draft architectures, chosen by the checkpoint's ``model_type``.

Adding a backbone is one module exposing ``ARCH`` and one line below.
"""

from . import deepseek_v4, gemma4, qwen3
from ..targets import family_of
from .base import DraftArch, DSparkFields

ARCH_REGISTRY: dict[str, DraftArch] = {
    "deepseek_v4": deepseek_v4.ARCH,
    "gemma4_text": gemma4.ARCH,
    "qwen3": qwen3.ARCH,
}


def register_arch(model_type: str, arch: DraftArch) -> None:
    ARCH_REGISTRY[model_type] = arch


def resolve_arch(config: dict) -> DraftArch:
    model_type = family_of(config.get("model_type"))  # a gemma4_unified_text draft is a gemma4_text draft
    if model_type not in ARCH_REGISTRY:
        raise ValueError(
            f"unknown draft model_type {config.get('model_type')!r}; supported draft architectures: "
            f"{', '.join(sorted(ARCH_REGISTRY))}"
        )
    return ARCH_REGISTRY[model_type]
