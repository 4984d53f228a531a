"""``dspark --version``, ``dspark doctor``, and what a first run prints while
it calibrates. Each runs the command line in a process of its own, with a
cache folder of its own and the hub switched off.

Breaks tried: the doctor not reporting a BLAS load failure as a problem (the
wrong-path case exited 0), the calibration printing no estimate (the
first-run case), the version line leaving out mlx-vlm, a corrupt cost cache
ending the report with a one-line error and no fix, one check raising and
taking the checks after it along.
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
from dspark_fn.costs import CalibrationStatus
from dspark_fn.progress import Status

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
    assert "how: pip's cmeel-openblas" in report and f"file: {tmp_path / 'openblas'}" in report
    assert "this BLAS serves it" in report
    assert f"folder: {tmp_path} (DSPARK_FN_CACHE)" in report and "cost curves: none yet" in report
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


def test_doctor_names_a_corrupt_cost_cache_with_its_fix_and_goes_on(tmp_path):
    corrupt = tmp_path / "verify_costs.json"
    corrupt.write_text('{"cut short": {"draft": 0.0')
    done = dspark("doctor", cache=tmp_path, DSPARK_NO_OPENBLAS="1")
    assert done.returncode == 1 and done.stderr == "", done.stderr
    problems = done.stdout.split("problems", 1)[1]
    assert f"the cost cache {corrupt} cannot be read" in problems
    assert f"fix: delete {corrupt}; the curves in it are measured again on the next run" in problems
    assert "unreachable (HF_HUB_OFFLINE is set)" in done.stdout  # the models check, after the caches


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"key": "not a curve"}'])
def test_a_cost_cache_in_another_layout_is_a_problem_not_an_error(tmp_path, monkeypatch, text):
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    (tmp_path / "verify_costs.json").write_text(text)
    finding = doctor.caches()
    assert [problem for problem, _ in finding.problems] == [
        f"the cost cache {tmp_path / 'verify_costs.json'} cannot be read (not a JSON object of cost curves)"]


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


def test_the_first_run_shows_its_calibration_with_an_estimate_and_the_cache(parity_dir, tmp_path):
    root = parity_dir / "qwen3_tiny"
    args = ("generate", "--model", root / "target", "--draft", root / "draft", "--prompt-tokens", "1,2,3",
            "--max-tokens", 8, "--json")
    first = dspark(*args, cache=tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    assert any("timing this machine's round costs, once per model, machine and BLAS" in line and "kernel" in line
               for line in lines), first.stderr
    assert f"kept in {tmp_path / 'verify_costs.json'}" in first.stderr
    assert json.loads((tmp_path / "verify_costs.json").read_text())
    again = dspark(*args, cache=tmp_path)
    assert again.returncode == 0 and "round costs" not in again.stderr
    assert json.loads(again.stdout)["tokens"] == json.loads(first.stdout)["tokens"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_calibration_estimate_counts_what_is_left_at_the_rates_seen():
    """Kernels still to compile at the mean compile time, plus timed calls still
    to make at the mean call time."""
    out = Terminal()
    status = CalibrationStatus(kernels=3, passes=2, status=Status(out))
    status("compile", 3.0)
    status("run", 0.4)  # left: 2 compiles x 3.0 s + 5 calls x 0.4 s
    assert out.getvalue().split("\r")[-1].rstrip().endswith("compiled 1 of 3 kernels, about 8 s left")
    for _ in range(2):
        status("compile", 3.0)
        status("run", 0.4)  # all compiled; left: 3 calls x 0.4 s
    assert out.getvalue().split("\r")[-1].rstrip().endswith("timing the kernels, about 1 s left")
    status.done(Path("/cache/verify_costs.json"))
    assert "round costs timed in" in out.getvalue() and "kept in /cache/verify_costs.json" in out.getvalue()
