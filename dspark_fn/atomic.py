"""Files written whole or not at all: each is written beside its final name,
flushed to disk, then renamed over it, so a process killed at any moment
leaves either the previous file or the new one, never a torn one.

The file written beside takes a name of its own, made new (``O_EXCL``:
never an existing file, nor a link planted under the name) and readable by
its owner alone; the rename then replaces whatever stands at the final
name (a link there is replaced, not followed)."""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

TEMPORARY = ".partial"  # suffix of a file or folder still being written


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_with(path, write: Callable[[Path], None]) -> Path:
    """``write(temporary_path)`` fills a new file (``NAME.<random>.partial``,
    mode 0600) that then replaces ``path`` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=TEMPORARY)
    os.close(descriptor)
    partial = Path(name)
    try:
        write(partial)
        _sync(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _sync(path.parent)  # the rename itself reaches the disk
    return path


def write_text(path, text: str) -> Path:
    return write_with(path, lambda partial: partial.write_text(text))


def append_line(path, line: str) -> None:
    """One line added at the end, on disk before this returns; a kill during
    the write leaves at most a torn last line, which readers drop."""
    with Path(path).open("a") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_folder(path, fill: Callable[[Path], None]) -> Path:
    """``fill(temporary_folder)`` writes the files of a folder that appears at
    ``path`` in one rename. ``path`` must not exist yet (give each version
    its own name); a half-written folder left by a kill is discarded."""
    path = Path(path)
    partial = path.with_name(path.name + TEMPORARY)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    fill(partial)
    for file in partial.iterdir():
        _sync(file)
    os.rename(partial, path)
    _sync(path.parent)
    return path

