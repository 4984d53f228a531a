"""Whether speculation pays in a server's batch: ``dspark serve`` as it ships
(``--width auto``: the planner drafts, verifies copies and stored answers only
when its per-batch-size costs and measured rates say so) beside the same
server with speculation off (``--width 1``: one target step a round), both
loaded at once on the same weights (the embedded SmolLM2-135M-Instruct and
its draft), the phases alternating: 1, 4 and 8 concurrent clients, each
sending REQUESTS streaming greedy chat requests (TOKENS tokens at most), the
prompts taken in turn from each of SETS (bundled chat and word problems), so
every phase sends both kinds. Reports each phase's aggregate tokens/s,
medians over REPEATS, the ratio of the medians, and the median of each
repeat's own ratio (its two phases ran back to back, so a drift in the
machine's speed over minutes cancels there).

    python bench/serve_speculation.py     # REQUESTS=2 TOKENS=64 CLIENTS=1,4,8 REPEATS=3 SETS=mt-bench,gsm8k
"""

import os
import statistics
import sys

os.environ.setdefault("REQUESTS", "2")
os.environ.setdefault("TOKENS", "64")

import openai  # noqa: E402

from dspark_fn.evaluate import first_turns  # noqa: E402
from serve_bench import CLIENTS, REQUESTS, TOKENS, free_port, load_run, start  # noqa: E402

REPEATS = int(os.environ.get("REPEATS", 3))
SETS = os.environ.get("SETS", "mt-bench,gsm8k").split(",")
ENGINES = {"default": (), "--width 1": ("--width", "1")}


def serve(extra: tuple):
    """A started server on the embedded default (its draft and its shipped
    store, read only, as ``dspark serve`` runs with no flags) with ``extra``
    flags, and a client to it."""
    port = free_port()
    process = start([sys.executable, "-m", "dspark_fn.cli", "serve", "--port", str(port), "--max-batch", "8", *extra],
                    port)
    return process, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")


def alternating(sets: list) -> list:
    """One prompt of each set in turn, as long as every set has one left."""
    return [prompt for group in zip(*sets) for prompt in group]


def main() -> None:
    prompts = alternating([first_turns(name, 20) for name in SETS])
    aggregate = {(name, clients): [] for name in ENGINES for clients in CLIENTS}
    servers = {name: serve(extra) for name, extra in ENGINES.items()}
    try:
        models = {name: client.models.list().data[0].id for name, (_, client) in servers.items()}
        for name, (_, client) in servers.items():  # every batch size's kernels compiled before the clock
            load_run(client, models[name], prompts, max(CLIENTS))
        for repeat in range(REPEATS):
            for clients in CLIENTS:
                order = list(ENGINES) if repeat % 2 == 0 else list(ENGINES)[::-1]
                for name in order:
                    _, client = servers[name]
                    run = load_run(client, models[name], prompts, clients)
                    aggregate[name, clients].append(run["aggregate"])
                    print(f"repeat {repeat} clients {clients} {name}: {run['aggregate']:.1f} tokens/s", flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    print(f"\n{REQUESTS} streaming greedy requests a client ({' and '.join(SETS)} in turn), {TOKENS} tokens at most, "
          f"medians of {REPEATS}\n")
    print("| clients | default tokens/s | --width 1 tokens/s | default / --width 1 | median of each repeat's ratio |")
    print("|---|---|---|---|---|")
    for clients in CLIENTS:
        default, plain = (statistics.median(aggregate[name, clients]) for name in ENGINES)
        paired = statistics.median(a / b for a, b in zip(*(aggregate[name, clients] for name in ENGINES)))
        print(f"| {clients} | {default:.1f} | {plain:.1f} | {default / plain:.2f}x | {paired:.2f}x |")


if __name__ == "__main__":
    main()
