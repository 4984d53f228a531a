"""MLX's kernel JIT on the CPU, and ``DSPARK_CPU_JIT=0`` to go without it.

On the CPU, ``mx.compile`` fuses each chain of elementwise operations in a
traced graph into a C++ kernel, which MLX builds with ``g++`` the first time
it meets it and keeps in ``$TMPDIR/mlx/<version>/cpu``. A first answer of
the embedded default meets some forty of them: about 30 s of building where
that folder is empty (a fresh ``TMPDIR``, or after a reboot), 8 s with the
preamble precompiled (below), nothing once they are built. Without the JIT,
MLX runs a compiled function as written on every call: no build, and
rounds about 15% slower on the speculative path (the host runs every small
operation of the round's masks, positions and sampling one by one;
BENCHMARK.md, section 0t). So the JIT stays on by default, and
``DSPARK_CPU_JIT=0`` turns it off for a process that answers once on empty
caches.

Most of a kernel's build is ``g++`` reading MLX's preamble (some 70,000
lines of headers every kernel includes): 0.7 s a kernel, 0.2 s where the
preamble is precompiled. ``precompile_preamble`` builds that precompiled
header once per kernel folder, in the background from the process's start,
with MLX's own flags, where ``g++`` looks first for it: the folder of each
kernel's source (``mlx/backend/cpu/compiled_preamble.h.gch`` there). ``g++``
checks a precompiled header before using it and reads the header itself
where it does not fit, so a change in MLX's flags costs time, never a wrong
kernel; one built from an older header is rebuilt.

MLX asks once per process, at its first compiled function, whether ``g++``
is on the PATH (without a compiler it does not compile on the CPU, a state
it supports); ``keep_off`` lets it ask with an empty PATH, for that one
question, before any of dspark_fn's kernels is traced. Where something was
compiled on the CPU before, MLX has asked already and its answer stands.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ENVIRONMENT = "DSPARK_CPU_JIT"
PREAMBLE = "mlx/backend/cpu/compiled_preamble.h"  # what every kernel MLX builds on the CPU includes first
# the flags of MLX's own build command, which a precompiled header must match for g++ to use it
MLX_FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC", "-shared")


def refused(environ=os.environ) -> bool:
    """Whether the CPU kernel JIT is turned off (``DSPARK_CPU_JIT=0``)."""
    return environ.get(ENVIRONMENT, "").strip() == "0"


def keep_off(environ=os.environ) -> None:
    """Put MLX's one question about its compiler with no compiler on the
    PATH, where the JIT is turned off and MLX computes on the CPU."""
    if not refused(environ) or mx.default_device() != mx.cpu:
        return
    path = environ.get("PATH")
    environ["PATH"] = ""
    try:
        mx.eval(mx.compile(lambda x: x * 2 + 1)(mx.zeros((1,))))  # a chain MLX would fuse: it asks here
    finally:
        if path is None:
            del environ["PATH"]
        else:
            environ["PATH"] = path


def mlx_headers() -> Path | None:
    """The headers MLX ships with its library, which its kernels include; None where it ships none."""
    folder = Path(mx.__file__).parent / "include"
    return folder if (folder / PREAMBLE).is_file() else None


def kernel_folder() -> Path:
    """Where MLX builds its CPU kernels: ``$TMPDIR/mlx/<version>/cpu``."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def precompiled_preamble() -> Path:
    """The precompiled preamble ``g++`` finds for every kernel in the kernel folder."""
    return kernel_folder() / (PREAMBLE + ".gch")


def precompile_preamble(environ=os.environ) -> subprocess.Popen | None:
    """Start building the precompiled preamble where MLX's kernel JIT will
    run and it is missing or older than the header; the build's process, or
    None where there is nothing to build. It outlives this process if need
    be, and appears whole or not at all (written aside, then renamed)."""
    headers, compiler = mlx_headers(), shutil.which("g++", path=environ.get("PATH"))
    if refused(environ) or mx.default_device() != mx.cpu or headers is None or compiler is None \
            or not sys.platform.startswith("linux"):  # clang, macOS's g++, finds no precompiled header by itself
        return None
    target = precompiled_preamble()
    try:
        if target.stat().st_mtime >= (headers / PREAMBLE).stat().st_mtime:
            return None
    except FileNotFoundError:
        pass
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # MLX cannot build kernels there either; it says so when it tries
    build = [compiler, *MLX_FLAGS, "-I", str(headers), "-x", "c++-header", str(headers / PREAMBLE)]
    aside_then_renamed = 'out=$1; shift; "$@" -o "$out.$$" && mv -f "$out.$$" "$out" || rm -f "$out.$$"'
    return subprocess.Popen(["sh", "-c", aside_then_renamed, "sh", str(target), *build], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
