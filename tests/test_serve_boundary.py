"""The server as a boundary: every request a client can send, careless or
hostile, gets an answer in its API's shape within seconds, never a 5xx or a
hang, and the server goes on answering valid requests exactly as before.

A fuzzer (hypothesis, ``fuzzing.py``) sends generated bodies to every
endpoint of a multimodal target behind a key: valid bodies with fields
replaced by hostile values, deleted or mangled, raw bytes that are not JSON
or that a lenient parser takes (``NaN``, ``1e999``, nesting thousands deep),
and wrong keys. A bounded number of examples runs here; ``bench/fuzz.py``
runs the long campaign.

Breaks tried, and the tests that catch them:
- ``json.loads`` as it is (NaN, Infinity and 1e999 taken): test_raw_bodies_get_a_400;
- ``strict=False`` in the request models ("3" read as a count, 2.0 as an
  integer): test_a_string_is_not_read_as_a_number;
- top_k left unbounded (the engine thread's ``std::bad_cast`` failed the
  whole batch): the fuzzer (a 5xx) and test_serve.py's BAD cases;
- ``submit`` back inside the stream generators (a 200, then a dropped
  connection): test_a_full_queue_refuses_a_stream_before_it_starts;
- ``asyncio.to_thread(events.get)`` for waiting requests:
  test_waiting_requests_hold_no_thread (the parse of a new request starves);
- ``Engine.stats`` reading the prompt cache on the caller's thread:
  test_engine_state_is_read_on_the_engine_thread_only;
- empty keys taken: test_an_empty_key_lets_nobody_in;
- ``Conversations`` and ``Grammars`` without their locks: the two
  ``shared_safely`` tests (a KeyError from an entry evicted by another thread);
- the engine's "dead_end" passed through as a finish reason:
  test_a_grammar_dead_end_finishes_as_each_api_defines.
"""

import http.client
import json
import threading
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from dspark_fn.serve.access import KEY_VARIABLE, read_keys  # noqa: E402
from dspark_fn.serve.app import create_app  # noqa: E402
from dspark_fn.serve.engine import Engine, QueueFull, Update  # noqa: E402
from dspark_fn.serve.images import ImageSources  # noqa: E402
import fuzzing  # noqa: E402
from fuzzing import VALID, bodies, check_answer, is_error_shaped, raw_bodies, sweep  # noqa: E402
from helpers import running  # noqa: E402
from test_serve_images import release  # noqa: E402,F401  the tiny multimodal pair
from test_serve_tools import ScriptedEngine  # noqa: E402

KEY = "boundary-key"
ENDPOINTS = sorted(VALID)
WAIT = 60  # seconds any one answer may take: past it, a hang
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def send(base: str, path: str, raw: bytes, headers: dict | None = None, method: str = "POST") -> tuple:
    return fuzzing.send(base, path, raw, KEY, headers, method, WAIT)


def greedy(base: str) -> str:
    status, _, raw = send(base, "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "what is here?"}], "max_tokens": 8, "temperature": 0}).encode())
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def served(release, tmp_path_factory):
    """A multimodal target behind a key, image files and URLs allowed: ``(engine, base url, first greedy answer)``."""
    images = tmp_path_factory.mktemp("images")
    engine = Engine(release.params, max_batch=2, max_context=256, width=None)
    sources = ImageSources(files=images, urls=True)
    try:
        with running(create_app(engine, release.tokenizer, "m", api_keys=(KEY,), image_sources=sources)) as base:
            yield engine, base, greedy(base)
    finally:
        engine.close()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzzed_bodies_get_no_5xx_and_errors_in_the_api_shape(served, endpoint):
    engine, base, _ = served

    @FUZZ
    @given(bodies(endpoint))
    def answered(body):
        started = time.monotonic()
        status, headers, raw = send(base, endpoint, json.dumps(body).encode())
        assert check_answer(endpoint, status, headers, raw) is None, (body, check_answer(endpoint, status, headers, raw))
        assert time.monotonic() - started < WAIT

    answered()
    assert send(base, "/health", b"", method="GET")[0] == 200


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_each_field_at_its_edges_gets_no_5xx(served, endpoint):
    _, base, _ = served
    for body in sweep(endpoint):
        status, headers, raw = send(base, endpoint, json.dumps(body).encode())
        assert check_answer(endpoint, status, headers, raw) is None, (body, raw[:300])


def test_raw_bodies_get_a_400(served):
    _, base, _ = served

    @FUZZ
    @given(st.sampled_from(ENDPOINTS), raw_bodies)
    def refused(endpoint, raw):
        status, headers, answer = send(base, endpoint, raw)
        assert 400 <= status < 500 and check_answer(endpoint, status, headers, answer) is None, (raw[:80], answer)

    refused()


def test_wrong_keys_get_a_401(served):
    _, base, _ = served

    @FUZZ
    @given(st.sampled_from(ENDPOINTS), st.one_of(st.just(""), st.just(" "), st.text(max_size=20).filter(
        lambda key: key.strip() != KEY and key.isprintable() and key.isascii())),
        st.sampled_from(["authorization", "x-api-key"]))
    def refused(endpoint, key, header):
        value = f"Bearer {key}" if header == "authorization" else key
        status, headers, raw = send(base, endpoint, json.dumps(VALID[endpoint]).encode(),
                                    {"authorization": "", header: value})
        assert status == 401 and check_answer(endpoint, status, headers, raw) is None

    refused()


def test_a_valid_request_answers_as_before_the_fuzzing(served):
    _, base, before = served
    assert greedy(base) == before


def test_the_openapi_schema_declares_each_endpoint_body(served):
    _, base, _ = served
    status, _, raw = send(base, "/openapi.json", b"", method="GET")
    document = json.loads(raw)
    assert status == 200
    for path in ENDPOINTS:
        reference = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        declared = document["components"]["schemas"][reference.rsplit("/", 1)[1]]
        assert declared["type"] == "object" and declared["properties"]


def test_a_string_is_not_read_as_a_number(served):
    _, base, _ = served
    for field, value in (("max_tokens", "3"), ("max_tokens", 3.0), ("temperature", "0"), ("stream", "true")):
        body = dict(VALID["/v1/chat/completions"], **{field: value})
        status, _, raw = send(base, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and f"'{field}'" in json.loads(raw)["error"]["message"]


# ---- admission: refused before a response starts


class FullEngine(ScriptedEngine):
    """An engine whose queue is full, or that is shutting down."""

    refusal = QueueFull(64, 1)

    def submit(self, request):
        raise self.refusal


@pytest.fixture(scope="module")
def tokenizer():
    from dspark_fn.catalog import load_target_named

    return load_target_named(None)[2]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("refusal, status", [(QueueFull(64, 1), 429),
                                             (RuntimeError("the engine is shutting down"), 503)])
def test_a_full_queue_refuses_a_stream_before_it_starts(tokenizer, endpoint, refusal, status):
    engine = FullEngine(tokenizer)
    engine.refusal = refusal
    with running(create_app(engine, tokenizer, "m")) as base:
        answer, headers, raw = send(base, endpoint, json.dumps(dict(VALID[endpoint], stream=True)).encode())
    assert answer == status and is_error_shaped(endpoint, json.loads(raw))
    assert status == 503 or headers["retry-after"] == "1"


def test_overload_is_refused_before_streams_start_and_health_answers_throughout(served, monkeypatch):
    engine, base, before = served
    monkeypatch.setattr(engine, "max_queue", 1)
    answers, health, done = [], [], threading.Event()

    def client(endpoint: str):
        answers.append((endpoint, *send(base, endpoint, json.dumps(dict(VALID[endpoint], stream=True,
                                                                         max_tokens=12)).encode())))

    def watch():
        while not done.is_set():
            health.append(send(base, "/health", b"", method="GET")[0])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=client, args=(ENDPOINTS[i % len(ENDPOINTS)],)) for i in range(16)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(WAIT)
    done.set()
    watcher.join(WAIT)
    statuses = sorted(status for _, status, _, _ in answers)
    assert len(answers) == 16 and set(statuses) == {200, 429}, statuses
    for endpoint, status, headers, raw in answers:
        if status == 429:
            assert headers["retry-after"] == "1" and is_error_shaped(endpoint, json.loads(raw))
        else:
            assert check_answer(endpoint, status, headers, raw) is None
    assert health and set(health) == {200}
    assert greedy(base) == before


class DeadEndEngine(ScriptedEngine):
    """Every reply ends where its grammar admits no token."""

    def submit(self, request):
        request.events.put(Update("tokens", self.tokenizer.encode("{", add_special_tokens=False)))
        request.events.put(Update("done", "dead_end"))
        return request


def test_a_grammar_dead_end_finishes_as_each_api_defines(tokenizer):
    with running(create_app(DeadEndEngine(tokenizer), tokenizer, "m")) as base:
        _, _, raw = send(base, "/v1/chat/completions", json.dumps(VALID["/v1/chat/completions"]).encode())
        choice = json.loads(raw)["choices"][0]
        assert (choice["finish_reason"], choice["finish_detail"]) == ("stop", "dead_end")
        _, _, raw = send(base, "/v1/chat/completions", json.dumps(dict(VALID["/v1/chat/completions"],
                                                                        stream=True)).encode())
        chunks = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
        assert (last["finish_reason"], last["finish_detail"]) == ("stop", "dead_end")
        _, _, raw = send(base, "/v1/messages", json.dumps(VALID["/v1/messages"]).encode())
        message = json.loads(raw)
        assert (message["stop_reason"], message["stop_detail"]) == ("end_turn", "dead_end")


class SilentEngine(ScriptedEngine):
    """An engine that takes every request and never answers (a long queue)."""

    def submit(self, request):
        self.prompts.append(request)
        return request


def test_waiting_requests_hold_no_thread(tokenizer):
    """More requests wait than the event loop has worker threads, and a new
    request is still read and answered at once."""
    engine = SilentEngine(tokenizer)
    with running(create_app(engine, tokenizer, "m")) as base:
        host, port = base.removeprefix("http://").split(":")
        waiting = []
        for _ in range(40):
            connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
            connection.request("POST", "/v1/completions", body=json.dumps(VALID["/v1/completions"]).encode(),
                               headers={"content-type": "application/json"})
            waiting.append(connection)
        deadline = time.monotonic() + WAIT
        while len(engine.prompts) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(engine.prompts) == 40
        started = time.monotonic()
        status, _, raw = send(base, "/v1/completions", b'{"prompt": 5}', {"authorization": ""})
        assert status == 400 and time.monotonic() - started < 5
        for request in engine.prompts:
            request.events.put(Update("done", "stop"))
        assert all(connection.getresponse().status == 200 for connection in waiting)


# ---- engine state: owned by its thread


class Watched:
    """Forwards to ``inner``, noting the threads that read it."""

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "threads", set())

    def __getattr__(self, name):
        self.threads.add(threading.get_ident())
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        self.threads.add(threading.get_ident())
        setattr(self.inner, name, value)

    def __len__(self):
        self.threads.add(threading.get_ident())
        return len(self.inner)


def test_engine_state_is_read_on_the_engine_thread_only(served):
    engine, base, _ = served
    watched = Watched(engine.prompt_cache)
    engine.prompt_cache = watched
    try:
        stats = [engine.stats() for _ in range(3)]
        greedy(base)
        stats.append(engine.stats())
    finally:
        engine.prompt_cache = watched.inner
    assert threading.get_ident() not in watched.threads
    assert stats[-1]["prompt_cache"]["entries"] >= 1


# ---- stores shared by the threads that read requests


def hammered(work, threads: int = 8) -> list:
    """Run ``work(k)`` on ``threads`` threads switching as often as the
    interpreter allows; the exceptions they met."""
    import sys

    errors, interval = [], sys.getswitchinterval()

    def run(k):
        try:
            work(k)
        except Exception as error:  # a race: collected, the test names it
            errors.append(error)

    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(WAIT)
    finally:
        sys.setswitchinterval(interval)
    return errors


def test_held_conversations_are_shared_safely():
    from dspark_fn.serve.errors import ApiError
    from dspark_fn.serve.responses import Conversations

    held = Conversations(held=4)

    def work(k):
        for i in range(20_000):
            ident = f"resp_{(7 * i + k) % 6}"
            held.keep(ident, [i])
            try:
                held.before(ident)
            except ApiError:  # evicted by another thread: a 404 the client can act on
                pass

    assert hammered(work) == []


def test_compiled_grammars_are_shared_safely(tokenizer, monkeypatch):
    from dspark_fn.serve import structured

    monkeypatch.setattr(structured, "HELD_GRAMMARS", 4)
    monkeypatch.setattr(structured, "Vocabulary", lambda *args, **kwargs: None)
    monkeypatch.setattr(structured, "compile_constraint", lambda constraint, vocabulary, limits: ("compiled",
                                                                                                    constraint))
    grammars = structured.Grammars(tokenizer, 10, [0])

    def work(k):
        for i in range(20_000):
            constraint = f"schema {(7 * i + k) % 6}"
            assert grammars.compile(constraint) == ("compiled", constraint)

    assert hammered(work) == []


# ---- keys


def test_an_empty_key_lets_nobody_in(tokenizer, monkeypatch, tmp_path, capsys):
    from dspark_fn import cli

    for given in ([""], ["  "], [" key"]):
        with pytest.raises(ValueError, match="API key"):
            read_keys(given, None)
    monkeypatch.setenv(KEY_VARIABLE, "")
    with pytest.raises(ValueError, match=KEY_VARIABLE):
        read_keys([], None)
    monkeypatch.delenv(KEY_VARIABLE)
    (tmp_path / "keys").write_text("# no keys here\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        read_keys([], str(tmp_path / "keys"))
    with pytest.raises(ValueError, match="empty API key"):
        create_app(ScriptedEngine(tokenizer), tokenizer, "m", api_keys=("",))
    assert cli.main(["serve", "--api-key", "", "--model", "/nonexistent"]) == 2
    assert "empty API key" in capsys.readouterr().err


# ---- metrics


def scrape(base: str) -> dict:
    """``/metrics`` read by prometheus_client's own parser: ``{(name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, raw = send(base, "/metrics", b"", method="GET")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(raw.decode()) for sample in family.samples}


def test_metrics_parse_and_move_with_traffic(served):
    _, base, _ = served
    before = scrape(base)
    greedy(base)
    send(base, "/v1/chat/completions", b'{"messages": 5}')
    after = scrape(base)

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("dspark_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert moved("dspark_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert moved("dspark_time_to_first_token_seconds_count") == 1
    assert moved("dspark_prompt_tokens_total") > 0 and moved("dspark_generation_tokens_total") >= 1
    sources = {dict(labels)["source"] for name, labels in after if name == "dspark_rounds_total"}
    assert sources and sum(moved("dspark_rounds_total", source=s) for s in sources) >= 1
    assert ("dspark_queue_depth", ()) in after and ("dspark_busy_rows", ()) in after
    assert after[("dspark_kernels_compiled_total", ())] >= 1
