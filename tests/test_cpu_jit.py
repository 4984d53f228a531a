"""``DSPARK_CPU_JIT=0`` (``dspark_fn/cpu_jit.py``): MLX compiles no kernel on
the CPU, so nothing is built in its kernel folder, a compiled function runs
as written on every call (``kernel.TRACES_KEPT`` false), and still the
README's loop gives the target's own greedy tokens and its policy learns
the round costs from every round (``kernel.compilations`` stays 0: no round
counts as one that compiled). By default the JIT builds kernels and MLX
keeps each trace.

Breaks tried: ``keep_off`` asking MLX with the PATH as it is (kernels were
built: the JIT=0 case failed), the policy timing rounds by raw trace counts
(no round was timed under JIT=0: its costs stayed empty).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PARITY

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU kernel JIT: Linux's mlx[cpu]")

LOOP = """
import json, sys
import dspark_fn
import mlx.core as mx
from mlx_lm.utils import load_model
from dspark_fn import kernel
from dspark_fn.benchmark import baseline_tokens

root = sys.argv[1]
params = dspark_fn.load(root + "/target", root + "/draft")
prompt = json.load(open(root + "/trace.json"))["prompt_ids"]
cache = dspark_fn.init_cache(params, batch_size=1, capacity=256)
cache, tokens = dspark_fn.prefill(params, cache, prompt)
out = tokens.tolist()
while len(out) < 40:
    cache, step = dspark_fn.speculate(params, cache, tokens)
    out += step.emitted[0, : step.count.item()].tolist()
    tokens = step.next_tokens
out = out[:40]
from pathlib import Path
model, _ = load_model(Path(root) / "target")
timed = sum(len(times) for times in cache.policy.costs.verifies.values())
print(json.dumps({"kept": kernel.TRACES_KEPT, "identical": out == baseline_tokens(model, prompt, 40, set()),
                  "timed": timed, "compilations": kernel.compilations()}))
"""


def loop_in_a_process(tmp_path: Path, **env) -> tuple[dict, int]:
    """The loop's report, and the kernels MLX built, in a process with a TMPDIR of its own."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    inherited = {k: v for k, v in os.environ.items() if k not in ("DSPARK_CPU_JIT", "MLX_DISABLE_COMPILE")}
    done = subprocess.run([sys.executable, "-c", LOOP, str(PARITY / "qwen3_tiny")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=inherited | {"PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)} | env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), len(list(scratch.glob("mlx/*/cpu/*.so")))


def test_without_the_jit_nothing_is_built_and_the_loop_is_the_targets(tmp_path):
    report, built = loop_in_a_process(tmp_path, DSPARK_CPU_JIT="0")
    assert built == 0 and report["kept"] is False and report["compilations"] == 0
    assert report["identical"] and report["timed"] > 0


def test_by_default_the_jit_builds_kernels_and_keeps_traces(tmp_path):
    report, built = loop_in_a_process(tmp_path)
    assert built > 0 and report["kept"] is True and report["compilations"] > 0
    assert report["identical"] and report["timed"] > 0


PREAMBLE_PROBE = """
import mlx.core as mx
from dspark_fn import cpu_jit, kernel

assert kernel.PRECOMPILING is not None and kernel.PRECOMPILING.wait() == 0
print(cpu_jit.precompiled_preamble().is_file(), cpu_jit.precompile_preamble() is None)
mx.eval(mx.compile(lambda x: mx.exp(x) * 2 + 1)(mx.zeros((4,))))
"""


def test_kernels_build_against_the_precompiled_preamble(tmp_path):
    """The precompiled preamble is built once at import, and MLX's own kernel
    builds use it (``g++ -H`` marks a precompiled header it used with "!",
    one it found unfit with "x": a flag of MLX's that ``MLX_FLAGS`` lacks)."""
    shim, log = tmp_path / "bin", tmp_path / "headers.log"
    shim.mkdir()
    (shim / "g++").write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -H 2>>{log}\n')
    (shim / "g++").chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    inherited = {k: v for k, v in os.environ.items() if k not in ("DSPARK_CPU_JIT", "MLX_DISABLE_COMPILE")}
    done = subprocess.run([sys.executable, "-c", PREAMBLE_PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=inherited | {"PYTHONPATH": str(ROOT), "TMPDIR": str(scratch),
                                           "PATH": f"{shim}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"]  # built, and not built again
    used = [line for line in log.read_text().splitlines() if line.endswith("compiled_preamble.h.gch")]
    assert used and all(line.startswith("! ") and str(scratch) in line for line in used), used


def test_nothing_is_precompiled_without_the_jit(tmp_path, monkeypatch):
    from dspark_fn import cpu_jit

    monkeypatch.setattr(cpu_jit, "kernel_folder", lambda: tmp_path)
    assert cpu_jit.precompile_preamble({"DSPARK_CPU_JIT": "0", "PATH": os.environ["PATH"]}) is None
    assert not list(tmp_path.iterdir())
