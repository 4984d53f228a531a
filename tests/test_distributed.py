"""Targets split over 2 and 3 local processes (``mlx.launch``, ring backend on
127.0.0.1), tensor parallel (llama family, gemma4) and pipeline (the llama family
with heads that do not divide, gemma4, deepseek_v4 and the hybrids
lfm2, qwen3_5, nemotron_h): logits and taps within the fp32 bound of the whole
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
  ranks choose different widths and the run hangs until its timeout;
- a pipeline rank's taps taken from its own stream instead of their owner's
  (``from_owner`` skipped for taps): the draft's proposals, and the taps
  checked, differ;
- a prefill's chunks left lazy together on pipeline ranks
  (``prefilling.split_chunks`` false): the rounds driven from a three-row
  prefill in chunks of 16 keep the wrong counts (the ranks paired one
  chunk's collectives with another's).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fn.distributed import check_split
from helpers import PARITY, build_draft, build_target, draft_config, ring_launcher, target_config
from hybrids import HYBRID_SHAPES, hybrid_draft_config

HERE = Path(__file__).parent
# heads, key/value heads, MLP columns and vocabulary all divide by 2 and 3
TARGETS = {
    "qwen3": target_config("qwen3", vocab=264, hidden=96, layers=4, heads=6, kv_heads=6, head_dim=16),
    "llama-untied": target_config("llama", vocab=264, hidden=96, layers=4, heads=12, kv_heads=6, head_dim=8,
                                  tied=False),
    "qwen3-4-heads": target_config("qwen3", vocab=264, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16),
}


def launch(ranks: int, script: Path, *arguments, timeout: int = 600) -> subprocess.CompletedProcess:
    """``script`` on ``ranks`` local processes over the ring backend. The
    timeout only ends a hang: the six pipeline families take about 3 minutes
    on 2 idle cores, and ranks that wait on each other stretch with any load."""
    command = [*ring_launcher(ranks), sys.executable, str(script), *map(str, arguments)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def llama_family(name: str):
    def write(root: Path) -> None:
        config = TARGETS[name]
        build_target(root / "target", config, seed=1)
        build_draft(root / "draft", draft_config(config, layers=1, taps=(1, 2), block_size=4), seed=2)

    return write


def hybrid(name: str):
    def write(root: Path) -> None:
        config = HYBRID_SHAPES[name]
        build_target(root / "target", config, seed=3, vector_spread=0.4)
        last = config["num_hidden_layers"] - 1
        build_draft(root / "draft", hybrid_draft_config(config, taps=(0, last - 1), block_size=4), seed=1)

    return write


def gemma4(root: Path) -> None:
    shutil.copytree(PARITY / "gemma4_tiny" / "target", root / "target")
    shutil.copytree(PARITY / "gemma4_tiny" / "draft", root / "draft")


def gemma4_dividing(root: Path) -> None:
    """A Gemma 4 text target whose heads of both layer types divide by 2 (the published tiny one has one global key/value head)."""
    from published import gemma4_text_config

    config = dict(gemma4_text_config(), model_type="gemma4_text", num_global_key_value_heads=2, num_key_value_heads=2)
    build_target(root / "target", config, seed=1)
    draft = draft_config(target_config(vocab=config["vocab_size"], hidden=config["hidden_size"],
                                       layers=config["num_hidden_layers"]), layers=1, taps=(1, 3), block_size=4)
    build_draft(root / "draft", draft, seed=2)


def deepseek_v4(root: Path) -> None:
    from test_deepseek_v4 import TEXT, write_pair

    write_pair(root, TEXT, seed=1)


CASES = {  # name -> (writer, whether mlx-lm reads the target)
    "qwen3": (llama_family("qwen3"), True), "llama-untied": (llama_family("llama-untied"), True),
    "qwen3-4-heads": (llama_family("qwen3-4-heads"), True), "gemma4": (gemma4, True),
    "gemma4-dividing": (gemma4_dividing, True),
    "deepseek_v4": (deepseek_v4, False), "lfm2": (hybrid("lfm2"), True), "qwen3_5": (hybrid("qwen3_5"), True),
    "nemotron_h": (hybrid("nemotron_h"), True),
}


def write_case(root: Path, name: str) -> Path:
    writer, drive = CASES[name]
    root.mkdir(parents=True)
    writer(root)
    (root / "case.json").write_text(json.dumps({"name": name, "drive": drive}))
    return root


def check_reports(out: Path, names: list, ranks: int, done) -> None:
    for name in names:
        reports = [json.loads((out / f"{name}-rank-{r}.json").read_text()) for r in range(ranks)]
        errors = [r["error"] for r in reports if "error" in r]
        assert not errors, f"{name}: {errors[0]}" + done.stderr[-2000:]
        first = reports[0]
        for report in reports:
            forward = report["forward"]
            assert forward["logits"] <= forward["logits_bound"], (name, forward)
            assert forward["taps"] <= forward["taps_bound"], (name, forward)
            for kind in ("greedy", "greedy_width_3", "sampled_width_3", "batched"):
                assert report[kind] == report[f"{kind}_whole"], f"{name}, rank {report['rank']}: {kind}"
            for kind in ("greedy", "greedy_width_3", "sampled_width_3", "sampled", "batched"):
                assert report[kind] == first[kind], f"{name}, rank {report['rank']}: {kind}"  # the same on every rank
        whole = sum(r["target_bytes"] for r in first["ranks"])
        shares = [r["target_bytes"] / whole for r in first["ranks"]]
        assert max(shares) < 1.35 / ranks, (name, shares)  # each rank holds about 1/N of the target


@pytest.mark.parametrize("mode, ranks, names", [
    ("tensor", 2, ["qwen3", "llama-untied", "gemma4-dividing"]),
    ("tensor", 3, ["qwen3"]),
    ("pipeline", 2, ["qwen3-4-heads", "gemma4", "deepseek_v4", "lfm2", "qwen3_5", "nemotron_h"]),
    ("pipeline", 3, ["qwen3-4-heads"]),
])
def test_a_split_target_decodes_as_one_process(mode, ranks, names, tmp_path):
    cases = [write_case(tmp_path / name, name) for name in names]
    done = launch(ranks, HERE / "distributed_worker.py", tmp_path, mode, *cases)
    check_reports(tmp_path, names, ranks, done)


@pytest.mark.parametrize("heads, ranks", [(6, 4), (9, 2)])
def test_splits_that_cannot_work_are_refused_from_the_config(heads, ranks):
    config = target_config("qwen3", vocab=264, hidden=144, heads=heads, kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=f"do not split over {ranks} ranks: use --pipeline"):
        check_split(config, ranks)


def test_a_pipeline_needs_a_layer_a_rank():
    config = target_config("qwen3", vocab=264, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16)
    check_split(config, 4, pipeline=True)
    with pytest.raises(ValueError, match="5 ranks for 4 layers: a pipeline needs at least one layer a rank"):
        check_split(config, 5, pipeline=True)


def test_a_pipeline_keeps_layers_that_share_keys_together():
    """Gemma 4 layers that read an earlier layer's keys must run on its rank:
    a split between them is refused by name, one that keeps them is not."""
    from dataclasses import replace

    import dspark_fn
    from dspark_fn.distributed import pipeline_share
    from dspark_fn.sharding import Ranks

    params = dspark_fn.load(PARITY / "gemma4_tiny" / "target", PARITY / "gemma4_tiny" / "draft")
    sharing = replace(params.spec.target, kv_source=(0, 1, 2, 3, 4, 4))  # layer 5 reads layer 4's keys
    adapter = params.spec.target_adapter
    for ranks in (2, 3):  # stages ending 3/6 and 2/4/6 keep layers 4 and 5 together
        assert all(pipeline_share(adapter, sharing, params.target, Ranks(rank, ranks)) for rank in range(ranks))
    with pytest.raises(ValueError, match="layer 5 reads the cache of layer 4, which another rank runs"):
        pipeline_share(adapter, sharing, params.target, Ranks(3, 5))  # stages 0, 1, 2-3, 4, 5
