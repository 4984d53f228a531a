"""Use OpenBLAS for MLX's CPU matmuls on Linux when it is installed.

The Linux ``mlx[cpu]`` wheel links the reference BLAS; with OpenBLAS
preloaded, multi-token forwards (prefill, verify) run several times faster
and compute the same results. A library cannot be preloaded after start-up,
so the command line re-executes itself once with ``LD_PRELOAD`` set.
Set ``DSPARK_NO_OPENBLAS=1`` to keep the default BLAS.
"""

import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def openblas_library() -> str | None:
    return next((path for path in CANDIDATES if Path(path).is_file()), None)


def reexec_with_openblas() -> None:
    """Restart this process with OpenBLAS preloaded, if useful and possible."""
    if not sys.platform.startswith("linux") or os.environ.get("DSPARK_NO_OPENBLAS"):
        return
    library = openblas_library()
    preload = os.environ.get("LD_PRELOAD", "")
    if library is None or "openblas" in preload:
        return
    env = dict(os.environ, LD_PRELOAD=f"{library} {preload}".strip())
    os.execve(sys.executable, [sys.executable, "-m", "dspark_fn.cli", *sys.argv[1:]], env)
