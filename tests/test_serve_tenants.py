"""Clients kept apart, on a real engine behind API keys: what the server
keeps across requests (the prompt cache) serves only the key that stored
it, and a ``cache_salt`` narrows that further; nothing a reply reports
(``cached_tokens``, per-source statistics) tells one key of another's
requests; ``/health`` without a key says only that the server lives; a
whole (non-streaming) reply whose client left frees its row; and
``/health`` answers while a large body is parsed.

Breaks tried, and the tests that catch them:
- the lookup walking every scope's trie (``PrefixTrie.root`` returning one
  root for all): test_one_keys_document_is_not_found_by_another (the second
  key found 40-odd cached tokens);
- the scope made of the salt alone (``tenant_scope`` without the tenant):
  the same test;
- no watch on a whole reply's client (``cancel_when_gone`` not started):
  test_a_whole_reply_whose_client_left_frees_its_row (the row decoded on);
- the body parsed on the event loop: test_health_answers_while_a_large_body_is_parsed.
"""

import http.client
import json
import threading
import time
import urllib.request

import mlx.core as mx
import pytest

import dspark_fn
from dspark_fn.checkpoints import load_tokenizer
from dspark_fn.serve.app import create_app
from dspark_fn.serve.engine import Engine
from helpers import build_draft, build_target, running, target_config
from hybrids import hybrid_draft_config
from published import qwen_tokenizer

KEYS = ("alice-key", "bob-key")
DOCUMENT = "Here is my private note about the quarterly plan, the budget and the names of everyone on the team. " * 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    config = target_config("qwen3", vocab=320, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    build_target(root / "target", config, seed=3)
    qwen_tokenizer(root / "target")
    build_draft(root / "draft", hybrid_draft_config(config, layers=1, taps=(0,), block_size=4), seed=1)
    params = dspark_fn.catalog.load_named(str(root / "target"), str(root / "draft"), dtype=mx.float32)[0]
    return params, load_tokenizer(root / "target")


@pytest.fixture(scope="module")
def server(pair):
    params, tokenizer = pair
    engine = Engine(params, max_batch=2, max_context=4096, width=4)
    try:
        with running(create_app(engine, tokenizer, "m", api_keys=KEYS, max_body_bytes=16 << 20)) as base:
            yield base, engine
    finally:
        engine.close()


def post(base: str, path: str, body: dict | bytes, key: str | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def cached(base: str, key: str, text: str, **extra) -> int:
    """The prompt tokens the server says its cache gave a chat request of ``text`` from ``key``."""
    status, reply = post(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0} | extra, key)
    assert status == 200, reply
    assert "sources" not in reply["dspark"]  # keys in use: no per-source statistics
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_keys_document_is_not_found_by_another(server):
    """Alice's document, asked again, is served from the cache for Alice (the
    conversation so far: most of the prompt); Bob sending the very same
    document finds nothing, as does Alice under a cache_salt of her own."""
    base, _ = server
    assert cached(base, KEYS[0], DOCUMENT) == 0
    assert cached(base, KEYS[0], DOCUMENT + " And one more question?") > 20
    assert cached(base, KEYS[1], DOCUMENT + " And one more question?") == 0
    assert cached(base, KEYS[0], DOCUMENT + " And one more question?", cache_salt="project-x") == 0
    assert cached(base, KEYS[0], DOCUMENT + " And one more question?", cache_salt="project-x") > 20


def test_health_tells_only_liveness_without_a_key(server):
    base, _ = server
    with urllib.request.urlopen(base + "/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    request = urllib.request.Request(base + "/health", headers={"x-api-key": KEYS[1]})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert {"status", "active", "queue", "prompt_cache"} <= set(json.loads(response.read()))


def test_a_whole_reply_whose_client_left_frees_its_row(server):
    """A non-streaming request for thousands of tokens, its connection closed
    at once: the row is free within seconds, long before the budget."""
    base, engine = server
    host, port = base.removeprefix("http://").split(":")
    before = engine.stats()["served"]["generated_tokens"]
    body = json.dumps({"messages": [{"role": "user", "content": "count on and on"}], "max_tokens": 3000,
                       "temperature": 0})
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", body,
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[0]}"})
    time.sleep(0.3)
    connection.sock.close()
    deadline = time.monotonic() + 5
    while engine.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.stats()["active"] == 0
    assert engine.stats()["served"]["generated_tokens"] - before < 3000


def test_health_answers_while_a_large_body_is_parsed(server):
    """A 15 MB body of many small parts (within every bound; refused once
    read) is parsed off the event loop: /health answers within a second
    throughout."""
    base, _ = server
    parts = [{"type": "text", "text": "x" * 32}] * 260_000  # within the bound on JSON objects (schema.MAX_NODES)
    body = json.dumps({"messages": [{"role": "user", "content": parts}], "max_tokens": 2}).encode()
    assert 14 << 20 < len(body) < 16 << 20
    sent = threading.Thread(target=post, args=(base, "/v1/chat/completions", body, KEYS[0]), daemon=True)
    sent.start()
    slowest = 0.0
    while sent.is_alive():
        start = time.monotonic()
        with urllib.request.urlopen(base + "/health", timeout=30) as response:
            assert response.status == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    assert slowest < 1.0
