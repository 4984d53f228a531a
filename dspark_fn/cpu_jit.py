"""MLX's kernel JIT on the CPU, and ``DSPARK_CPU_JIT=0`` to go without it.

On the CPU, ``mx.compile`` fuses each chain of elementwise operations in a
traced graph into a C++ kernel, which MLX builds with ``g++`` the first time
it meets it and keeps in ``$TMPDIR/mlx/<version>/cpu``. A first answer of
the embedded default meets about ninety of them: some 30 s of building
where that folder is empty (a fresh ``TMPDIR``, or after a reboot), nothing
once they are built. Without the JIT, MLX runs a compiled function as
written on every call: no build, and rounds about 15% slower on the
speculative path (the host runs every small operation of the round's
masks, positions and sampling one by one; BENCHMARK.md, section 0t). So
the JIT stays on by default, and ``DSPARK_CPU_JIT=0`` turns it off for a
process that answers once on empty caches.

MLX asks once per process, at its first compiled function, whether ``g++``
is on the PATH (without a compiler it does not compile on the CPU, a state
it supports); ``keep_off`` lets it ask with an empty PATH, for that one
question, before any of dspark_fn's kernels is traced. Where something was
compiled on the CPU before, MLX has asked already and its answer stands.
"""

import os

import mlx.core as mx

ENVIRONMENT = "DSPARK_CPU_JIT"


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
