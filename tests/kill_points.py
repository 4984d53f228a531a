"""Run ``dspark train`` in this process and SIGKILL it at a chosen write.

    python kill_points.py LOG KILL_AT MODE -- dspark-train-arguments...

Every write the stages make goes through ``dspark_fn.atomic``; this counts
them and, at write number ``KILL_AT`` (1-based; 0: never), kills the process
in the middle of it, inside the real write: once the file (or folder) it
writes is filled, ``MODE`` ``torn`` cuts it to half its bytes and ``unrenamed``
leaves it whole, then the process dies before the write returns (an
appended line is cut short, or not written).
Each write's stage (answers, features, checkpoints, draft) and file name
are added to ``LOG`` before it happens, the kill's with a ``kill`` mark.
"""

import os
import signal
import sys
from pathlib import Path

from dspark_fn import atomic

log_path, kill_at, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
count = 0


def stage_of(path) -> str:
    parts = Path(path).parts
    for stage in ("checkpoints", "features", "draft"):
        if stage in parts:
            return stage
    return "answers" if Path(path).name.startswith("answers") else "other"


def counted(name: str, kill_inside):
    """``atomic.<name>`` counting its calls; the chosen one runs as ``kill_inside``."""
    original = getattr(atomic, name)

    def write(path, payload):
        global count
        count += 1
        with log_path.open("a") as log:
            log.write(f"{stage_of(path)} {Path(path).name} {'kill' if count == kill_at else 'write'}\n")
        if count == kill_at:
            kill_inside(original, Path(path), payload)
        return original(path, payload)

    setattr(atomic, name, write)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def torn_line(original, path: Path, line: str) -> None:
    if mode == "torn":
        with path.open("a") as handle:
            handle.write(line[: len(line) // 2])
    die()


def cut(file: Path) -> None:
    if mode == "torn":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def inside_file(original, path: Path, write) -> None:
    """The real write, killed once its callback has filled the file it was given."""

    def fill_then_die(file: Path) -> None:
        write(file)
        cut(file)
        die()

    original(path, fill_then_die)


def inside_folder(original, path: Path, fill) -> None:
    def fill_then_die(folder: Path) -> None:
        fill(folder)
        for file in folder.iterdir():
            cut(file)
        die()

    original(path, fill_then_die)


counted("append_line", torn_line)
counted("write_with", inside_file)
counted("write_folder", inside_folder)

from dspark_fn.cli import main  # noqa: E402  (after the writes are counted)

sys.exit(main(sys.argv[sys.argv.index("--") + 1 :]))
