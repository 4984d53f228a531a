"""Reading and writing checkpoint files: ``config.json`` and safetensors
weights (written whole or not at all). A leaf: model code that must read a
release's files uses it without reaching the loaders in ``checkpoints``."""

import json
from pathlib import Path

import mlx.core as mx

from . import atomic


def read_config(directory: Path, what: str) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{what} directory {directory} has no config.json")
    return json.loads(path.read_text())


def read_safetensors(directory: Path, what: str) -> dict:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{what} directory {directory} has no *.safetensors weights")
    weights = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return weights


def write_safetensors(path, weights: dict) -> Path:
    """``weights`` to ``path`` whole or not at all."""

    def write(partial: Path) -> None:
        with partial.open("wb") as handle:  # a file object: MLX would add a suffix to a path
            mx.save_safetensors(handle, dict(weights))

    return atomic.write_with(path, write)
