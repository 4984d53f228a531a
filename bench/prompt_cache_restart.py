"""A server restarted over its prompt-cache directory: a long prompt answered,
the server stopped, a new one started over the same directory answering
the same request.

The first process starts the server's engine (``serve.engine.Engine`` with
a prompt-cache directory DIR, one row, its verify width chosen as the
server's default is) on the embedded
default pair (SmolLM2-135M-Instruct and its bundled draft), answers one
greedy request whose prompt is the bundled training prompts, numbered, in
one user turn of about ``TOKENS`` tokens (default 3,000), and stops: the stop
writes the prompt cache's entry to DIR. A second process, as a restarted
server, loads the pair, starts an engine over DIR (its index read from the
files' headers) and answers the same request: the prompt but its last
token comes from the file. Reported: each engine's time to first token
(from the submit to the first tokens; the first one's includes compiling
its kernels, as a server's first long prompt does), the stop's write, the
second engine's start (its index built), the file's size, the prompt
tokens reused, and whether both replies are the same tokens. The second
engine's time to first token is the file's load and checks, and its
prefill of the prompt's last token, kernels compiled for it in that
process as a restarted server's are.

    python bench/prompt_cache_restart.py
    TOKENS=1500 NEW_TOKENS=16 python bench/prompt_cache_restart.py
"""

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark_fn.serve.engine import Engine, Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_files import long_chat_prompt  # noqa: E402  the numbered training prompts of bench/prompt_files.py

TOKENS = int(os.environ.get("TOKENS", 3000))
NEW_TOKENS = int(os.environ.get("NEW_TOKENS", 32))


def pair_and_prompt() -> tuple:
    params, tokenizer = dspark_fn.load_pair()
    return params, long_chat_prompt(tokenizer, TOKENS)


def started(params, prompt: list, directory: Path) -> tuple[Engine, float]:
    """An engine over ``directory`` (one row, the default verify width), and the seconds it took to start."""
    start = time.perf_counter()
    engine = Engine(params, max_batch=1, max_context=len(prompt) + NEW_TOKENS + 256, prompt_cache_dir=directory)
    return engine, time.perf_counter() - start


def answered(engine: Engine, prompt: list) -> dict:
    """One greedy request: its time to first token, its tokens, the prompt tokens reused."""
    start = time.perf_counter()
    request = engine.submit(Request(prompt, NEW_TOKENS))
    tokens, first = [], None
    while (update := request.events.get(timeout=3600)).kind == "tokens":
        first = first if first is not None else time.perf_counter() - start
        tokens += update.value
    assert update.kind == "done", update
    return {"ttft_s": first, "tokens": tokens, "cached_tokens": request.cached_tokens}


def first_process(directory: Path) -> dict:
    params, prompt = pair_and_prompt()
    engine, start = started(params, prompt, directory)
    answer = answered(engine, prompt)
    stop = time.perf_counter()
    engine.close()
    return answer | {"prompt_tokens": len(prompt), "start_s": start, "stop_s": time.perf_counter() - stop}


def second_process(directory: Path) -> dict:
    params, prompt = pair_and_prompt()
    engine, start = started(params, prompt, directory)
    disk = engine.stats()["prompt_cache"]["disk"]
    try:
        return answered(engine, prompt) | {"start_s": start, "files": disk["entries"], "file_bytes": disk["bytes"]}
    finally:
        engine.close()


def main() -> None:
    if sys.argv[1:2] == ["--second"]:
        print(json.dumps(second_process(Path(sys.argv[2]))))
        return
    with tempfile.TemporaryDirectory() as folder:
        first = first_process(Path(folder))
        command = [sys.executable, __file__, "--second", folder]
        second = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    print(json.dumps({
        "prompt_tokens": first["prompt_tokens"], "new_tokens": NEW_TOKENS,
        "first_ttft_s": round(first["ttft_s"], 2), "first_engine_start_s": round(first["start_s"], 2),
        "stop_write_s": round(first["stop_s"], 2),
        "restarted_ttft_s": round(second["ttft_s"], 3), "restarted_engine_start_s": round(second["start_s"], 2),
        "files": second["files"], "file_mib": round(second["file_bytes"] / 2**20, 1),
        "restarted_cached_tokens": second["cached_tokens"],
        "ratio": round(second["ttft_s"] / first["ttft_s"], 4),
        "identical_tokens": first["tokens"] == second["tokens"],
    }), flush=True)


if __name__ == "__main__":
    main()
