"""The reference evaluation protocol (spec §9): first turn only, chat template,
thinking off, greedy; acceptance statistics over a prompt set."""

import json
import random
from pathlib import Path
from typing import Callable, Iterable

from .driver import generate
from .stats import Tally

DATA_DIR = Path(__file__).parent / "data" / "eval"
DATASETS = sorted(path.stem for path in DATA_DIR.glob("*.jsonl"))
SUBSET_SEED = 980406


def dataset_path(dataset: str) -> Path:
    path = Path(dataset)
    if path.suffix == ".jsonl" and path.is_file():
        return path
    if dataset in DATASETS:
        return DATA_DIR / f"{dataset}.jsonl"
    raise ValueError(f"unknown dataset {dataset!r}: use one of {', '.join(DATASETS)} or a path to a .jsonl file")


def first_turns(dataset: str, n: int | None = None) -> list[str]:
    """First-turn prompts; ``n`` smaller than the set takes a seeded subset in file order."""
    lines = [json.loads(line) for line in dataset_path(dataset).read_text().splitlines() if line.strip()]
    prompts = [row["turns"][0] if "turns" in row else row["prompt"] for row in lines]
    if n is not None and n < len(prompts):
        keep = sorted(random.Random(SUBSET_SEED).sample(range(len(prompts)), n))
        prompts = [prompts[i] for i in keep]
    return prompts


def run_prompts(
    params,
    prompts: Iterable[list[int]],
    max_new_tokens: int,
    stop: list[int],
    on_prompt: Callable[[int, Tally], None] = lambda i, a: None,
    **generate_options,
) -> tuple[Tally, int, bool]:
    """Generate for each prompt, accumulating acceptance; Ctrl-C returns what was done.

    Returns ``(acceptance, prompts completed, interrupted)``.
    """
    acceptance, done = Tally(), 0
    try:
        for prompt in prompts:
            for event in generate(params, prompt, max_new_tokens, stop_tokens=stop, **generate_options):
                acceptance.count(event)
            done += 1
            on_prompt(done, acceptance)
    except KeyboardInterrupt:
        return acceptance, done, True
    return acceptance, done, False
