"""``dspark --version``, ``dspark doctor``, and a first run that times
nothing up front. Each runs the command line in a process of its own, with
a cache folder of its own and the hub switched off.

Breaks tried: the doctor not reporting a BLAS load failure as a problem (the
wrong-path case exited 0), the version line leaving out mlx-vlm, one check
raising and taking the checks after it along.
"""

import io
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import dspark_fn
from dspark_fn import blas, doctor

ROOT = Path(__file__).resolve().parents[1]


def dspark(*args, cache: Path, **env) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DSPARK_OPENBLAS", "DSPARK_NO_OPENBLAS")}
    return subprocess.run([sys.executable, "-m", "dspark_fn.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=inherited | {"PYTHONPATH": str(ROOT), "DSPARK_FN_CACHE": str(cache),
                                                                  "HF_HUB_OFFLINE": "1"} | env)


def test_version_names_the_library_and_what_it_runs_on(tmp_path):
    done = dspark("--version", cache=tmp_path)
    assert done.returncode == 0, done.stderr
    line = done.stdout + done.stderr
    assert f"dspark_fn {dspark_fn.__version__}" in line
    for package in ("mlx", "mlx-lm", "mlx-vlm"):
        assert f"{package} {metadata.version(package)}" in line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS report is about Linux")
def test_doctor_says_which_blas_serves_mlx_and_where_the_caches_are(tmp_path):
    if blas.pip_openblas() is None:
        pytest.skip("cmeel-openblas is not installed")
    done = dspark("doctor", cache=tmp_path, DSPARK_OPENBLAS="pip")
    report = done.stdout
    if "cannot run on this CPU" in report:  # a processor pip's build does not target: a problem, with its fix
        assert "how: loading" in report and f"fix: {blas.SYSTEM_FIX}" in report and done.returncode == 1, report
    else:
        assert "how: pip's cmeel-openblas" in report and f"file: {tmp_path / 'openblas'}" in report
        assert "this BLAS serves it" in report
    assert f"folder: {tmp_path} (DSPARK_FN_CACHE)" in report
    assert "unreachable (HF_HUB_OFFLINE is set)" in report
    for package in ("mlx", "mlx-lm", "mlx-vlm"):
        assert f"{package} {metadata.version(package)}" in report
    problems = report.split("problems", 1)[1]
    assert (done.returncode == 0) == (problems.strip() == "none"), report


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS report is about Linux")
def test_doctor_names_each_problem_with_its_fix(tmp_path):
    done = dspark("doctor", cache=tmp_path, DSPARK_OPENBLAS="/no/such/libopenblas.so.0")
    assert done.returncode == 1
    problems = done.stdout.split("problems", 1)[1]
    assert "bundled reference BLAS" in problems and "DSPARK_OPENBLAS=/no/such/libopenblas.so.0 is not a file" in problems
    assert "fix: point DSPARK_OPENBLAS at an OpenBLAS library" in problems
    blocked = tmp_path / "file"
    blocked.write_text("")
    done = dspark("doctor", cache=blocked / "cache", DSPARK_NO_OPENBLAS="1")
    assert done.returncode == 1
    assert f"the cache folder {blocked / 'cache'} cannot be written" in done.stdout
    assert "fix: export DSPARK_FN_CACHE=<a writable folder>" in done.stdout


def test_a_check_that_raises_is_a_problem_and_the_others_still_run(tmp_path, monkeypatch):
    def device():
        raise RuntimeError("no device answers")

    monkeypatch.setattr(doctor, "device", device)
    monkeypatch.setattr(doctor, "hub_answers", lambda: "switched off in this test")
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    out = io.StringIO()
    assert doctor.run(out) == 1
    report = out.getvalue()
    for topic in ("versions", "device", "BLAS", "caches", "models"):
        assert any(line.startswith(topic) for line in report.splitlines()), (topic, report)
    problems = report.split("problems", 1)[1]
    assert "the device check failed (RuntimeError: no device answers)" in problems
    assert "fix: " in problems.split("the device check failed", 1)[1].splitlines()[1]


def test_the_suite_keeps_what_it_writes_in_a_temporary_folder():
    """``tests/conftest.py`` points the package's cache (and the hub's) at a
    folder of its own, so the suite leaves the user's home as it was."""
    import tempfile

    from dspark_fn.cachedir import cache_root

    assert cache_root().is_relative_to(tempfile.gettempdir()) and not cache_root().is_relative_to(Path.home())
    assert Path(os.environ["HF_HOME"]).is_relative_to(tempfile.gettempdir())


def test_a_first_run_times_nothing_up_front(parity_dir, tmp_path):
    """The first run on an empty cache folder answers without a cost
    benchmark: no calibration on stderr, nothing written to the folder; a
    second run gives the same tokens."""
    root = parity_dir / "qwen3_tiny"
    args = ("generate", "--model", root / "target", "--draft", root / "draft", "--prompt-tokens", "1,2,3",
            "--max-tokens", 8, "--json")
    first = dspark(*args, cache=tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    written = {path.name for path in (tmp_path / "cache").iterdir()} if (tmp_path / "cache").exists() else set()
    assert "round costs" not in first.stderr and written <= {"openblas"}  # pip's OpenBLAS may be placed there
    again = dspark(*args, cache=tmp_path / "cache")
    assert again.returncode == 0 and json.loads(again.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
