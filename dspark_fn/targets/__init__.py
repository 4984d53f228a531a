"""Target adapters: pure forwards with hidden-state taps over an mlx-lm parameter tree.

A family is one module exposing ``ADAPTER``, which declares the model types
it runs, its multimodal releases and where its parameter tree keeps its
parts; registering it is one entry in ``FAMILIES`` below. The round kernel,
the loaders and the rank splits only ever ask the adapter.
"""

import mlx.core as mx

from ..interfaces import Layout, Release, TargetAdapter
from ..registry import Registry
from . import deepseek_v4, gemma4, lfm2, llama, nemotron_h, qwen3_5

FAMILIES = (deepseek_v4, gemma4, lfm2, llama, nemotron_h, qwen3_5)


class TargetRegistry(Registry):
    """Adapters by the model_types they run and by the names of their releases."""

    def add(self, adapter: TargetAdapter) -> None:
        super().add(adapter)
        for release in adapter.releases:
            for name in release.names:
                self.register(name, adapter)

    def release(self, model_type: str | None) -> Release | None:
        """The release ``model_type`` names (None for a text model's own model_type)."""
        adapter = self.get(model_type)
        return next((r for r in adapter.releases if model_type in r.names), None) if adapter else None

    def family(self, model_type: str | None) -> str | None:
        """The text model ``model_type`` stands for: a release's, else its own."""
        release = self.release(model_type)
        return release.text_model_type if release else model_type


TARGET_REGISTRY = TargetRegistry("target", [family.ADAPTER for family in FAMILIES])


def text_model_config(config: dict) -> dict:
    """The config of the model a target runs: for a multimodal release (the
    text model under ``text_config``) its text model's, as mlx-lm builds it
    (a top-level ``vocab_size`` wins; a top-level ``quantization`` applies);
    any other config as it is."""
    release = TARGET_REGISTRY.release(config.get("model_type"))
    if release is None or "text_config" not in config:
        return config
    text = dict(config["text_config"], model_type=release.text_model_type)
    for key in ("vocab_size", "quantization"):
        if key in config:
            text[key] = config[key]
    return text


def target_family(model_type: str | None) -> str | None:
    """The text model a target ``model_type`` (a release's included) runs."""
    return TARGET_REGISTRY.family(model_type)


def mlx_lm_wrapper(model_type: str) -> Release | None:
    """The release mlx-lm builds for ``model_type`` around the text model:
    for a release's own model_type, or for a text model mlx-lm has no module
    of its own for (built inside its release); None when mlx-lm builds the
    text model alone."""
    from importlib.util import find_spec

    release = TARGET_REGISTRY.release(model_type)
    if release is not None and release.model_type == model_type:
        return release
    if model_type not in TARGET_REGISTRY or find_spec(f"mlx_lm.models.{model_type}") is not None:
        return None
    return next((r for r in TARGET_REGISTRY[model_type].releases if r.text_model_type == model_type), None)


def activation_dtype(layout: Layout, target_params: dict):
    """The dtype a target computes in: its embedding's (its scales' when
    affine-quantized; bfloat16 for microscaling formats, whose scales are
    exponents)."""
    embedding = layout.embedding_module(target_params)
    if "scales" not in embedding:
        return embedding["weight"].dtype
    return embedding["scales"].dtype if "biases" in embedding else mx.bfloat16


def register_target(model_type: str, adapter: TargetAdapter) -> None:
    """Register a target adapter under ``model_type`` (``TARGET_REGISTRY.add``
    registers one under every name it declares)."""
    TARGET_REGISTRY.register(model_type, adapter)


def resolve_target(config: dict) -> TargetAdapter:
    """The ``TargetAdapter`` of a target config (by its ``model_type``); ``ValueError`` names the known ones."""
    return TARGET_REGISTRY.resolve(config)


def adapter_of(spec) -> TargetAdapter:
    """The adapter that runs a target spec (by the spec's ``model_type``)."""
    return TARGET_REGISTRY.resolve({"model_type": spec.model_type})
