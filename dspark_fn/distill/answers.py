"""The target answers the training prompts itself, in batches, through ``generate``.

Answers are token ids appended to a ``.jsonl`` file one batch at a time
(``{"source", "prompt", "answer"}`` per line), so a run stops anywhere (Ctrl-C
loses at most the batch in flight) and resumes, or is extended to more
tokens, in a later sitting: the prompt list is deterministic and the file
says how far it got.
"""

import json
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from ..speculate import Params, generate


class Answer(NamedTuple):
    source: str
    prompt: list
    answer: list


def read_answers(path) -> list[Answer]:
    """Every complete line of an answers file (a torn last line is ignored)."""
    path = Path(path)
    if not path.is_file():
        return []
    answers = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        answers.append(Answer(row["source"], row["prompt"], row["answer"]))
    return answers


def answer_batch(params: Params, prompts: Sequence[list], max_new_tokens: int, stop_tokens) -> list[list]:
    """Greedy answers of the target alone (verify width 1) for one batch."""
    answers = [[] for _ in prompts]
    for event in generate(params, [list(p) for p in prompts], max_new_tokens, width=1, stop_tokens=stop_tokens):
        answers[event.row] += event.emitted
    return answers


def decode_speed(params: Params, prompts: Sequence[list], max_new_tokens: int, stop_tokens) -> float:
    """Answer tokens per second of one batch (after its kernels are compiled)."""
    answer_batch(params, prompts, 4, stop_tokens)
    start = time.perf_counter()
    answers = answer_batch(params, prompts, max_new_tokens, stop_tokens)
    return sum(map(len, answers)) / (time.perf_counter() - start)


def answer_prompts(
    params: Params,
    prompts: Sequence[tuple[str, list]],
    path,
    target_tokens: int,
    max_new_tokens: int,
    stop_tokens=(),
    batch_size: int = 32,
    on_batch: Callable[[int, int], None] = lambda answered, tokens: None,
) -> list[Answer]:
    """Answer ``(source, prompt ids)`` pairs in order until the file holds
    ``target_tokens`` answer tokens (or the prompts run out); prompts the
    file already answers are skipped, so a run resumes or extends it. ``on_batch(prompts answered, answer tokens)``
    reports progress. Returns every answer in the file."""
    path = Path(path)
    done = read_answers(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:  # rewrite what was complete, dropping a torn line
        handle.writelines(json.dumps(a._asdict()) + "\n" for a in done)
    tokens = sum(len(a.answer) for a in done)
    answered = {tuple(a.prompt) for a in done}
    pending = [(source, list(ids)) for source, ids in prompts if tuple(ids) not in answered]
    on_batch(len(done), tokens)
    while tokens < target_tokens and pending:
        batch, pending = pending[:batch_size], pending[batch_size:]
        answers = answer_batch(params, [ids for _, ids in batch], max_new_tokens, stop_tokens)
        new = [Answer(source, ids, answer) for (source, ids), answer in zip(batch, answers)]
        with path.open("a") as handle:
            handle.writelines(json.dumps(a._asdict()) + "\n" for a in new)
        done += new
        tokens += sum(len(a.answer) for a in new)
        on_batch(len(done), tokens)
    return done
