"""``generate`` against mlx-lm greedy on the held-out split, here and at an
earlier commit, the two trees' processes taking turns: has a change made
``generate`` slower on some family?

    python bench/against_commit.py 02639e2        # N=3 prompts a family, 128 tokens, REPEATS=2

Each repeat runs one process per tree (the order alternating by repeat), on
the embedded default, with this checkout's Python environment; the earlier
tree is a ``git worktree`` in a temporary folder. A process times mlx-lm and
``generate`` on the first N held-out prompts of every family, in turn
prompt by prompt, and reports tokens/s of each and whether the tokens were
mlx-lm's (greedy). A shared machine drifts by 10-20% within minutes: read
the ratios to mlx-lm measured beside each, and medians over repeats.

Environment: FAMILIES (default all five), N (default 3), TOKENS (default 128),
REPEATS (default 2), TEMPERATURE (default 0: greedy; sampled runs compare
speeds only).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = os.environ.get("FAMILIES", "gsm8k,humaneval,mbpp,math500,mt-bench").split(",")
N = int(os.environ.get("N", 3))
TOKENS = int(os.environ.get("TOKENS", 128))
REPEATS = int(os.environ.get("REPEATS", 2))
TEMPERATURE = float(os.environ.get("TEMPERATURE", 0))


def measure() -> dict:
    """In a child process: ``{family: [mlx-lm tokens/s, generate tokens/s, identical]}`` for the tree imported."""
    from dspark_fn.benchmark import baseline_tokens, dspark_tokens
    from dspark_fn.catalog import load_named
    from dspark_fn.chat import chat_tokens, stop_tokens
    from dspark_fn.checkpoints import mlx_lm_model
    from dspark_fn.sampling import Sampling
    from workloads import held_out_prompts, in_turn

    params, tokenizer, config = load_named()
    model, stop = mlx_lm_model(config, params.target), set(stop_tokens(tokenizer))
    options = {"sampling": Sampling(temperature=TEMPERATURE)} if TEMPERATURE else {}
    engines = {"mlx-lm": lambda prompt: baseline_tokens(model, prompt, TOKENS, stop, temperature=TEMPERATURE),
               "generate": lambda prompt: dspark_tokens(params, prompt, TOKENS, stop, **options)}
    warm = chat_tokens(tokenizer, "Warm up: say hello.")
    for run in engines.values():  # compile outside the timings
        run(warm)
    prompts = held_out_prompts()
    report = {}
    for family in FAMILIES:
        speeds, answers = in_turn(engines, [chat_tokens(tokenizer, text) for text in prompts[family][:N]])
        report[family] = [speeds["mlx-lm"], speeds["generate"], answers["mlx-lm"] == answers["generate"]]
    return report


def measured_in(tree: Path) -> dict:
    """``measure()`` in a process that imports ``dspark_fn`` from ``tree``."""
    done = subprocess.run([sys.executable, __file__, "--measure"], cwd=tree, capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(tree)}, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(revision: str) -> None:
    with tempfile.TemporaryDirectory(prefix="against-") as scratch:
        earlier = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(earlier), revision], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            trees = {"here": ROOT, revision: earlier}
            runs: dict = {name: [] for name in trees}
            for repeat in range(REPEATS):
                for name in (list(trees) if repeat % 2 == 0 else list(trees)[::-1]):
                    runs[name].append(measured_in(trees[name]))
                    print(f"repeat {repeat + 1}: {name} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(earlier)], cwd=ROOT, capture_output=True)
    print(f"held-out split, embedded default, {N} prompts a family, {TOKENS} new tokens, "
          f"{'greedy' if not TEMPERATURE else f'temperature {TEMPERATURE}'}, medians of {REPEATS}\n")
    print(f"| family | {revision}: generate vs mlx-lm (each repeat) | here: generate vs mlx-lm (each repeat) | "
          f"here / {revision} | identical to mlx-lm |\n|---|---|---|---|---|")
    for family in FAMILIES:
        ratios = {name: [run[family][1] / run[family][0] for run in runs[name]] for name in trees}
        same = all(run[family][2] for name in trees for run in runs[name])
        cells = {name: f"{statistics.median(r):.2f}x ({', '.join(f'{x:.2f}' for x in r)})"
                 for name, r in ratios.items()}
        change = statistics.median(ratios["here"]) / statistics.median(ratios[revision])
        print(f"| {family} | {cells[revision]} | {cells['here']} | {change:.2f} | "
              f"{'n/a (sampled)' if TEMPERATURE else ('yes' if same else 'NO')} |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        sys.exit("usage: python bench/against_commit.py REVISION")
