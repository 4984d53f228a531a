"""mlx-vlm, which only some paths import (DeepSeek-V4 targets, images), is an
extra: its own dependencies (opencv, datasets with pyarrow and pandas,
mlx-audio) make most of an install's size and none of the text path's work."""

from importlib.util import find_spec

VLM_FIX = "pip install '.[vlm]' in the dspark_fn checkout (or pip install mlx-vlm)"


class MissingExtra(ImportError):
    """An optional package a path needs is not installed; the message names the extra."""


def vlm_missing(purpose: str) -> str | None:
    """Why ``purpose`` cannot run here (None: mlx-vlm is installed)."""
    if find_spec("mlx_vlm") is not None:
        return None
    return f"{purpose} needs mlx-vlm, which the vlm extra installs: {VLM_FIX}"


def require_vlm(purpose: str) -> None:
    """Raise ``MissingExtra`` naming the fix when mlx-vlm is not installed."""
    reason = vlm_missing(purpose)
    if reason:
        raise MissingExtra(reason)
