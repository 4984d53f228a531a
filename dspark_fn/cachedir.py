"""Where dspark_fn keeps what it prepares or measures once per machine: the
OpenBLAS copy it loads (``blas``) and the timed cost curves (``costs``); and
where MLX keeps the kernels it compiles.

``DSPARK_FN_CACHE`` names the folder; otherwise ``$XDG_CACHE_HOME/dspark_fn``,
else ``~/.cache/dspark_fn``. Deleting it is always safe: everything in it is
made again on first use.
"""

import os
import tempfile
from pathlib import Path

CACHE_DIR_ENV = "DSPARK_FN_CACHE"


def cache_root() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark_fn"


def mlx_kernel_dir(mlx_version: str) -> Path:
    """Where MLX keeps the CPU kernels ``mx.compile`` builds (in the temporary
    folder, so a reboot that empties it means compiling them again)."""
    return Path(tempfile.gettempdir()) / "mlx" / mlx_version / "cpu"
