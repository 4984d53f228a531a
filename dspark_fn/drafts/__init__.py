"""DSpark draft architectures, chosen by the checkpoint's ``model_type``.

Adding a backbone is one module exposing ``ARCH`` (which names the model types
it is registered under) and one entry below.
Drafts that keep their DSpark settings in a ``dflash_config`` object run
the qwen3 backbone whatever their ``model_type`` (``drafts/dflash.py``).
"""

from ..interfaces import DraftArch
from ..registry import Registry
from . import deepseek_v4, dflash, gemma4, qwen3

ARCH_REGISTRY = Registry("draft", [deepseek_v4.ARCH, gemma4.ARCH, qwen3.ARCH])

# The backbone ``dspark train`` gives a fresh draft, whatever the target's family.
FRESH_ARCH = qwen3.ARCH


def register_arch(model_type: str, arch: DraftArch) -> None:
    """Register a draft architecture under ``model_type``."""
    ARCH_REGISTRY.register(model_type, arch)


def resolve_arch(config: dict) -> DraftArch:
    """The ``DraftArch`` of a draft config (by its ``model_type``, or its ``dflash_config``);
    ``ValueError`` names the known ones."""
    if dflash.is_dflash_layout(config):
        return dflash.ARCH
    return ARCH_REGISTRY.resolve(config)
