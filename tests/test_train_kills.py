"""``dspark train`` killed with SIGKILL at random writes of every stage
(an answer being appended, a feature shard or the index, the exported
draft, a checkpoint folder being filled) and started again until it
finishes: its answers and final weights equal those of a run never killed.

Breaks tried, and what caught them:
- a checkpoint storing the weights in the export's float16 (as before):
  the final weights differ;
- the shard of a group of steps drawn from one random stream across the
  run (as before) instead of from (seed, group): a resumed run reads other
  shards and ends elsewhere (answering until the file, not the prompts'
  prefix, holds the token target is caught by test_train's prefix test);
- ``atomic.write_with`` writing in place instead of beside: a torn file
  under its final name after a kill;
- the trainer checkpointing before it exports the draft: a kill at the last
  export resumes at the last step, trains nothing and leaves the previous
  export (only the test that kills at that write catches it: random kills
  almost never draw it).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from dspark_fn import atomic
from dspark_fn.distill import answers as answering
from dspark_fn.distill import trainer

HERE = Path(__file__).parent
ARGUMENTS = ["--tokens", "400", "--max-tokens", "40", "--sources", "bundled", "--answer-batch", "4", "--shard-rows", "3",
             "--layers", "1", "--taps", "1", "3", "--block-size", "4", "--markov-rank", "8", "--draft-vocab", "64",
             "--steps", "6", "--steps-per-shard", "2", "--checkpoint-every", "1", "--batch", "2", "--held-out", "1"]


def write_target(directory: Path) -> None:
    from published import qwen3_pair

    qwen3_pair(tied=True, taps=[1, 2, 3])(directory, directory.parent / "unused")


def train(target: Path, out: Path, log: Path, kill_at: int = 0, mode: str = "torn", extra: tuple = ()) -> int:
    command = [sys.executable, str(HERE / "kill_points.py"), str(log), str(kill_at), mode, "--", "train",
               "--model", str(target), "--out", str(out), *ARGUMENTS, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode not in (0, -9):
        raise AssertionError(f"dspark train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.returncode


def final_state(out: Path) -> tuple:
    answers = {tuple(a.prompt): a.answer for a in answering.read_answers(out / "answers.jsonl")}
    latest = trainer.latest_checkpoint(out / "draft")
    weights = mx.load(str(latest / trainer.WEIGHTS_FILE))
    exported = mx.load(str(out / "draft" / "model.safetensors"))
    return answers, json.loads((latest / trainer.STATE_FILE).read_text())["step"], weights, exported


def assert_files_whole(out: Path) -> None:
    """What a kill leaves: every file under its final name is complete (an
    answers file may end in a torn line, which readers drop)."""
    for file in out.rglob("*"):
        if atomic.TEMPORARY in str(file.relative_to(out)) or file.is_dir() or file.name == "answers.jsonl":
            continue
        if file.suffix == ".json":
            json.loads(file.read_text())
        elif file.suffix == ".npz":
            dict(np.load(file))
        else:
            mx.load(str(file), format=file.suffix.lstrip("."))


def test_a_run_killed_at_random_writes_ends_as_one_never_killed(tmp_path):
    write_target(tmp_path / "target")
    assert train(tmp_path / "target", tmp_path / "straight", tmp_path / "straight.log") == 0
    answers, step, weights, exported = final_state(tmp_path / "straight")
    assert step == 6
    rng = np.random.default_rng(0)
    log = tmp_path / "killed.log"
    for attempt in range(60):
        kill_at = int(rng.integers(1, 12))
        if train(tmp_path / "target", tmp_path / "killed", log, kill_at, ("torn", "unrenamed")[attempt % 2]) == 0:
            break
        assert_files_whole(tmp_path / "killed")
    else:
        raise AssertionError("the killed run never finished")
    killed_stages = {line.split()[0] for line in log.read_text().splitlines() if line.endswith("kill")}
    assert {"answers", "features", "draft", "checkpoints"} <= killed_stages, killed_stages
    resumed_answers, resumed_step, resumed_weights, resumed_export = final_state(tmp_path / "killed")
    assert resumed_answers == answers and resumed_step == step
    for name, value in weights.items():
        assert mx.array_equal(resumed_weights[name], value), name
    for name, value in exported.items():
        assert mx.array_equal(resumed_export[name], value), name


def test_a_run_with_feature_workers_ends_as_one_without(tmp_path):
    """``--feature-workers 3``: the features pass in three processes (the
    others loading the target by its path) changes nothing downstream."""
    write_target(tmp_path / "target")
    runs = {}
    for workers in (1, 3):
        out = tmp_path / f"workers-{workers}"
        assert train(tmp_path / "target", out, tmp_path / "log", extra=("--feature-workers", str(workers))) == 0
        runs[workers] = final_state(out)
    assert len(list((tmp_path / "workers-3" / "features").glob("shard-*.npz"))) >= 3
    (answers, step, weights, exported), (answers_3, step_3, weights_3, exported_3) = runs[1], runs[3]
    assert answers_3 == answers and step_3 == step
    for name, value in weights.items():
        assert mx.array_equal(weights_3[name], value), name
    for name, value in exported.items():
        assert mx.array_equal(exported_3[name], value), name


def test_a_kill_at_the_last_export_resumes_to_the_same_export(tmp_path):
    """The draft is exported before its checkpoint is written: a kill at the
    straight run's last export resumes from the step before and exports the
    same draft, never leaving the previous one."""
    write_target(tmp_path / "target")
    straight_log = tmp_path / "straight.log"
    assert train(tmp_path / "target", tmp_path / "straight", straight_log) == 0
    writes = straight_log.read_text().splitlines()
    last_export = max(number for number, line in enumerate(writes, start=1)
                      if line.split()[:2] == ["draft", "model.safetensors"])
    killed_log = tmp_path / "killed.log"
    assert train(tmp_path / "target", tmp_path / "killed", killed_log, last_export, "unrenamed") == -9
    assert killed_log.read_text().splitlines()[-1] == "draft model.safetensors kill"
    assert train(tmp_path / "target", tmp_path / "killed", killed_log) == 0
    _, step, weights, exported = final_state(tmp_path / "straight")
    _, resumed_step, resumed_weights, resumed_export = final_state(tmp_path / "killed")
    assert resumed_step == step
    for name, value in weights.items():
        assert mx.array_equal(resumed_weights[name], value), name
    assert exported.keys() == resumed_export.keys()
    for name, value in exported.items():
        assert mx.array_equal(resumed_export[name], value), name
