"""A newcomer's first minutes: the first answer and the first server, on
empty caches (a fresh ``DSPARK_FN_CACHE`` and ``TMPDIR``, so MLX compiles
every kernel it meets, and nothing dspark_fn ever kept is there).

- ``dspark generate`` of a short question on the embedded default: seconds
  from the command's start to its exit (the answer printed), and whether
  any line on stderr speaks of timing round costs; by default (MLX builds
  its CPU kernels) and with ``DSPARK_CPU_JIT=0`` (it builds none);
- ``dspark serve`` on the embedded default: seconds from the command's
  start to the first ``/health`` that answers 200, and to its "ready" line.

    python bench/first_answer.py            # REPEATS=2

Each repeat makes new empty caches.
"""

import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from serve_bench import free_port

REPEATS = int(os.environ.get("REPEATS", 2))
QUESTION = "What is the capital of France?"


def fresh_environment(**extra) -> dict:
    scratch = tempfile.mkdtemp(prefix="first-")
    os.makedirs(os.path.join(scratch, "tmp"))
    return os.environ | {"DSPARK_FN_CACHE": os.path.join(scratch, "cache"), "TMPDIR": os.path.join(scratch, "tmp")} | extra


def first_answer(**extra) -> tuple[float, str, str]:
    """``(seconds, answer, stderr)`` of the first ``dspark generate`` on empty caches."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dspark_fn.cli", "generate", "--max-tokens", "32", QUESTION],
                          capture_output=True, text=True, env=fresh_environment(**extra), timeout=600)
    assert done.returncode == 0, done.stderr
    return time.monotonic() - start, done.stdout.strip(), done.stderr


def first_server() -> tuple[float, float]:
    """``(seconds to /health 200, seconds to the ready line)`` of the first ``dspark serve`` on empty caches."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "dspark_fn.cli", "serve", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=fresh_environment())
    healthy = ready = None
    try:
        while time.monotonic() - start < 600 and (healthy is None or ready is None):
            if healthy is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                        if response.status == 200:
                            healthy = time.monotonic() - start
                except OSError:
                    pass
            if ready is None and "ready on" in open(log.name).read():
                ready = time.monotonic() - start
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return healthy, ready


def main() -> None:
    print("| repeat | first answer, s | with DSPARK_CPU_JIT=0, s | stderr speaks of timing costs | /health 200, s | "
          "ready line, s |")
    print("|---|---|---|---|---|---|")
    for repeat in range(REPEATS):
        seconds, answer, stderr = first_answer()
        without_jit, _, _ = first_answer(DSPARK_CPU_JIT="0")
        healthy, ready = first_server()
        print(f"| {repeat + 1} | {seconds:.1f} | {without_jit:.1f} | {'yes' if 'round costs' in stderr else 'no'} | "
              f"{healthy:.1f} | {ready:.1f} |", flush=True)
    print(f"\nthe answer: {answer!r}")


if __name__ == "__main__":
    main()
