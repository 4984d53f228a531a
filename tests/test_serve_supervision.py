"""A supervised engine: a failure inside the decoding thread fails the requests
in its batch with a 500 (streams: an error event, then ``[DONE]``), /health
answers 503 until the engine runs again, and the engine starts again with an
empty batch; one that cannot start again ends every request and the server
exits with 1. The app runs in this process (uvicorn in a thread) so that a
test can inject the fault: it replaces the decoder's ``step``. Every HTTP
call and wait here has its own timeout, and tests/conftest.py fails a
``server`` test that hangs: the last test checks that limit.

Breaks tried, and the tests that catch them:
- the engine not starting again after a failure (``while self._decode() and
  False``): test_a_failed_round_fails_its_request_and_the_engine_starts_again
  (/health never ok again);
- no ``("error", ...)`` event for the batch's requests: the same test (its
  request times out; the thread left waiting on it then held the
  interpreter's exit, and conftest's exit limit ended the run, exit 1);
- a request put in ``rows`` only after its prefill (as before: a failing
  prefill lost it): test_a_failed_prefill_fails_its_request (it times out);
- /health answering ok during the failure:
  test_a_failed_round_fails_its_request_and_the_engine_starts_again;
- ``EngineFailure`` answered as other runtime errors (503): the same test;
- ``Server.on_tick`` without the engine's ``dead``:
  test_an_engine_that_cannot_start_again_stops_the_server (``serve`` never returns);
- the dead engine ending queued requests as cancelled, not with the error: the same test;
- conftest's limit not armed: test_a_hanging_server_test_fails_and_the_run_goes_on;
- conftest's exit limit not armed (``pytest_unconfigure`` doing nothing): the
  same test (the run it starts never exits).
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest

import dspark_fn
from dspark_fn.checkpoints import load_tokenizer
from dspark_fn.sampling import Sampling
from dspark_fn.serve.app import Server, create_app, serve
from dspark_fn.serve.engine import Engine, Request
from helpers import free_port
from published import qwen3_pair
from test_serve import continued, post, reference_tokens

uvicorn = pytest.importorskip("uvicorn")

WAIT = 60  # seconds: the most any wait here takes before it fails
PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A tiny Qwen3 pair with a tokenizer, loaded here: ``(params, tokenizer)``."""
    root = tmp_path_factory.mktemp("supervision")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    params = dspark_fn.catalog.load_named(str(root / "target"), str(root / "draft"), dtype=mx.float32)[0]
    return params, load_tokenizer(root / "target")


def new_engine(params) -> Engine:
    return Engine(params, max_batch=2, max_context=512, width=4)  # a fixed width: no cost measurement


def health(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + "/health", timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def reachable(base: str) -> bool:
    try:
        return health(base)[0] == 200
    except OSError:
        return False


def until(condition, what: str):
    deadline = time.monotonic() + WAIT
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {WAIT} s")
        time.sleep(0.05)
    return value


def completion(base: str, stream: bool = False) -> tuple[int, dict | list]:
    """A greedy text completion of ``PROMPT``: (status, body), a stream's body as its list of events."""
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": stream}
    if not stream:
        return post(base + "/v1/completions", json.dumps(body).encode())
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=WAIT) as response:
        events = [line[len("data: "):] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        return response.status, [event if event == "[DONE]" else json.loads(event) for event in events]


@contextmanager
def served(engine: Engine, tokenizer):
    """``engine`` behind the app on a free port, in this process: the base url."""
    port = free_port()
    server = Server(uvicorn.Config(create_app(engine, tokenizer, "tiny"), host="127.0.0.1", port=port,
                                   log_level="warning"), engine)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(lambda: server.started, "server start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(WAIT)


def failing_round(*args, **kwargs):
    raise RuntimeError("injected fault")


def held(start, release: threading.Event, fails: bool = False):
    """``start`` (the engine's ``_start_decoder``) that waits for ``release``
    first, so a test sees the engine between its failure and its restart."""

    def start_held(options):
        release.wait(WAIT)
        if fails:
            raise RuntimeError("no decoder this time")
        start(options)

    return start_held


@pytest.fixture(scope="module")
def server(library):
    """An engine serving on a free port: ``(engine, base url)``; each test leaves it running."""
    params, tokenizer = library
    engine = new_engine(params)
    with served(engine, tokenizer) as base:
        yield engine, base


def greedy_text(library) -> str:
    return continued(library[1], PROMPT, reference_tokens(library, PROMPT, NEW_TOKENS))


def test_a_failed_round_fails_its_request_and_the_engine_starts_again(server, library, monkeypatch):
    engine, base = server
    release = threading.Event()
    monkeypatch.setattr(engine, "_start_decoder", held(engine._start_decoder, release))
    monkeypatch.setattr(engine.decoder, "step", failing_round)
    try:
        status, body = completion(base)
        assert status == 500
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_failure"
        assert "RuntimeError: injected fault" in body["error"]["message"]
        status, report = health(base)
        assert status == 503 and report["status"] == "restarting" and "injected fault" in report["error"]
    finally:
        release.set()
    status, report = until(lambda: (answer := health(base))[0] == 200 and answer, "engine restart")
    assert report["active"] == 0 and report["batch"] == 1
    status, body = completion(base)
    assert status == 200 and body["choices"][0]["text"] == greedy_text(library)


def test_a_failed_round_ends_a_stream_with_an_error_event(server, library, monkeypatch):
    engine, base = server
    monkeypatch.setattr(engine.decoder, "step", failing_round)
    status, events = completion(base, stream=True)
    assert status == 200  # the stream had started; it still ends as streams end
    error = events[-2]["error"]
    assert error["code"] == "engine_failure" and "RuntimeError: injected fault" in error["message"]
    assert events[-1] == "[DONE]"
    until(lambda: health(base)[0] == 200, "engine restart")
    status, events = completion(base, stream=True)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == greedy_text(library)


def test_a_failed_prefill_fails_its_request(server, library, monkeypatch):
    """A failure while a request is being admitted (its prefill) fails that request too."""
    engine, base = server

    def failing_insert(*args, **kwargs):
        raise RuntimeError("injected prefill fault")

    monkeypatch.setattr(engine.decoder, "insert", failing_insert)
    status, body = completion(base)
    assert status == 500 and "RuntimeError: injected prefill fault" in body["error"]["message"]
    until(lambda: health(base)[0] == 200, "engine restart")
    status, body = completion(base)
    assert status == 200 and body["choices"][0]["text"] == greedy_text(library)


def test_a_request_that_waits_past_the_bound_gets_a_timeout(library, monkeypatch):
    """One row, slow rounds, a 1 s bound on waiting: the request behind the
    running one ends with a 504 (``queue_timeout``, Retry-After) instead of
    waiting on, a stream with that error event; the running one answers;
    /health counts the timeouts."""
    params, tokenizer = library
    engine = Engine(params, max_batch=1, max_context=512, width=4, queue_timeout=1.0)
    step = engine.decoder.step

    def slow_round():
        time.sleep(0.1)
        return step()

    monkeypatch.setattr(engine.decoder, "step", slow_round)
    with served(engine, tokenizer) as base:
        body = {"prompt": PROMPT, "max_tokens": 80, "temperature": 0}
        first = threading.Thread(target=lambda: answers.append(post(base + "/v1/completions",
                                                                    json.dumps(body).encode())))
        answers = []
        first.start()
        until(lambda: health(base)[1]["active"] == 1, "the first request in its row")
        started = time.monotonic()
        status, reply = completion(base)
        assert status == 504 and reply["error"]["code"] == "queue_timeout" and "retry later" in reply["error"]["message"]
        assert 1.0 <= time.monotonic() - started < 30
        status, events = completion(base, stream=True)
        assert events[-2]["error"]["code"] == "queue_timeout" and events[-1] == "[DONE]"
        first.join(WAIT)
        assert answers[0][0] == 200 and answers[0][1]["usage"]["completion_tokens"] == 80
        assert health(base)[1]["queue"]["timed_out"] == 2
    engine.close()


def test_an_engine_that_cannot_start_again_stops_the_server(library, monkeypatch):
    """The request in flight gets its 500, one waiting gets the error too,
    /health says 503 while the engine tries to start, new requests are
    refused at once, and ``serve`` returns 1 (``dspark serve`` exits with it)."""
    params, tokenizer = library
    engine = new_engine(params)
    release = threading.Event()
    monkeypatch.setattr(engine, "_start_decoder", held(engine._start_decoder, release, fails=True))
    monkeypatch.setattr(engine.decoder, "step", failing_round)
    port, exit_status = free_port(), []
    thread = threading.Thread(target=lambda: exit_status.append(serve(engine, tokenizer, "tiny", "127.0.0.1", port)),
                              daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    until(lambda: reachable(base), "server start")
    try:
        status, body = completion(base)
        assert status == 500 and "injected fault" in body["error"]["message"]
        assert health(base)[0] == 503
        waiting = engine.submit(Request(PROMPT, NEW_TOKENS))
    finally:
        release.set()
    kind, message, _ = waiting.events.get(timeout=WAIT)
    assert kind == "error" and "starting again failed with RuntimeError: no decoder this time" in message
    thread.join(WAIT)
    assert exit_status == [1]
    with pytest.raises(RuntimeError, match="the decoding engine stopped after a failure: RuntimeError: injected fault"):
        engine.submit(Request(PROMPT, NEW_TOKENS))


def test_a_hanging_server_test_fails_and_the_run_goes_on(tmp_path):
    """tests/conftest.py's limits, at 2 s: a hanging ``test_serve*`` test fails
    with every thread's stack and its teardown runs; the next test runs; a
    thread it leaves waiting cannot hold the interpreter's exit."""
    (tmp_path / "test_serve_hangs.py").write_text(textwrap.dedent("""
        import threading
        import pytest

        @pytest.fixture
        def resource():
            yield
            print("teardown ran")

        def test_hangs(resource):
            threading.Event().wait()

        def test_leaves_a_thread_waiting():
            threading.Thread(target=threading.Event().wait).start()
    """))
    tests = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "conftest", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(tmp_path), str(tmp_path / "test_serve_hangs.py")],
        capture_output=True, text=True, timeout=WAIT, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tests), DSPARK_SERVER_TEST_SECONDS="2"),
    )
    assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert "still running after 2 s: a hang" in result.stdout
    assert "teardown ran" in result.stdout and "in test_hangs" in result.stderr  # the stack says where it hung
    assert "Timeout (0:00:02)!" in result.stderr and result.returncode == 1  # the exit, ended


def answered(engine: Engine, request: Request, wait: float = WAIT) -> list:
    """The tokens ``engine`` gives ``request`` (each update within ``wait`` seconds)."""
    engine.submit(request)
    tokens = []
    while (update := request.events.get(timeout=wait)).kind == "tokens":
        tokens += update.value
    assert update.kind == "done", update
    return tokens


def test_greedy_requests_keep_the_policys_rates_and_a_sampled_one_alone_starts_afresh(library):
    """One greedy request after another: the policy's measured rates carry
    on (a greedy answer does not depend on them; relearned per request, each
    would pay again for what does not pay). A sampled request alone in the
    batch starts from nothing measured: after greedy traffic its seeded
    samples and measurements are those of a fresh engine."""
    params, _ = library
    sampled = dict(sampling=Sampling(temperature=1.0), seed=3)
    engine, fresh = new_engine(params), new_engine(params)
    try:
        first = answered(engine, Request(PROMPT, NEW_TOKENS))
        once = engine.decoder.cache.policy.pooled.observed.sum()
        assert answered(engine, Request(PROMPT, NEW_TOKENS)) == first
        assert engine.decoder.cache.policy.pooled.observed.sum() == 2 * once > 0  # a fixed width: the same rounds twice
        tokens = answered(engine, Request(PROMPT, NEW_TOKENS, **sampled))
        assert tokens == answered(fresh, Request(PROMPT, NEW_TOKENS, **sampled))
        assert (engine.decoder.cache.policy.pooled.observed == fresh.decoder.cache.policy.pooled.observed).all()
    finally:
        engine.close()
        fresh.close()
