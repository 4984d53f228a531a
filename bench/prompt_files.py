"""Prefill once: a long prompt answered, its prefilled cache saved to a file,
and the same prompt answered again in a new process from that file.

For each pair, the first process prefills a ~3,000-token prompt from an
empty cache (growing it bucket by bucket, as ``generate`` does) to its
first token, saves the cache (``save_prompt_cache``), and decodes the next
tokens with ``speculate``; a second process loads the pair and the file
(``load_prompt_cache``: its first token is the saved anchor) and decodes as
many. Reported: time to first token in each process (the first one's with
and without compilation: the prefill is repeated once compiled), the save,
the file's size, and whether the continuations are the same tokens.

Pairs: the embedded default (SmolLM2-135M-Instruct and its draft, a plain
target; the prompt is bundled training prompts through the chat template),
and a tiny random Qwen3.5 hybrid (gated delta nets beside gated attention,
hidden size 64, six layers, random weights; the prompt is random token
ids): no real hybrid model is at hand on this machine, and the file path
is the same for any size, recurrent states included.

    python bench/prompt_files.py
"""

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hybrids import HYBRID_SHAPES  # noqa: E402  the tests' tiny hybrid shapes

PROMPT_TOKENS = 3000
NEW_TOKENS = 32
HYBRID = HYBRID_SHAPES["qwen3_5"]


def build_hybrid(root: Path) -> None:
    """A random tiny Qwen3.5 target (mlx-lm's own model, weights scaled up so
    that it writes varied text) and a one-layer random draft, on disk."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    from dspark_fn.checkpoints import SHARED_WITH_TARGET, save_draft
    from dspark_fn.distill.config import draft_config_for
    from dspark_fn.drafts import resolve_arch
    from dspark_fn.drafts.fresh import random_draft_weights

    model_class, args_class = _get_classes(HYBRID)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(HYBRID))
    model.update(tree_map(lambda w: w * 2.5 if w.ndim == 2 else w, model.parameters()))
    (root / "target").mkdir(parents=True)
    (root / "target" / "config.json").write_text(json.dumps(HYBRID))
    mx.save_safetensors(str(root / "target" / "model.safetensors"), dict(tree_flatten(model.parameters())))
    draft = draft_config_for(HYBRID, layers=1, taps=[0, 4], block_size=5, markov_rank=8)
    arch = resolve_arch(draft)
    weights = random_draft_weights(arch, arch.spec_from_config(draft), seed=1, gain=2.0)
    save_draft(root / "draft", draft, {k: v for k, v in weights.items() if k not in SHARED_WITH_TARGET})


def load(pair: str):
    """``(params, prompt)``: the pair (the embedded default, or a hybrid directory) and its ~3,000-token prompt."""
    if pair == "default":
        params, tokenizer = dspark_fn.load_pair()
        return params, long_chat_prompt(tokenizer)
    params = dspark_fn.load(Path(pair) / "target", Path(pair) / "draft")
    return params, np.random.default_rng(0).integers(0, HYBRID["vocab_size"] - 1, PROMPT_TOKENS).tolist()


def long_chat_prompt(tokenizer, tokens: int = PROMPT_TOKENS) -> list[int]:
    """The bundled training prompts, numbered, in one user turn of about ``tokens`` tokens."""
    lines = (Path(dspark_fn.__file__).parent / "data" / "train_prompts.jsonl").read_text().splitlines()
    questions = [json.loads(line)["turns"][0] for line in lines if line.strip()]
    text, prompt = "", []
    for number, question in enumerate(questions, 1):
        text += f"{number}. {question}\n\n"
        turn = [{"role": "user", "content": text + "Answer the last question."}]
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True)
        if len(prompt) >= tokens:
            break
    return prompt


def room(prompt: list, params) -> int:
    """The capacity both processes decode in: the prompt, the new tokens and a round of the widest verify."""
    return dspark_fn.capacity_for(len(prompt) + NEW_TOKENS + params.spec.block_size + 1)


def continuation(params, cache, anchor) -> list[int]:
    """The next ``NEW_TOKENS`` tokens after the anchor, greedy, with ``speculate``."""
    tokens, out = anchor, []
    while len(out) < NEW_TOKENS:
        cache, step = dspark_fn.speculate(params, cache, tokens)
        out += step.emitted[0, : step.count.item()].tolist()
        tokens = step.next_tokens
    return out[:NEW_TOKENS]


def fresh_prefill(params, prompt):
    """Prefill from an empty cache to the first token: ``(cache, anchor, seconds)``."""
    start = time.perf_counter()
    cache = dspark_fn.init_cache(params, 1, dspark_fn.capacity_for(1))
    cache, anchor = dspark_fn.prefill(params, cache, prompt, grow=True)
    anchor.item()
    return cache, anchor, time.perf_counter() - start


def first_process(pair: str, file: Path) -> dict:
    params, prompt = load(pair)
    cache, anchor, cold = fresh_prefill(params, prompt)
    start = time.perf_counter()
    dspark_fn.save_prompt_cache(file, params, cache, prompt, anchor)
    saved = time.perf_counter() - start
    tokens = continuation(params, dspark_fn.grow_cache(params, cache, room(prompt, params)), anchor)
    _, _, warm = fresh_prefill(params, prompt)
    return {"prompt_tokens": len(prompt), "fresh_cold_s": cold, "fresh_warm_s": warm, "save_s": saved,
            "file_mib": file.stat().st_size / 2**20, "tokens": tokens}


def second_process(pair: str, file: Path) -> dict:
    params, prompt = load(pair)
    start = time.perf_counter()
    cache, held, anchor = dspark_fn.load_prompt_cache(file, params, capacity=room(prompt, params))
    anchor.item()
    loaded = time.perf_counter() - start
    assert held == prompt
    return {"load_first_token_s": loaded, "tokens": continuation(params, cache, anchor)}


def measure(pair: str, file: Path) -> dict:
    first = first_process(pair, file)
    command = [sys.executable, __file__, "--second", pair, str(file)]
    second = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return {
        "prompt_tokens": first["prompt_tokens"], "fresh_ttft_cold_s": round(first["fresh_cold_s"], 2),
        "fresh_ttft_warm_s": round(first["fresh_warm_s"], 2), "save_s": round(first["save_s"], 3),
        "file_mib": round(first["file_mib"], 1), "new_process_ttft_s": round(second["load_first_token_s"], 3),
        "ratio_to_warm": round(second["load_first_token_s"] / first["fresh_warm_s"], 4),
        "identical_tokens": first["tokens"] == second["tokens"], "tokens_compared": NEW_TOKENS,
    }


def main() -> None:
    if sys.argv[1:2] == ["--second"]:
        print(json.dumps(second_process(sys.argv[2], Path(sys.argv[3]))))
        return
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        build_hybrid(folder / "hybrid")
        pairs = {"default (SmolLM2-135M, plain)": "default", "tiny qwen3_5 hybrid": str(folder / "hybrid")}
        for number, (name, pair) in enumerate(pairs.items()):
            print(json.dumps({"pair": name} | measure(pair, folder / f"pair{number}.safetensors")), flush=True)


if __name__ == "__main__":
    main()
