"""The features pass over several processes: worker k of n builds the
windows k, k+n, ... that are not yet on disk, each loading the target
itself, and the index adopts the shards as they continue it.

MLX leaves part of a core idle in a small model's forward (its non-matrix
operations run on one thread), so two processes on two cores build about
1.5x the shards of one. Each shard is written whole by whichever process
built it and checked against its window before it joins the index, so a
worker that dies or is killed costs only its unfinished windows: the main
process builds what is missing after the workers stop.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from .. import atomic
from .answers import Answer
from .corpus import SHARD_ROWS, build_shards, build_window, read_index, shard_path, window_answers


WORKER = "import sys; from dspark_fn.distill.workers import run_job; run_job(sys.argv[1])"


def write_job(directory, worker: int, workers: int, target: str, dtype: str | None, taps: Sequence[int],
              answers: Sequence, max_length: int, rows: int) -> Path:
    """What worker ``worker`` of ``workers`` needs: the target to load and the answers of the windows it builds."""
    first = read_index(directory)["answers"] // rows
    mine = [w for w in range(first, len(answers) // rows) if w % workers == worker]
    windows = {w: [[list(a.prompt), list(a.answer)] for a in answers[w * rows : (w + 1) * rows]] for w in mine}
    job = {"target": target, "dtype": dtype, "taps": list(taps), "max_length": max_length, "windows": windows,
           "parent": os.getpid()}
    return atomic.write_text(Path(directory) / f"worker-{worker}.json", json.dumps(job))


def _exit_with(parent: int) -> None:
    """A worker outlives no parent: a killed run restarted must not race its old workers."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def run_job(path) -> None:
    """Build the windows of one job file (in a worker process)."""
    import mlx.core as mx

    from ..catalog import load_target_named
    from ..targets import resolve_target

    job = json.loads(Path(path).read_text())
    threading.Thread(target=_exit_with, args=(job["parent"],), daemon=True).start()
    config, params, _ = load_target_named(job["target"], dtype=getattr(mx, job["dtype"]) if job["dtype"] else None)
    adapter = resolve_target(config)
    spec = adapter.spec_from_config(config)
    for window, pairs in job["windows"].items():
        members = [Answer("job", prompt, answer) for prompt, answer in pairs]
        build_window(adapter, spec, params, job["taps"], window_answers(members, 0, len(members)),
                     shard_path(Path(path).parent, int(window)), job["max_length"])


def build_shards_parallel(workers: int, target: str, dtype: str | None, adapter, spec, params, taps: Sequence[int],
                          answers: Sequence, directory, max_length: int,
                          on_shard: Callable[[int, int], None] = lambda done, total: None,
                          rows: int = SHARD_ROWS, log: Callable[[str], None] = print) -> dict:
    """``build_shards`` with ``workers - 1`` more processes beside this one
    (``target``/``dtype``: how they load the target this process holds); a
    worker that fails is logged and its windows built here."""
    jobs = [write_job(directory, worker, workers, target, dtype, taps, answers, max_length, rows)
            for worker in range(1, workers)]
    helpers = [subprocess.Popen([sys.executable, "-c", WORKER, str(job)]) for job in jobs]
    try:
        build_shards(adapter, spec, params, taps, answers, directory, max_length, on_shard, rows,
                     builds=lambda window: window % workers == 0)
        for worker, helper in enumerate(helpers, start=1):
            if helper.wait() != 0:
                log(f"features worker {worker} exited with code {helper.returncode}: its windows are built here")
    finally:
        for helper in helpers:
            helper.kill()
        for job in jobs:
            job.unlink(missing_ok=True)
    # what a failed worker left unbuilt, this process builds
    return build_shards(adapter, spec, params, taps, answers, directory, max_length, on_shard, rows)
