"""lm-eval itself against ``dspark serve``, as its users run it, checked item by item against mlx-lm.

The embedded SmolLM2-135M-Instruct is exported once to an mlx-lm directory
(its tokenizer is the one lm-eval reads), served with the embedded draft in
float32 on 127.0.0.1, and three small tasks over local JSON data (written
here; the hub is never asked) run through the ``lm_eval`` command:

- ``dspark_choice``: multiple choice (``local-completions``: one scored
  request per choice, ``echo`` with ``logprobs: 1`` and ``max_tokens: 1``);
- ``dspark_continue``: log-likelihoods of continuations (the same requests);
- ``dspark_answer``: greedy generation through ``local-chat-completions``
  with the chat template.

Every logged log-likelihood is compared with mlx-lm's own model over the
same token ids (lm-eval's own encoding of the pair) within the fp32 bound,
every ``is_greedy`` with mlx-lm's argmax, and every generated answer with
mlx-lm's greedy answer to the same messages (cut at the task's stop
strings). Exits 1 on any difference.

    pip install 'lm-eval[api]' tenacity transformers    # no torch needed
    python bench/lm_eval_check.py                          # about 3 minutes on 2 cores
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
import numpy as np

from dspark_fn.catalog import DEFAULT_DRAFT
from serve_bench import export_target, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from numerics import fp32_bound  # noqa: E402

CHOICES = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is closest to the sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What is 7 times 8?", ["54", "56", "64", "48"], 1),
    ("Which gas do plants take in from the air?", ["oxygen", "nitrogen", "helium", "carbon dioxide"], 3),
    ("What color is a ripe banana?", ["yellow", "blue", "purple", "black"], 0),
    ("Water freezes at how many degrees Celsius?", ["10", "100", "0", "-40"], 2),
    ("Who wrote Romeo and Juliet?", ["Charles Dickens", "William Shakespeare", "Jane Austen", "Mark Twain"], 1),
]
CONTINUATIONS = [
    ("The quick brown fox jumps over the", " lazy dog."),
    ("Once upon a time, there was a", " little girl who lived in a village."),
    ("def add(a, b):\n    return", " a + b"),
    ("The sun rises in the", " east and sets in the west."),
    ("1, 2, 3, 4,", " 5, 6, 7"),
    ("To make tea, first boil the", " water."),
]
QUESTIONS = [
    ("Name three primary colors.", "red, blue, yellow"),
    ("What is 12 plus 30? Answer with a number.", "42"),
    ("Write a short greeting.", "Hello!"),
    ("List two fruits.", "apple, banana"),
]
UNTIL = ["\n\n"]
ANSWER_TOKENS = 40


def write_tasks(directory: Path) -> None:
    """Three lm-eval tasks over JSON files in ``directory`` (``--include_path``)."""
    def lines(name: str, rows: list) -> str:
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    data = {
        "dspark_choice": lines("choice", [{"question": q, "choices": c, "answer": a} for q, c, a in CHOICES]),
        "dspark_continue": lines("continue", [{"context": c, "continuation": t} for c, t in CONTINUATIONS]),
        "dspark_answer": lines("answer", [{"question": q, "answer": a} for q, a in QUESTIONS]),
    }
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (directory / "dspark_choice.yaml").write_text(
        "task: dspark_choice\n" + common.format(data["dspark_choice"]) +
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (directory / "dspark_continue.yaml").write_text(
        "task: dspark_continue\n" + common.format(data["dspark_continue"]) +
        "output_type: loglikelihood\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{continuation}}\"\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    (directory / "dspark_answer.yaml").write_text(
        "task: dspark_answer\n" + common.format(data["dspark_answer"]) +
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {ANSWER_TOKENS}\n"
        "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def start_server(target: Path, port: int, log: Path, max_batch: int = 2) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "dspark_fn.cli", "serve", "--model", str(target), "--draft", str(DEFAULT_DRAFT),
         "--dtype", "float32", "--port", str(port), "--max-batch", str(max_batch)],
        stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return process
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start: " + log.read_text())


def offline_environment() -> dict:
    """This process's environment, with lm-eval's libraries kept off the network (local data and tokenizer)."""
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def lm_eval(model: str, model_args: str, tasks: str, tasks_dir: Path, out: Path, *extra: str) -> None:
    """The ``lm_eval`` command, as its users run it (offline: local data, a local tokenizer)."""
    env = offline_environment()
    command = ["lm_eval", "--model", model, "--model_args", model_args, "--tasks", tasks, "--include_path",
               str(tasks_dir), "--output_path", str(out), "--log_samples", *extra]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def samples(out: Path, task: str) -> list:
    """``(arguments, responses)`` per logged document: its requests' arguments and the server's answers."""
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    return [([tuple(args.values()) for args in sample["arguments"].values()], [r[0] for r in sample["resps"]])
            for sample in logged]


def log_likelihood(model, context: list, continuation: list) -> tuple[float, bool, float]:
    """mlx-lm's ``(sum of the continuation's log-probabilities, greedy, fp32 bound of the sum)``."""
    logits = model(mx.array([context + continuation]))[0, len(context) - 1 : -1].astype(mx.float32)
    scores = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    chosen = scores[np.arange(len(continuation)), continuation]
    # the bound of one log-probability at the scale of those compared, once per token summed
    bound = fp32_bound(chosen, layers=len(model.layers), reduction=scores.shape[-1]) * len(continuation)
    return float(chosen.sum()), bool((scores.argmax(-1) == np.array(continuation)).all()), bound


def check_log_likelihoods(model, encoder, out: Path) -> int:
    """Every (context, continuation) lm-eval scored: its log-likelihood and greediness against mlx-lm's."""
    wrong = 0
    for task in ("dspark_choice", "dspark_continue"):
        worst, closest = 0.0, 0.0  # the largest difference, and the largest as a share of its bound
        for arguments, responses in samples(out, task):
            for (context, continuation), (served, greedy) in zip(arguments, responses):
                served, greedy = float(served), greedy == "True"
                expected, expected_greedy, bound = log_likelihood(model, *encoder._encode_pair(context, continuation))
                worst, closest = max(worst, abs(served - expected)), max(closest, abs(served - expected) / bound)
                if abs(served - expected) > bound or greedy != expected_greedy:
                    wrong += 1
                    print(f"{task}: {context!r} + {continuation!r}: served {served:.6f} ({greedy}), mlx-lm "
                          f"{expected:.6f} ({expected_greedy}), bound {bound:.2e}")
        print(f"{task}: {len(samples(out, task))} items; largest |served - mlx-lm| {worst:.2e}, at most "
              f"{closest:.1e} of its fp32 bound")
    return wrong


def greedy_answer(model, tokenizer, messages: list) -> str:
    """mlx-lm's greedy answer (its own generation loop) to ``messages``, cut at ``UNTIL``."""
    from mlx_lm.generate import generate

    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=ANSWER_TOKENS)
    cuts = [text.index(stop) for stop in UNTIL if stop in text]
    return text[: min(cuts)] if cuts else text


def check_answers(model, tokenizer, out: Path) -> int:
    wrong = 0
    for ((context, _),), (served,) in samples(out, "dspark_answer"):
        messages = json.loads(context[0])
        expected = greedy_answer(model, tokenizer, messages)
        if served != expected:
            wrong += 1
            print(f"dspark_answer: {messages!r}: served {served!r}, mlx-lm {expected!r}")
    print(f"dspark_answer: {len(samples(out, 'dspark_answer'))} answers compared")
    return wrong


def run(root: Path) -> Path:
    """lm-eval's runs against a server of the exported target; returns the target's directory."""
    target = export_target(root / "target")
    write_tasks(root)
    port = free_port()
    server = start_server(target, port, root / "server.log")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        lm_eval("local-completions", f"base_url={base}/completions,model={target},tokenizer={target},"
                "tokenizer_backend=huggingface", "dspark_choice,dspark_continue", root, root / "scores")
        lm_eval("local-chat-completions", f"base_url={base}/chat/completions,model={target}", "dspark_answer",
                root, root / "answers", "--apply_chat_template")
    finally:
        server.terminate()
        server.wait(60)
    return target


def pair_encoder(target: Path):
    """lm-eval's ``local-completions`` model of ``target``, never connected: its ``_encode_pair`` gives the
    token ids of a (context, continuation) pair as lm-eval has them scored."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(base_url="http://127.0.0.1:1/v1/completions", model=str(target),
                               tokenizer=str(target), tokenizer_backend="huggingface")


def check(root: Path, target: Path) -> int:
    """The items of lm-eval's logged samples in ``root`` that differ from mlx-lm's."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(target))
    model.set_dtype(mx.float32)
    encoder = pair_encoder(target)
    return check_log_likelihoods(model, encoder, root / "scores") + check_answers(model, tokenizer, root / "answers")


def main() -> int:
    """``python bench/lm_eval_check.py [DIR]``: a fresh run, or only the checks of the run left in DIR."""
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="lm_eval_check_"))
    target = root / "target" if len(sys.argv) > 1 else run(root)
    wrong = check(root, target)
    print("identical to mlx-lm" if not wrong else f"{wrong} items differ from mlx-lm", f"(files in {root})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
