"""dspark_fn: DSpark self-speculative decoding as pure, compiled MLX functions."""

from .cache import Cache
from .checkpoints import load, load_draft, load_target
from .drafts import ARCH_REGISTRY, DraftArch, register_arch, resolve_arch
from .sampling import GREEDY, Sampling
from .schedule import CostCurve, VerifyPolicy
from .speculate import (
    TRACE_COUNTS,
    Event,
    PairSpec,
    Params,
    Proposal,
    Round,
    draft_block,
    generate,
    grow_cache,
    init_cache,
    prefill,
    propose,
    speculate,
    verify,
    verify_and_commit,
    verify_block,
    verify_policy,
)
from .targets import TARGET_REGISTRY, TargetAdapter, register_target, resolve_target

__all__ = [
    "ARCH_REGISTRY",
    "TARGET_REGISTRY",
    "TRACE_COUNTS",
    "Cache",
    "CostCurve",
    "DraftArch",
    "Event",
    "GREEDY",
    "PairSpec",
    "Params",
    "Proposal",
    "Round",
    "Sampling",
    "TargetAdapter",
    "VerifyPolicy",
    "draft_block",
    "generate",
    "grow_cache",
    "init_cache",
    "load",
    "load_draft",
    "load_target",
    "prefill",
    "propose",
    "register_arch",
    "register_target",
    "resolve_arch",
    "resolve_target",
    "speculate",
    "verify",
    "verify_and_commit",
    "verify_block",
    "verify_policy",
]
