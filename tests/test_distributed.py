"""Tensor-parallel targets over 2 and 3 local processes (``mlx.launch``, ring
backend on 127.0.0.1): logits and taps within the fp32 bound of the whole
target, greedy (fixed and auto width), seeded sampling (fixed width) and
batched output identical to one process and across the ranks, seeded
sampling with the draft gate identical across the ranks (the gate times a
sharded target apart from a whole one, so its rounds, and the draws they
make, may differ from one process), rounds that keep every count, every
rank holding about 1/N of the target, and splits that cannot work refused.

Breaks tried, and what caught them:
- ``ops.linear`` without the all_sum of a row-parallel share: every check;
- the vocabulary head's shards gathered in reverse rank order: greedy,
  sampled and batched tokens differ, logits far outside the bound;
- the draft gate timing its own cost curve on each rank (no ``agree``): the
  ranks choose different widths and the run hangs until its timeout.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fn.distributed import check_split
from helpers import build_draft, build_target, draft_config, target_config

HERE = Path(__file__).parent
# heads, key/value heads, MLP columns and vocabulary all divide by 2 and 3
TARGETS = {
    "qwen3": target_config("qwen3", vocab=264, hidden=96, layers=4, heads=6, kv_heads=6, head_dim=16),
    "llama-untied": target_config("llama", vocab=264, hidden=96, layers=4, heads=12, kv_heads=6, head_dim=8,
                                  tied=False),
}


def launch(ranks: int, script: Path, *arguments, timeout: int = 300) -> subprocess.CompletedProcess:
    """``script`` on ``ranks`` local processes over the ring backend."""
    launcher = Path(sys.executable).parent / "mlx.launch"  # installed with mlx beside this interpreter
    command = [str(launcher), "-n", str(ranks), "--backend", "ring",
               "--starting-port", str(random.randint(20000, 60000)), sys.executable, str(script), *map(str, arguments)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def write_case(root: Path, name: str) -> Path:
    config = TARGETS[name]
    build_target(root / "target", config, seed=1)
    build_draft(root / "draft", draft_config(config, layers=1, taps=(1, 2), block_size=4), seed=2)
    return root


@pytest.mark.parametrize("name, ranks", [("qwen3", 2), ("qwen3", 3), ("llama-untied", 2)])
def test_a_tensor_parallel_target_decodes_as_one_process(name, ranks, tmp_path):
    case = write_case(tmp_path / "case", name)
    done = launch(ranks, HERE / "distributed_worker.py", case, tmp_path)
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(ranks)]
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, errors[0] + done.stderr[-2000:]
    first = reports[0]
    for report in reports:
        forward = report["forward"]
        assert forward["logits"] <= forward["logits_bound"] and forward["taps"] <= forward["taps_bound"], forward
        for name in ("greedy", "greedy_width_3", "sampled_width_3", "batched"):
            assert report[name] == report[f"{name}_whole"], f"rank {report['rank']}: {name}"
        for name in ("greedy", "greedy_width_3", "sampled_width_3", "sampled", "batched"):
            assert report[name] == first[name], f"rank {report['rank']}: {name}"  # every rank emitted the same
    whole = sum(r["target_bytes"] for r in first["ranks"])
    assert all(abs(r["target_bytes"] - whole / ranks) < 0.05 * whole / ranks for r in first["ranks"])


@pytest.mark.parametrize("heads, ranks", [(6, 4), (9, 2)])
def test_splits_that_cannot_work_are_refused_from_the_config(heads, ranks):
    config = target_config("qwen3", vocab=264, hidden=144, heads=heads, kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=f"do not split over {ranks} ranks: use --pipeline"):
        check_split(config, ranks)
