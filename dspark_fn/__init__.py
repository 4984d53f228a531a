"""dspark_fn: DSpark self-speculative decoding as pure, compiled MLX functions.

The modules form layers, each importing only from its own and the layers
above it (README, "Layers"): foundations (records, caches, sampling and
accept rules), layer math, model families, loading, the round (``prefilling``,
``rounds``, ``buffers``; ``schedule`` and ``costs``), the policy
(``speculate``), the driver (``Decoder``, ``generate``), then the tools (serve, distill, evaluate,
benchmark, cli).

Shape letters used in docstrings: B batch rows, L tokens in a forward, C
cache capacity (slots), W verify width (anchor + drafts), G draft block
size, V vocabulary, V' draft vocabulary, d hidden size, F tapped features
(taps x d), H / H_kv query / key-value heads, D head dim, K top-K.
"""

from importlib import import_module

from . import blas

__version__ = "0.1.0"

blas.in_use()  # first, before anything loads mlx: OpenBLAS then serves MLX's CPU matmuls (see blas.py)

# Each public name and the module it lives in; imported on first use, so a
# tool (``dspark --help``, loading a checkpoint) loads only what it needs.
_EXPORTS = {
    "Cache": "cache",
    "load": "checkpoints", "load_draft": "checkpoints", "load_target": "checkpoints", "load_pair": "catalog",
    "ARCH_REGISTRY": "drafts", "DraftArch": "interfaces", "register_arch": "drafts", "resolve_arch": "drafts",
    "Decoder": "driver", "generate": "driver",
    "capacity_for": "buffers", "grow_cache": "buffers", "init_cache": "buffers",
    "insert": "prefilling", "prefill": "prefilling", "score_prompt": "prefilling",
    "load_prompt_cache": "prompt_cache.files", "prompt_prefix": "prompt_cache.files",
    "save_prompt_cache": "prompt_cache.files",
    "draft_block": "rounds", "propose": "rounds", "speculate": "policy", "Policy": "policy", "verify": "rounds",
    "verify_and_commit": "rounds", "verify_block": "rounds",
    "TRACE_COUNTS": "kernel",
    "GREEDY": "sampling", "Sampling": "sampling",
    "CostCurve": "schedule", "Offer": "schedule",
    "PointSource": "sources", "StoredAnswers": "sources", "default_sources": "sources",
    "Store": "store", "build_store": "store",
    "TARGET_REGISTRY": "targets", "TargetAdapter": "interfaces", "register_target": "targets",
    "resolve_target": "targets",
    "Copies": "types", "DraftBlock": "types", "Ended": "types", "Event": "types", "PairSpec": "types",
    "Params": "types", "Proposal": "types", "Round": "types", "Step": "types", "ImagePrompt": "types",
    "image_prompt": "vision",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dspark_fn' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ARCH_REGISTRY",
    "TARGET_REGISTRY",
    "Cache",
    "Copies",
    "DraftBlock",
    "CostCurve",
    "Decoder",
    "DraftArch",
    "Ended",
    "Event",
    "GREEDY",
    "ImagePrompt",
    "PairSpec",
    "Params",
    "Proposal",
    "Round",
    "Sampling",
    "Step",
    "TRACE_COUNTS",
    "TargetAdapter",
    "Policy",
    "Offer",
    "PointSource",
    "StoredAnswers",
    "Store",
    "build_store",
    "default_sources",
    "draft_block",
    "capacity_for",
    "generate",
    "grow_cache",
    "image_prompt",
    "init_cache",
    "insert",
    "load",
    "load_draft",
    "load_pair",
    "load_prompt_cache",
    "load_target",
    "prefill",
    "prompt_prefix",
    "propose",
    "register_arch",
    "register_target",
    "score_prompt",
    "resolve_arch",
    "resolve_target",
    "save_prompt_cache",
    "speculate",
    "verify",
    "verify_and_commit",
    "verify_block",
]
