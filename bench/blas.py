"""The BLAS under MLX's CPU matmuls, side by side: the system's OpenBLAS,
pip's (cmeel-openblas through its patched copy, ``DSPARK_OPENBLAS=pip``) and
MLX's bundled reference BLAS (``DSPARK_NO_OPENBLAS=1``).

    python bench/blas.py            # ROUNDS=5 CALLS=10 by default

The BLAS is chosen once per process, so each is timed in processes of its
own, taking turns round after round. A process times, on the embedded
default, an fp32 ``[8, 576] @ [576, 1536]`` matmul and a target forward of
8 tokens (the size of a verify: an 8-token prefill chunk after 256 committed
positions, through the 30 target layers, the draft's context and the head),
each the fastest of several calls. The table gives the median over rounds
and the ratio to the system's OpenBLAS (or to pip's, without one).
"""

import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"system": {}, "pip": {"DSPARK_OPENBLAS": "pip"}, "bundled": {"DSPARK_NO_OPENBLAS": "1"}}
ROUNDS = int(os.environ.get("ROUNDS", 5))
CALLS = int(os.environ.get("CALLS", 10))  # timed calls of each measurement in a process; the fastest counts


def fastest_ms(run) -> float:
    import mlx.core as mx

    mx.eval(run())
    best = float("inf")
    for _ in range(CALLS):
        start = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def child() -> None:
    import dspark_fn  # before mlx: it loads the BLAS this process was started to use
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    left = mx.array(rng.standard_normal((8, 576), dtype=np.float32))
    right = mx.array(rng.standard_normal((576, 1536), dtype=np.float32))
    params, _ = dspark_fn.load_pair()
    cache, _ = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 512), list(range(1, 257)), chunk_size=256)
    block = list(range(300, 308))
    print(json.dumps({
        "blas": dspark_fn.blas.in_use().label,
        "matmul": fastest_ms(lambda: left @ right),
        "forward": fastest_ms(lambda: dspark_fn.prefill(params, cache, block, chunk_size=8)),
    }))


def main() -> None:
    from dspark_fn import blas

    settings = dict(SETTINGS) if blas.system_openblas() else {k: v for k, v in SETTINGS.items() if k != "system"}
    inherited = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DSPARK_OPENBLAS", "DSPARK_NO_OPENBLAS")}
    results = {name: [] for name in settings}
    for _ in range(ROUNDS):
        for name, env in settings.items():
            done = subprocess.run([sys.executable, __file__, "--child"], env=inherited | env, capture_output=True,
                                  text=True, check=True)
            results[name].append(json.loads(done.stdout.splitlines()[-1]))
    reference = next(iter(settings))
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in ("matmul", "forward")}
               for name, runs in results.items()}
    print(f"| BLAS | library | [8,576]@[576,1536] ms | 8-token forward ms | forward vs {reference} |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        m = medians[name]
        print(f"| {name} | {runs[0]['blas']} | {m['matmul']:.3f} | {m['forward']:.1f} | "
              f"{m['forward'] / medians[reference]['forward']:.2f}x |")


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
