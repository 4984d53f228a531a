"""Prefill and decode speed with an image: dspark_fn against mlx-vlm's own
``generate`` (no speculation) on the same tiny random releases
(``tests/multimodal.py``: Gemma 4, Qwen3.5, LFM2-VL), the same image and
prompt, side by side in one process, taking turns, medians of ``REPEATS``.

mlx-vlm's figures are its own (``GenerationResult.prompt_tps`` and
``generation_tps``: the vision tower, the embeddings and the prefill up to
the first token; then the tokens after it). dspark_fn's are timed the same
way around ``generate``: from the call to the first token (the tower runs
inside the prefill; the processor, run before both engines, is left out of
both), then the rounds after it. Both greedy; the tokens are compared.

    python bench/images.py            # TOKENS=128 REPEATS=3 HEIGHT=48 WIDTH=64
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import dspark_fn  # noqa: E402
from dspark_fn.vision import image_prompt  # noqa: E402
from multimodal import RELEASES, Release, synthetic_image  # noqa: E402

TOKENS = int(os.environ.get("TOKENS", 128))
REPEATS = int(os.environ.get("REPEATS", 3))
HEIGHT, WIDTH = int(os.environ.get("HEIGHT", 48)), int(os.environ.get("WIDTH", 64))


def ours(release: Release, text: str, image) -> tuple[float, float, list]:
    """``(prefill tokens/s, decode tokens/s, tokens)`` of one dspark_fn run."""
    prompt = image_prompt(release.params, text, [image])
    start = time.perf_counter()
    tokens, first = [], None
    for event in dspark_fn.generate(release.params, [prompt], TOKENS):
        tokens += event.emitted
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return len(prompt) / (first - start), (len(tokens) - 1) / (end - first), tokens


def theirs(release: Release, text: str, image) -> tuple[float, float, list]:
    """``(prefill tokens/s, decode tokens/s, tokens)`` of one mlx-vlm ``generate`` run, by its own timers."""
    from mlx_vlm.generate import stream_generate

    results = list(stream_generate(release.model, release.processor, text, image=[image], max_tokens=TOKENS,
                                   temperature=0.0))
    return results[-1].prompt_tps, results[-1].generation_tps, results[-1].token_ids


def main() -> None:
    image = synthetic_image(HEIGHT, WIDTH, seed=1)
    rows = []
    for family in sorted(RELEASES):
        release = Release(Path(tempfile.mkdtemp()), family)
        text = release.text("Describe this picture in detail.", 1)
        ours(release, text, image), theirs(release, text, image)  # compile and warm both
        runs = {"dspark_fn": [], "mlx-vlm": []}
        for _ in range(REPEATS):
            runs["dspark_fn"].append(ours(release, text, image))
            runs["mlx-vlm"].append(theirs(release, text, image))
        same = runs["dspark_fn"][0][2] == runs["mlx-vlm"][0][2]
        prompt = len(image_prompt(release.params, text, [image]))
        for engine, measured in runs.items():
            prefill = statistics.median(run[0] for run in measured)
            decode = statistics.median(run[1] for run in measured)
            rows.append(f"| {family} | {prompt} | {engine} | {prefill:.0f} | {decode:.1f} | {same} |")
    print(f"{TOKENS} new tokens, a {HEIGHT} x {WIDTH} image, medians of {REPEATS}")
    print("| release | prompt tokens | engine | prefill tokens/s | decode tokens/s | identical tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
