"""``dspark serve`` against ``mlx_lm.server`` on the same weights (the embedded
SmolLM2-135M-Instruct, exported once to an mlx-lm directory), one after the
other on 127.0.0.1: streaming greedy chat requests from the bundled prompts,
1, 4 and 8 concurrent clients, a fixed number of requests each; then a
repeated-conversation run (a second turn that extends the first) with the
prompt cache on and off.

    python bench/serve_bench.py            # REQUESTS=4 TOKENS=96 CLIENTS=1,4,8
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
from mlx.utils import tree_flatten

from dspark_fn.evaluate import first_turns
from dspark_fn.catalog import DEFAULT_DRAFT, load_target_named

REQUESTS = int(os.environ.get("REQUESTS", 4))
TOKENS = int(os.environ.get("TOKENS", 96))
CLIENTS = [int(c) for c in os.environ.get("CLIENTS", "1,4,8").split(",")]


def export_target(directory: Path) -> Path:
    """The embedded GGUF target as an mlx-lm directory both servers can load."""
    config, params, tokenizer = load_target_named(None)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(params)))
    tokenizer._tokenizer.save_pretrained(str(directory))
    return directory


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(command: list, port: int):
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"server did not start: {command}")


def stream_chat(client, model: str, messages: list) -> tuple[float, float, int, str]:
    """``(seconds to first token, total seconds, completion tokens, text)`` of one streamed request."""
    start = time.perf_counter()
    first, text, tokens = None, "", 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - start
            text += chunk.choices[0].delta.content
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first or 0.0, time.perf_counter() - start, tokens, text


def load_run(client, model: str, prompts: list, clients: int) -> dict:
    results, lock = [], threading.Lock()

    def worker(index: int):
        for r in range(REQUESTS):
            text = prompts[(index * REQUESTS + r) % len(prompts)]
            outcome = stream_chat(client, model, [{"role": "user", "content": text}])
            with lock:
                results.append(outcome)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {
        "aggregate": sum(r[2] for r in results) / wall,
        "per_request": statistics.median(r[2] / max(r[1] - r[0], 1e-9) for r in results),
        "ttft": statistics.median(r[0] for r in results),
    }


def conversation_ttft(client, model: str, prompts: list) -> float:
    """Median time to first token of a second turn extending a first one."""
    times = []
    for text in prompts[:REQUESTS]:
        first = [{"role": "user", "content": text}]
        _, _, _, answer = stream_chat(client, model, first)
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say that more briefly."}]
        times.append(stream_chat(client, model, second)[0])
    return statistics.median(times)


def main() -> None:
    import openai

    prompts = first_turns("mt-bench") + first_turns("gsm8k", 20)
    with tempfile.TemporaryDirectory() as scratch:
        target = export_target(Path(scratch) / "smollm2")
        python = sys.executable
        engines = {
            "dspark serve": lambda port, extra=(): [python, "-m", "dspark_fn.cli", "serve", "--model", str(target),
                                                    "--draft", str(DEFAULT_DRAFT), "--port", str(port),
                                                    "--max-batch", "8", *extra],
            "mlx_lm.server": lambda port, extra=(): [python, "-m", "mlx_lm.server", "--model", str(target),
                                                     "--port", str(port)],
        }
        # mlx_lm.server lists the hub cache under /v1/models; its loaded model answers to "default_model"
        models = {"dspark serve": None, "mlx_lm.server": "default_model"}
        rows = {}
        for name, command in engines.items():
            port = free_port()
            server = start(command(port), port)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            model = models[name] or client.models.list().data[0].id
            stream_chat(client, model, [{"role": "user", "content": "warm up"}])
            rows[name] = {clients: load_run(client, model, prompts, clients) for clients in CLIENTS}
            rows[name]["conversation"] = conversation_ttft(client, model, prompts[REQUESTS:])
            server.terminate()
            server.wait()
        port = free_port()
        server = start(engines["dspark serve"](port, ("--prompt-cache-mb", "0")), port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        no_cache = conversation_ttft(client, client.models.list().data[0].id, prompts[REQUESTS:])
        server.terminate()
        server.wait()
    print(f"{REQUESTS} streaming greedy requests per client, {TOKENS} tokens at most, bundled prompts\n")
    print("| clients | engine | aggregate tokens/s | per-request tokens/s | time to first token (s) |")
    print("|---|---|---|---|---|")
    for clients in CLIENTS:
        for name in engines:
            r = rows[name][clients]
            print(f"| {clients} | {name} | {r['aggregate']:.1f} | {r['per_request']:.1f} | {r['ttft']:.2f} |")
    print("\n| second turn of a conversation | time to first token (s) |\n|---|---|")
    print(f"| dspark serve, prompt cache on | {rows['dspark serve']['conversation']:.2f} |")
    print(f"| dspark serve, prompt cache off | {no_cache:.2f} |")
    print(f"| mlx_lm.server | {rows['mlx_lm.server']['conversation']:.2f} |")


if __name__ == "__main__":
    main()
