"""The target answers the training prompts itself, through the library's own
batched decoding: a ``Decoder`` running plain target steps (verify width 1),
its rows refilled as soon as answers finish (continuous batching; free rows
are prefilled together once a quarter of the batch is free).

Answers are token ids appended to a ``.jsonl`` file as they finish
(``{"source", "prompt", "answer"}`` per line, each on disk before the next
step), so a run killed anywhere loses only the answers in flight and resumes,
or is extended to more tokens, in a later sitting: prompts the file already
answers are skipped. The file's order follows the batch; what is trained on
is ``prefix_answers``: the answers of the prompts' shortest prefix that holds
the token target, in prompt order, which is the same however often the
answering stopped and resumed.
"""

import json
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from .. import atomic
from ..driver import Decoder, generate
from ..types import Params


class Answer(NamedTuple):
    source: str
    prompt: list
    answer: list


def complete_lines(path: Path) -> list[str]:
    """The lines of a file appended line by line, up to a torn one (a kill mid-line)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    for count, line in enumerate(lines):
        try:
            json.loads(line)
        except json.JSONDecodeError:
            return lines[:count]
    return lines


def read_answers(path) -> list[Answer]:
    """Every complete line of an answers file (a torn last line is ignored)."""
    return [Answer(**json.loads(line)) for line in complete_lines(Path(path))]


def _drop_torn_tail(path: Path) -> None:
    """Rewrite the file without a torn last line (whole or not at all), so appends follow a complete line."""
    if path.is_file():
        text = path.read_text()
        lines = complete_lines(path)
        complete = "".join(line + "\n" for line in lines)
        if text != complete:
            atomic.write_text(path, complete)


def prefix_answers(prompts: Sequence[tuple[str, list]], answers: Sequence[Answer], target_tokens: int) -> list[Answer]:
    """The answers of the shortest prefix of ``prompts`` whose answers hold
    ``target_tokens`` tokens (all of them if the prompts run out first), in
    prompt order; prompts without an answer are skipped."""
    by_prompt = {tuple(a.prompt): a for a in answers}
    chosen, tokens = [], 0
    for _, ids in prompts:
        if tokens >= target_tokens:
            break
        answer = by_prompt.get(tuple(ids))
        if answer is not None:
            chosen.append(answer)
            tokens += len(answer.answer)
    return chosen


def single_stream_speed(params: Params, prompt: list, max_new_tokens: int, stop_tokens) -> float:
    """Answer tokens per second of one prompt decoded alone (after compiling)."""
    list(generate(params, prompt, 4, width=1, stop_tokens=stop_tokens))
    start = time.perf_counter()
    count = sum(len(e.emitted) for e in generate(params, prompt, max_new_tokens, width=1, stop_tokens=stop_tokens))
    return count / (time.perf_counter() - start)


class AnswerFile:
    """The answers on disk and in memory; each new one is on disk before the next step."""

    def __init__(self, path: Path, on_answer: Callable[[int, int], None]):
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(path)
        self.path, self.on_answer = path, on_answer
        self.done = read_answers(path)
        self.answered = {tuple(a.prompt): len(a.answer) for a in self.done}  # prompt -> its answer's length
        self.tokens = sum(len(a.answer) for a in self.done)
        on_answer(len(self.done), self.tokens)

    def keep(self, prompts: Sequence[tuple[str, list]], ended: list) -> int:
        """The answers of sequences that ended (tagged with their prompt's
        index); returns their answer tokens."""
        added = 0
        for sequence in ended:
            source, prompt = prompts[sequence.tag]
            self.done.append(Answer(source=source, prompt=list(prompt), answer=sequence.tokens))
            atomic.append_line(self.path, json.dumps(self.done[-1]._asdict()))
            self.answered[tuple(prompt)] = len(sequence.tokens)
            added += len(sequence.tokens)
            self.tokens += len(sequence.tokens)
            self.on_answer(len(self.done), self.tokens)
        return added


def answer_prompts(
    params: Params,
    prompts: Sequence[tuple[str, list]],
    path,
    *,
    target_tokens: int,
    max_new_tokens: int,
    stop_tokens=(),
    batch_size: int = 16,
    on_answer: Callable[[int, int], None] = lambda answered, tokens: None,
) -> list[Answer]:
    """Answer ``(source, prompt ids)`` pairs, in order, until the answered
    prefix of ``prompts`` holds ``target_tokens`` answer tokens (or the
    prompts run out), so ``prefix_answers`` finds every answer it needs.
    ``on_answer(answers, answer tokens)`` reports progress. Returns every
    answer in the file."""
    answers = AnswerFile(Path(path), on_answer)
    decoder = Decoder(params, batch_size, width=1)
    position, covered = 0, 0  # the next prompt to start; answer tokens of the prompts before it
    while True:
        position, skipped = _skip_answered(prompts, answers.answered, position)
        covered += skipped
        refill = decoder.free >= max(1, batch_size // 4) or not decoder.busy
        if refill and position < len(prompts) and covered < target_tokens:
            starting = []  # prompt indices, the sequences' tags
            while len(starting) < decoder.free and position < len(prompts):
                starting.append(position)
                position, skipped = _skip_answered(prompts, answers.answered, position + 1)
                covered += skipped
            step = decoder.insert([list(prompts[i][1]) for i in starting], tags=starting,
                                  max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)
            covered += answers.keep(prompts, step.ended)
        if not decoder.busy:
            return answers.done
        covered += answers.keep(prompts, decoder.step().ended)


def _skip_answered(prompts: Sequence[tuple[str, list]], answered: dict, position: int) -> tuple[int, int]:
    """The first prompt from ``position`` on without an answer, and the answer tokens of those skipped."""
    skipped = 0
    while position < len(prompts) and tuple(prompts[position][1]) in answered:
        skipped += answered[tuple(prompts[position][1])]
        position += 1
    return position, skipped
