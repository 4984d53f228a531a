"""``dspark serve`` under ``mlx.launch -n 2`` (ring backend on 127.0.0.1):
rank 0 serves HTTP, both ranks decode their share of the target, and the
``openai`` client gets what one process gives: concurrent greedy replies
equal to the library's, streamed or whole, seeded samples that repeat, a
client that leaves mid-stream freeing its row on both ranks, and SIGTERM
to the server (rank 0) ending both ranks and the launcher.

Breaks tried, and what caught them:
- a cancellation read from the request's own flag when the round reaches
  it (as one process does) instead of from the inputs rank 0 shares: the
  ranks take a different batch after the client leaves and the next
  request hangs until its timeout.
"""

import threading
from pathlib import Path

import pytest

from helpers import ring_launcher
from published import qwen3_pair
from test_serve import chat, reference_text, reference_tokens, running_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_distributed")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    return root


@pytest.fixture(scope="module")
def library(pair):
    import mlx.core as mx

    import dspark_fn
    from dspark_fn.checkpoints import load_tokenizer

    params = dspark_fn.catalog.load_named(str(pair / "target"), str(pair / "draft"), dtype=mx.float32)[0]
    return params, load_tokenizer(pair / "target")


@pytest.fixture(scope="module")
def server(pair):
    # planned at the prior's costs: the decisions, and so a seeded sampled reply, the same every run
    with running_server(pair, max_batch=4, launcher=ring_launcher(2), extra=("--costs", "prior")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server, pair):
    import test_serve

    test_serve.MODEL = str(pair / "target")
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=120)


PROMPTS = ["Name three colours.", "Count to five.", "What is two plus two?", "Say hello."]


def test_concurrent_greedy_replies_equal_one_process(client, library):
    replies = {}

    def ask(text):
        replies[text] = chat(client, text, max_tokens=24).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(text,)) for text in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies == {text: reference_text(library, text, 24) for text in PROMPTS}


def unending_prompt(library, budget: int) -> str:
    """A prompt whose greedy reply runs the whole budget (no stop token): its request ends only when cancelled."""
    from dspark_fn.chat import chat_tokens

    tokenizer = library[1]
    for number in range(50):
        text = f"Tell me a story about the number {number}."
        if len(reference_tokens(library, chat_tokens(tokenizer, text), budget)) == budget:
            return text
    raise AssertionError("every candidate reply ends before the budget")


def test_a_stream_and_a_client_that_leaves(client, library):
    stream = chat(client, PROMPTS[0], max_tokens=24, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference_text(library, PROMPTS[0], 24)
    leaving = chat(client, unending_prompt(library, 400), max_tokens=400, stream=True)
    next(iter(leaving))
    leaving.close()  # both ranks free its row at the same pass
    assert chat(client, PROMPTS[2], max_tokens=24).choices[0].message.content == reference_text(library, PROMPTS[2], 24)


def test_seeded_samples_repeat(client):
    first, second = (chat(client, PROMPTS[3], max_tokens=24, temperature=0.9, seed=7).choices[0].message.content
                     for _ in range(2))
    assert first == second


def rank_processes(launcher_pid: int) -> dict:
    """``{rank: pid}`` of the processes ``mlx.launch`` started (their ``MLX_RANK``)."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environment = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = [item for item in environment if item.startswith(b"MLX_RANK=")]
        if parent == launcher_pid and rank:
            ranks[int(rank[0].split(b"=")[1])] = int(stat.parent.name)
    return ranks


def test_sigterm_to_the_server_stops_both_ranks(server):
    import os
    import signal

    _, process, log = server
    ranks = rank_processes(process.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[0], signal.SIGTERM)  # the HTTP server: it tells rank 1 to stop, and the launcher ends
    assert process.wait(timeout=60) == 0, log.read_text()[-2000:]
