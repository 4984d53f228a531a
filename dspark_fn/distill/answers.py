"""The target answers the training prompts itself, through the library's own
batched decoding: a ``Decoder`` running plain target steps (verify width 1),
its rows refilled as soon as answers finish (continuous batching; free rows
are prefilled together once a quarter of the batch is free).

Answers are token ids appended to a ``.jsonl`` file as they finish
(``{"source", "prompt", "answer"}`` per line), so a run stops anywhere (Ctrl-C
loses only the answers in flight) and resumes, or is extended to more tokens,
in a later sitting: prompts the file already answers are skipped.
"""

import json
import time
from collections import deque
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from ..driver import Decoder, generate
from ..types import Params


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


def single_stream_speed(params: Params, prompt: list, max_new_tokens: int, stop_tokens) -> float:
    """Answer tokens per second of one prompt decoded alone (after compiling)."""
    list(generate(params, prompt, 4, width=1, stop_tokens=stop_tokens))
    start = time.perf_counter()
    count = sum(len(e.emitted) for e in generate(params, prompt, max_new_tokens, width=1, stop_tokens=stop_tokens))
    return count / (time.perf_counter() - start)


def answer_prompts(
    params: Params,
    prompts: Sequence[tuple[str, list]],
    path,
    target_tokens: int,
    max_new_tokens: int,
    stop_tokens=(),
    batch_size: int = 16,
    on_answer: Callable[[int, int], None] = lambda answered, tokens: None,
) -> list[Answer]:
    """Answer ``(source, prompt ids)`` pairs until the file holds
    ``target_tokens`` answer tokens (or the prompts run out).
    ``on_answer(answers, answer tokens)`` reports progress. Returns every
    answer in the file."""
    path = Path(path)
    done = read_answers(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:  # rewrite what was complete, dropping a torn line
        handle.writelines(json.dumps(a._asdict()) + "\n" for a in done)
    answered = {tuple(a.prompt) for a in done}
    pending = deque((source, list(ids)) for source, ids in prompts if tuple(ids) not in answered)
    tokens = sum(len(a.answer) for a in done)
    on_answer(len(done), tokens)
    stop_tokens = set(stop_tokens)
    decoder = Decoder(params, batch_size, width=1)
    rows: dict = {}  # row -> (source, prompt, answer so far)

    def finish(row: int) -> None:
        nonlocal tokens
        source, prompt, answer = rows.pop(row)
        answer = answer[:max_new_tokens]
        done.append(Answer(source, prompt, answer))
        with path.open("a") as handle:
            handle.write(json.dumps(done[-1]._asdict()) + "\n")
        tokens += len(answer)
        decoder.release(row)
        on_answer(len(done), tokens)

    def fill() -> None:
        free = [row for row in range(batch_size) if row not in rows]
        if len(free) < max(1, batch_size // 4) and rows or not pending or tokens >= target_tokens:
            return
        batch = [pending.popleft() for _ in free[: len(pending)]]
        firsts = decoder.insert(free[: len(batch)], [ids for _, ids in batch])
        for row, (source, ids), first in zip(free, batch, firsts):
            rows[row] = (source, ids, [first])
            if first in stop_tokens or max_new_tokens == 1:
                finish(row)

    fill()
    while rows:
        step = decoder.step()
        for row, emitted in zip(step.rows, step.emitted):
            if row not in rows:
                continue
            answer = rows[row][2]
            answer += emitted
            stop = next((i for i, t in enumerate(answer) if t in stop_tokens), None)
            if stop is not None:
                del answer[stop + 1 :]
            if stop is not None or len(answer) >= max_new_tokens:
                finish(row)
        fill()
    return done
