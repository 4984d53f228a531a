"""OpenBLAS under MLX's CPU matmuls (``dspark_fn/blas.py``).

Each case runs a fresh Python process, since the BLAS is chosen once, when
``dspark_fn`` is first imported, and checks two things: which files the
process maps (``/proc/self/maps``) and MLX's fp32 matmul, bit for bit, against
a process whose BLAS is known (``LD_PRELOAD`` of the same file, or the bundled
one). Every BLAS sums in its own order, so equal digests mean the same BLAS
serves MLX. Inherited BLAS settings are cleared, and each module gets its own
cache folder, so the pip case builds its patched copy from nothing.

Breaks tried: loading the library without ``RTLD_GLOBAL`` (MLX's digest
stayed the bundled one: the pip and explicit-path cases failed), not
rewriting the libgfortran entry (with the system's libgfortran present the
library loaded, but mapped it: the fresh-machine case failed), the system's
OpenBLAS after pip's in the search order (search order and default cases),
no warning when mlx came first, the refusal not kept (the probe ran again).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fn import blas
from helpers import missing_prerequisite

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="MLX links a BLAS of its own on Linux only")

REPORT = """
import json
{before}
import dspark_fn
from dspark_fn import blas
maps = sorted({{line.split(maxsplit=5)[-1].strip() for line in open("/proc/self/maps") if line.count(" ") >= 5}})
used = blas.in_use()
print(json.dumps({{"maps": maps, "library": used.library, "how": used.how, "fingerprint": blas.matmul_fingerprint()}}))
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("dspark_cache")


def run_python(cache: Path, code: str, **env) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DSPARK_OPENBLAS", "DSPARK_NO_OPENBLAS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=inherited | {"PYTHONPATH": str(ROOT), "DSPARK_FN_CACHE": str(cache)} | env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def report(cache: Path, before: str = "", **env) -> dict:
    done = run_python(cache, REPORT.format(before=before), **env)
    return json.loads(done.stdout) | {"stderr": done.stderr}


def openblas_files(maps: list[str]) -> list[str]:
    return [path for path in maps if Path(path).name.startswith("libopenblas")]


def bundled_fingerprint(cache: Path) -> str:
    bundled = report(cache, DSPARK_NO_OPENBLAS="1")
    assert openblas_files(bundled["maps"]) == [] and bundled["library"] is None
    return bundled["fingerprint"]


def test_search_order():
    assert blas.choose(None, "/system.so", "/pip.so") == ("/system.so", "system")
    assert blas.choose(None, None, "/pip.so") == ("/pip.so", "pip")
    assert blas.choose("/mine.so", "/system.so", "/pip.so") == ("/mine.so", "DSPARK_OPENBLAS")
    assert blas.choose("pip", "/system.so", "/pip.so") == ("/pip.so", "pip")
    assert blas.choose("pip", "/system.so", None) is None
    assert blas.choose(None, None, None) is None


def test_plain_import_serves_mlx_with_pips_openblas(cache):
    """The fresh machine: no system OpenBLAS (passed over), no LD_PRELOAD,
    only what pip installed: the patched copy is made in the cache, mapped
    with the mlx wheel's libgfortran (never a system one), and MLX's matmul
    is the one that copy computes when preloaded, not the bundled BLAS's."""
    if blas.pip_openblas() is None:
        missing_prerequisite("cmeel-openblas is not installed (a Linux dependency of dspark-fn)")
    pip = report(cache, DSPARK_OPENBLAS="pip")
    if pip["library"] is None:  # a processor pip's build does not target: refused, the system's OpenBLAS named
        assert "cannot run on this CPU" in pip["how"] and blas.SYSTEM_FIX in pip["how"], pip["how"]
        assert pip["stderr"].count("BlasWarning") == 1 and f"Fix: {blas.SYSTEM_FIX}" in pip["stderr"], pip["stderr"]
        assert openblas_files(pip["maps"]) == [] and pip["fingerprint"] == bundled_fingerprint(cache)
        assert [path.name for path in (cache / "openblas").glob("*/*")] == ["cannot_run.txt"]
        return
    copy = Path(pip["library"])
    assert copy.parent.parent == cache / "openblas" and pip["how"].startswith("pip's cmeel-openblas")
    assert openblas_files(pip["maps"]) == [str(copy)]
    gfortran = [path for path in pip["maps"] if Path(path).name.startswith("libgfortran")]
    assert gfortran == [str(blas.wheel_gfortran())], gfortran
    preloaded = report(cache, LD_PRELOAD=str(copy), DSPARK_NO_OPENBLAS="1")
    assert openblas_files(preloaded["maps"]) == [str(copy)] and preloaded["how"].startswith("loaded before")
    assert pip["fingerprint"] == preloaded["fingerprint"] != bundled_fingerprint(cache)
    assert pip["stderr"] == ""
    again = report(cache, DSPARK_OPENBLAS="pip")  # the copy is made once
    assert again["library"] == str(copy) and len(list((cache / "openblas").iterdir())) == 1


def test_default_takes_the_systems_openblas_first(cache):
    system = blas.system_openblas()
    if system is None:
        pytest.skip("no system OpenBLAS on this machine")
    found = report(cache)
    assert found["library"] == system and found["how"] == "the system's OpenBLAS"
    assert openblas_files(found["maps"]) == [os.path.realpath(system)]
    assert found["fingerprint"] != bundled_fingerprint(cache)


def test_explicit_path_and_a_wrong_one(cache):
    chosen = blas.system_openblas() or blas.pip_openblas()
    if chosen is None:
        missing_prerequisite("no OpenBLAS on this machine (cmeel-openblas is a Linux dependency of dspark-fn)")
    if chosen == blas.pip_openblas():  # pip's file needs the patched copy to load on a fresh machine
        chosen = report(cache, DSPARK_OPENBLAS="pip")["library"]  # None where this CPU cannot run pip's build
    if chosen is not None:
        explicit = report(cache, DSPARK_OPENBLAS=chosen)
        assert explicit["library"] == chosen and explicit["how"] == "DSPARK_OPENBLAS"
        assert explicit["fingerprint"] != bundled_fingerprint(cache)
    wrong = report(cache, DSPARK_OPENBLAS="/no/such/libopenblas.so.0")
    assert wrong["library"] is None and openblas_files(wrong["maps"]) == []
    assert wrong["stderr"].count("BlasWarning") == 1 and "DSPARK_OPENBLAS=/no/such/libopenblas.so.0 is not a file" \
        in wrong["stderr"]


def test_importing_mlx_first_warns_once_and_names_the_fix(cache):
    if blas.choose(None, blas.system_openblas(), blas.pip_openblas()) is None:
        missing_prerequisite("no OpenBLAS on this machine (cmeel-openblas is a Linux dependency of dspark-fn)")
    late = report(cache, before="import mlx.core\nimport dspark_fn.cli, dspark_fn.costs")
    assert late["library"] is None and late["how"] == "mlx was imported before dspark_fn"
    assert openblas_files(late["maps"]) == []
    assert late["stderr"].count("BlasWarning") == 1, late["stderr"]
    assert "Import dspark_fn before mlx" in late["stderr"] and "LD_PRELOAD=" in late["stderr"]
    assert late["fingerprint"] == bundled_fingerprint(cache)
    quiet = report(cache, before="import mlx.core", DSPARK_NO_OPENBLAS="1")
    assert quiet["stderr"] == "" and quiet["how"] == "DSPARK_NO_OPENBLAS is set"


def test_a_library_that_cannot_multiply_is_refused_and_the_refusal_kept(tmp_path, monkeypatch):
    library, gfortran = blas.pip_openblas(), blas.wheel_gfortran()
    if library is None or gfortran is None:
        missing_prerequisite("cmeel-openblas or the mlx[cpu] wheel's libgfortran is not installed")
    reason = blas.cannot_run(str(gfortran))  # a real library without cblas_sgemm: the probe fails
    assert reason is not None and "exit status 1" in reason
    probes = []

    def refusing(path):
        probes.append(path)
        return "pip's OpenBLAS cannot run on this CPU: a test matmul ended with SIGILL"

    monkeypatch.setattr(blas, "cannot_run", refusing)
    for _ in range(2):
        with pytest.raises(OSError, match="ended with SIGILL"):
            blas.pip_copy(Path(library), gfortran, tmp_path)
    assert len(probes) == 1
    assert not list(tmp_path.glob("openblas/*/libopenblas*")), "a library that failed its matmul was placed"
