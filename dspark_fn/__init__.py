"""dspark_fn: DSpark self-speculative decoding as pure, compiled MLX functions."""

from .cache import Cache
from .checkpoints import load, load_draft, load_target
from .drafts import ARCH_REGISTRY, DraftArch, register_arch, resolve_arch
from .speculate import (
    TRACE_COUNTS,
    Event,
    PairSpec,
    Params,
    Proposal,
    Round,
    draft_block,
    generate,
    init_cache,
    prefill,
    speculate,
    verify_and_commit,
    verify_block,
)
from .targets import TARGET_REGISTRY, TargetAdapter, register_target, resolve_target

__all__ = [
    "ARCH_REGISTRY",
    "TARGET_REGISTRY",
    "TRACE_COUNTS",
    "Cache",
    "DraftArch",
    "Event",
    "PairSpec",
    "Params",
    "Proposal",
    "Round",
    "TargetAdapter",
    "draft_block",
    "generate",
    "init_cache",
    "load",
    "load_draft",
    "load_target",
    "prefill",
    "register_arch",
    "register_target",
    "resolve_arch",
    "resolve_target",
    "speculate",
    "verify_and_commit",
    "verify_block",
]
