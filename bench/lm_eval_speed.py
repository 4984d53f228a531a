"""lm-eval's log-likelihood tasks timed through ``dspark serve`` beside ``mlx_lm.evaluate``, results compared.

The embedded SmolLM2-135M-Instruct is exported once to an mlx-lm directory
(``serve_bench.export_target``) and two local tasks are written (the hub is
never asked):

- ``dspark_arithmetic``: ITEMS multiple-choice questions ("What is 17 plus
  25?", four numeric choices), each after the same three solved ones
  (3-shot): the four requests of a question share a long context, which
  mlx-lm prefills once and scores each choice from (a copy of its cache),
  and the server scores once and reuses with its scores (README, "Prompt
  scoring");
- ``dspark_continue``: lm_eval_check's continuations (``write_tasks``).

Each task is run, one process per run, by

- ``mlx_lm.evaluate``: its ``MLXLM`` model under lm-eval's
  ``simple_evaluate``, as its ``main`` runs it, plus what its command lacks
  (a directory of local tasks, logged samples). The clock covers the whole
  process; "without model load" takes the load of the model away. The mlx
  wheel for Linux brings the reference BLAS, under which its forwards run
  about ten times slower than under OpenBLAS, so by default the run puts
  OpenBLAS under MLX first, as ``import dspark_fn`` does for dspark
  (``dspark_fn/blas.py``): the engines are compared, not their BLAS.
  MLX_LM_BLAS=openblas,bundled adds a run as the wheel ships (minutes);
- the ``lm_eval`` command with ``local-completions`` against ``dspark serve``
  (float32, the embedded draft, ``--max-batch`` MAX_BATCH), CONCURRENT
  requests of BATCH prompts each in flight, so that the server's scoring
  prefills take several prompts at once. The server is started and warmed
  (both tasks on a few items, untimed, which also leaves the tasks' data in
  the datasets cache for every engine) before any clock starts.

The engines take turns, in reversed order every other of REPEATS rounds;
the table gives medians. Every log-likelihood logged (matched by document
and request) is compared with the first mlx-lm engine's of the same round
within the fp32 bound of lm_eval_check (``tests/numerics.py``), and so is
every greediness and every request. Exits 1 on any difference.

    pip install 'lm-eval[api]' tenacity transformers    # no torch needed; lm_eval on the PATH
    python bench/lm_eval_speed.py      # ITEMS=40 REPEATS=2 CONCURRENT=8 BATCH=4 MAX_BATCH=8 MLX_LM_BLAS=openblas

CONCURRENT * BATCH prompts may wait at once: keep it within the server's
``--max-queue`` (64), past which it turns requests away. A first
``dspark serve`` on a machine times its round costs once per batch size
(minutes, before the clocks, kept for later starts).
"""

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ITEMS = int(os.environ.get("ITEMS", 40))
REPEATS = int(os.environ.get("REPEATS", 2))
CONCURRENT = int(os.environ.get("CONCURRENT", 8))
BATCH = int(os.environ.get("BATCH", 4))
MAX_BATCH = int(os.environ.get("MAX_BATCH", 8))
MLX_LM_BLAS = os.environ.get("MLX_LM_BLAS", "openblas").split(",")

ARITHMETIC = "dspark_arithmetic"
TASKS = (ARITHMETIC, "dspark_continue")
SHOTS = 3
WARM_UP_ITEMS = 8

BLAS_NAMES = {"openblas": "OpenBLAS", "bundled": "bundled BLAS"}
DSPARK = "dspark serve"

# The argument that makes this script one mlx_lm.evaluate run. Such a run must not import dspark_fn
# (nor lm_eval_check and serve_bench, which do) unless asked for OpenBLAS, as that import puts
# OpenBLAS under MLX: the benchmark's own imports of them stay inside the functions that use them.
MLX_LM_RUN = "--mlx-lm-run"
LOAD_SECONDS = "model_load_seconds"  # the file in which that run leaves its model load's duration


def evaluate_with_mlx_lm(target: str, tasks_dir: str, task: str, out: str, blas: str) -> None:
    """One ``mlx_lm.evaluate`` run: its ``main`` (``MLXLM`` under ``simple_evaluate``) plus the local tasks'
    directory and the logged samples, written where and as the ``lm_eval`` command writes them."""
    if blas == "openblas":
        import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from mlx_lm.evaluate import MLXLM

    started = time.perf_counter()
    # no chat template: local-completions sends the server the bare prompts (mlx-lm would apply the
    # tokenizer's template, as this one has one)
    model = MLXLM(target, use_chat_template=False)
    load_seconds = time.perf_counter() - started
    tracker = EvaluationTracker(output_path=out)
    results = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=TaskManager(include_path=tasks_dir),
                                      evaluation_tracker=tracker, log_samples=True)
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    tracker.save_results_samples(task_name=task, samples=samples[task])
    (Path(out) / LOAD_SECONDS).write_text(str(load_seconds))


def arithmetic_items(count: int, seed: int) -> list:
    """``count`` questions of two-digit sums and differences, each with the answer and three near misses."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        operation = rng.choice(("plus", "minus"))
        answer = a + b if operation == "plus" else a - b
        choices = [answer] + [answer + offset for offset in rng.sample((-10, -2, -1, 1, 2, 10), 3)]
        rng.shuffle(choices)
        items.append({"question": f"What is {a} {operation} {b}?", "choices": [str(c) for c in choices],
                      "answer": choices.index(answer)})
    return items


def write_arithmetic_task(directory: Path, items: int) -> None:
    """The ``dspark_arithmetic`` task in ``directory``: ``items`` questions, each after the same solved ones."""
    splits = {"train": arithmetic_items(SHOTS, seed=1), "test": arithmetic_items(items, seed=0)}
    for split, rows in splits.items():
        (directory / f"arithmetic_{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{ARITHMETIC}.yaml").write_text(
        f"task: {ARITHMETIC}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    train: {directory / 'arithmetic_train.jsonl'}\n    test: {directory / 'arithmetic_test.jsonl'}\n"
        f"test_split: test\nfewshot_split: train\nnum_fewshot: {SHOTS}\nfewshot_config:\n  sampler: first_n\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")


def mlx_lm_engine(blas: str) -> str:
    return f"mlx_lm.evaluate, {BLAS_NAMES[blas]}"


def timed_mlx_lm(target: Path, tasks_dir: Path, task: str, out: Path, blas: str) -> tuple[float, float]:
    """``(seconds, seconds of its model load)`` of one ``mlx_lm.evaluate`` run in a fresh process."""
    from lm_eval_check import offline_environment

    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, MLX_LM_RUN, str(target), str(tasks_dir), task, str(out), blas],
                   check=True, env=offline_environment())
    return time.perf_counter() - started, float((out / LOAD_SECONDS).read_text())


def lm_eval_against(base_url: str, target: Path, tasks: str, tasks_dir: Path, out: Path, *extra: str) -> None:
    """The ``lm_eval`` command with ``local-completions`` against the server at ``base_url``."""
    from lm_eval_check import lm_eval

    lm_eval("local-completions", f"base_url={base_url}/completions,model={target},tokenizer={target},"
            f"tokenizer_backend=huggingface,num_concurrent={CONCURRENT}", tasks, tasks_dir, out,
            "--batch_size", str(BATCH), *extra)


def timed_dspark(base_url: str, target: Path, tasks_dir: Path, task: str, out: Path) -> tuple[float, float]:
    """``(seconds, 0)`` of one ``lm_eval`` run against the server, whose model is loaded already."""
    started = time.perf_counter()
    lm_eval_against(base_url, target, task, tasks_dir, out)
    return time.perf_counter() - started, 0.0


class Run(NamedTuple):
    engine: str
    task: str
    repeat: int
    seconds: float
    load_seconds: float
    out: Path


def timed_runs(engines: dict, root: Path) -> list:
    """Every engine on every task, REPEATS times, the engines' order reversed every other round."""
    runs = []
    for repeat in range(REPEATS):
        order = list(engines) if repeat % 2 == 0 else list(engines)[::-1]
        for task in TASKS:
            for engine in order:
                out = root / "runs" / f"{engine.replace(' ', '_').replace(',', '')}-{task}-{repeat}"
                seconds, load_seconds = engines[engine](task, out)
                runs.append(Run(engine, task, repeat, seconds, load_seconds, out))
    return runs


class Score(NamedTuple):
    context: str
    continuation: str
    log_likelihood: float
    greedy: bool


def logged(out: Path, task: str) -> dict:
    """``{(doc id, request): Score}`` of a run's logged samples."""
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    scores = {}
    for sample in map(json.loads, path.read_text().splitlines()):
        for request, (arguments, (response,)) in enumerate(zip(sample["arguments"].values(), sample["resps"])):
            log_likelihood, greedy = response
            scores[sample["doc_id"], request] = Score(*arguments.values(), float(log_likelihood), greedy == "True")
    return scores


def accuracy(out: Path, task: str) -> float:
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())["results"][task]["acc,none"]


def fp32_bounds(target: Path, expected: list) -> dict:
    """``{(context, continuation): bound}`` for the expected scores: lm_eval_check's fp32 bound (one
    token's at the scale of the tokens' log-probabilities, once per token summed) at the scale of the
    sum instead, which no token's log-probability exceeds (all are <= 0): never below lm_eval_check's
    bound, and needing no third run of the model for its tokens' own log-probabilities."""
    from lm_eval_check import pair_encoder
    from numerics import fp32_bound  # on the path lm_eval_check puts tests/ on

    config = json.loads((target / "config.json").read_text())
    encoder = pair_encoder(target)
    bounds = {}
    for score in expected:
        tokens = len(encoder._encode_pair(score.context, score.continuation)[1])
        bounds[score.context, score.continuation] = tokens * fp32_bound(
            score.log_likelihood, layers=config["num_hidden_layers"], reduction=config["vocab_size"])
    return bounds


def differences(expected: dict, actual: dict, bounds: dict, what: str) -> tuple[float, int]:
    """``(largest |Δ log-likelihood|, items that differ)`` of ``actual`` against ``expected``; prints each."""
    largest, wrong = 0.0, 0
    for key in sorted(expected.keys() | actual.keys()):
        want, got = expected.get(key), actual.get(key)
        if want is None or got is None or got[:2] != want[:2]:
            wrong += 1
            print(f"{what}: doc {key[0]} request {key[1]}: the engines scored different requests ({want}, {got})")
            continue
        delta, bound = abs(got.log_likelihood - want.log_likelihood), bounds[want.context, want.continuation]
        largest = max(largest, delta)
        if delta > bound or got.greedy != want.greedy:
            wrong += 1
            print(f"{what}: doc {key[0]} request {key[1]}: {got.log_likelihood:.6f} ({got.greedy}) against "
                  f"{want.log_likelihood:.6f} ({want.greedy}), bound {bound:.2e}")
    return largest, wrong


def compare(runs: list, target: Path, reference: str) -> tuple[dict, int]:
    """``({(engine, task): largest |Δ log-likelihood|}, items that differ)``: each run against the
    ``reference`` engine's run of its task and round."""
    scores = {run: logged(run.out, run.task) for run in runs}
    expected = {(run.task, run.repeat): scores[run] for run in runs if run.engine == reference}
    bounds = fp32_bounds(target, [score for logged_run in expected.values() for score in logged_run.values()])
    largest, wrong = {}, 0
    for run in runs:
        if run.engine != reference:
            delta, differing = differences(expected[run.task, run.repeat], scores[run], bounds,
                                           f"{run.engine}, {run.task}, round {run.repeat}")
            largest[run.engine, run.task] = max(largest.get((run.engine, run.task), 0.0), delta)
            wrong += differing
    return largest, wrong


def table(runs: list, largest: dict, reference: str) -> str:
    lines = ["| task | engine | seconds | seconds without model load | requests | accuracy | mean log-likelihood "
             f"| max \\|Δ log-likelihood\\| against {reference} |", "|---|---|---|---|---|---|---|---|"]
    for task in TASKS:
        for engine in dict.fromkeys(run.engine for run in runs):
            mine = [run for run in runs if (run.engine, run.task) == (engine, task)]
            scores = [score.log_likelihood for score in logged(mine[0].out, task).values()]
            delta = f"{largest[engine, task]:.1e}" if (engine, task) in largest else "-"
            lines.append(f"| {task} | {engine} | {statistics.median(r.seconds for r in mine):.1f} "
                         f"| {statistics.median(r.seconds - r.load_seconds for r in mine):.1f} | {len(scores)} "
                         f"| {accuracy(mine[0].out, task):.3f} | {statistics.fmean(scores):.4f} | {delta} |")
    return "\n".join(lines)


def benchmark(root: Path) -> int:
    from lm_eval_check import start_server, write_tasks
    from serve_bench import export_target, free_port

    target = export_target(root / "target")
    write_tasks(root)
    write_arithmetic_task(root, ITEMS)
    port = free_port()
    server = start_server(target, port, root / "server.log", max_batch=MAX_BATCH)
    base_url = f"http://127.0.0.1:{port}/v1"
    engines = {mlx_lm_engine(blas): lambda task, out, blas=blas: timed_mlx_lm(target, root, task, out, blas)
               for blas in MLX_LM_BLAS}
    engines[DSPARK] = lambda task, out: timed_dspark(base_url, target, root, task, out)
    try:
        lm_eval_against(base_url, target, ",".join(TASKS), root, root / "warm-up", "--limit", str(WARM_UP_ITEMS))
        runs = timed_runs(engines, root)
    finally:
        server.terminate()
        server.wait(60)
    reference = mlx_lm_engine(MLX_LM_BLAS[0])
    largest, wrong = compare(runs, target, reference)
    print(f"\n{ITEMS} arithmetic questions ({SHOTS}-shot, four choices each) and lm_eval_check's continuations; "
          f"medians of {REPEATS} runs; local-completions with num_concurrent={CONCURRENT} and batch_size={BATCH}; "
          f"dspark serve --dtype float32 --max-batch {MAX_BATCH}\n")
    print(table(runs, largest, reference))
    print(f"\nthe same results as {reference}" if not wrong else f"\n{wrong} items differ from {reference}",
          f"(files in {root})")
    return 1 if wrong else 0


def main() -> int:
    if sys.argv[1:2] == [MLX_LM_RUN]:
        evaluate_with_mlx_lm(*sys.argv[2:])
        return 0
    return benchmark(Path(tempfile.mkdtemp(prefix="lm_eval_speed_")))


if __name__ == "__main__":
    sys.exit(main())
