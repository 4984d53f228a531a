"""Repeated bursts against ``dspark serve`` (loopback, bounded): requests
streamed and whole, clients leaving mid-stream, hostile bodies. Every
hostile body gets a 4xx within a second; after two bursts (kernels
compiled, the allocator's pools grown) the server's resident memory grows
less than 5 % over three bursts that compile no kernel (``/health``'s
``traces``: a kernel's code is memory the server keeps);
and at rest MLX holds no more than the weights, the idle batch and what
``/health`` says the prompt cache holds (nothing else keeps buffers alive).

Breaks tried, and what caught them:
- the prompt cache storing slices of the running batch's buffers
  (``buffers.row_cache`` cutting views of them, no copy): each entry keeps a
  whole batch buffer alive, and
  the held memory exceeds the accounted one;
- the engine keeping 1 MiB of Python memory per ended request: the quiet
  bursts grow 16 % (43 MB of 271).
"""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from published import qwen3_pair
from test_serve import running_server

openai = pytest.importorskip("openai")

WARM_BURSTS = 2  # measured (about 3 % of resident memory here over the first two), then not counted
QUIET_BURSTS = 3  # bursts that compile no kernel, whose growth together stays within 5 %
MAX_BURSTS = 16  # a burst takes about a second here; every batch size and width is met well before
HOSTILE = [
    b"{", b"[]", b"\xff\xfe", json.dumps({"messages": "hi"}).encode(),
    json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x " * 3000}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 1000}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": "all"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}).encode(),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_memory")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    with running_server(root, max_batch=4, extra=("--prompt-cache-mb", "64")) as running:
        yield running


def health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=30) as response:
        return json.loads(response.read())


def hostile(base: str, body: bytes) -> tuple[int, float]:
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, time.perf_counter() - start
    except urllib.error.HTTPError as error:
        return error.code, time.perf_counter() - start


def burst(base: str, model: str, number: int) -> list:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120)
    answers = []

    def ask(i: int) -> None:
        text = f"burst {number} request {i}: tell me about the quick brown fox"
        if i % 4 == 3:  # leaves after its first chunk
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                    max_tokens=200, stream=True)
            next(iter(stream))
            stream.close()
        elif i % 4 == 2:
            answers.append(client.completions.create(model=model, prompt=text, max_tokens=24).choices[0].text)
        else:
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                   max_tokens=24, stream=bool(i % 2))
            answers.append(reply)

    codes = []
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    threads += [threading.Thread(target=lambda body=body: codes.append(hostile(base, body))) for body in HOSTILE]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return codes


def at_rest(base: str) -> dict:
    for _ in range(200):  # the leaving clients' rows are freed at the next round
        state = health(base)
        if not state["active"] and not state["waiting"]:
            return state
        time.sleep(0.05)
    raise AssertionError("the server did not come to rest")


def test_memory_stays_bounded_over_repeated_bursts(server):
    """Resident memory grows with each kernel compiled (its code), and which
    batch sizes and widths a burst reaches depends on when its requests
    arrive: the bursts compared are those that compiled nothing."""
    base, _, _ = server
    model = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
    idle = at_rest(base)["memory"]["mlx_active_bytes"]
    settled, growth = None, []  # (resident bytes, traces) after the last burst; growth over quiet bursts
    for number in range(MAX_BURSTS):
        codes = burst(base, model, number)
        assert all(400 <= code < 500 and seconds < 1.0 for code, seconds in codes), codes
        state = at_rest(base)
        resident = state["memory"]["resident_bytes"] - state["prompt_cache"]["bytes"]
        traces = sum(state["traces"].values())
        held = state["memory"]["mlx_active_bytes"] - idle
        assert held <= state["prompt_cache"]["bytes"] + (2 << 20), (number, held, state["prompt_cache"])
        if number >= WARM_BURSTS and traces == settled[1]:
            growth.append(resident - settled[0])
        settled = (resident, traces)
        if len(growth) == QUIET_BURSTS:
            break
    assert len(growth) == QUIET_BURSTS, f"kernels still compiling after {MAX_BURSTS} bursts"
    assert sum(growth) <= 0.05 * settled[0], growth
