"""The HTTP surface as clients see it, in front of a scripted engine (the
replies are chosen by the test): completions text that continues its
prompt, the model routes, errors in each API's shape, the system
fingerprint, API keys, the body-size bound, and the Anthropic Messages API
through the ``anthropic`` client (whole, streamed, a tool round trip, stop
sequences, errors). ``test_serve.py`` runs the same routes on the real engine.

Breaks tried, and what caught them:
- completions decoded by mlx-lm's streaming detokenizer (as chat is): the
  leading space test;
- ``key_matches`` answering True for any key / ``given_key`` reading only
  the Bearer header: the key tests (a wrong key passes / x-api-key fails);
- the door reading only ``Content-Length``: the chunked 413 test;
- the exception handler removed: the 404/405 shape tests (FastAPI's
  ``{"detail": ...}``);
- Anthropic's ``input_tokens`` counting the cached prompt tokens too: the
  usage test;
- a text block left open when a ``tool_use`` block starts: the typed
  events test;
- streamed calls numbered per delivery, not per reply (no ``made`` count):
  test_a_second_streamed_call_gets_the_next_index (both get index 0).
"""

import http.client
import json
import time

import pytest

from dspark_fn.serve.app import create_app, system_fingerprint
from dspark_fn.serve.engine import Update
from helpers import running
from test_serve_tools import CALL, WEATHER, ScriptedEngine

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEYS = ("first-key", "second-key")
FINGERPRINT = system_fingerprint("m", "d")
MAX_BODY = 4096


class CachingEngine(ScriptedEngine):
    """A scripted engine that says the prompt cache served ``cached`` tokens."""

    cached = 0

    def submit(self, request):
        request.cached_tokens = min(self.cached, len(request.prompt))
        return super().submit(request)


@pytest.fixture(scope="module")
def tokenizer():
    from dspark_fn.catalog import load_target_named

    return load_target_named(None)[2]


@pytest.fixture(scope="module")
def served(tokenizer):
    """``(engine, base url, start time)`` of an app without keys."""
    engine, started = CachingEngine(tokenizer), int(time.time())
    with running(create_app(engine, tokenizer, "m", fingerprint=FINGERPRINT, max_body_bytes=MAX_BODY)) as base:
        yield engine, base, started


@pytest.fixture(scope="module")
def guarded(tokenizer):
    """``(engine, base url)`` of an app that asks for one of ``KEYS``."""
    engine = ScriptedEngine(tokenizer)
    with running(create_app(engine, tokenizer, "m", api_keys=KEYS)) as base:
        yield engine, base


def call(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         chunked: bool = False) -> tuple[int, dict, dict]:
    """``(status, JSON body, headers)`` of one raw request."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request(method, path, body=iter([body]) if chunked else body,
                       headers={"content-type": "application/json", **(headers or {})},
                       encode_chunked=chunked)
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, json.loads(payload), dict(response.getheaders())


def openai_client(base: str, key: str = "unused"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


def anthropic_client(base: str, key: str = "unused"):
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def is_anthropic_error(body: dict, kind: str) -> bool:
    return body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


# ---- OpenAI details


def test_a_completion_keeps_its_leading_space(served, tokenizer):
    """The reply's first token is " 6" (a space token, then "6"): the text
    starts with the space, whole and streamed, so prompt + text is the
    decoded sequence."""
    engine, base, _ = served
    client = openai_client(base)
    prompt = "What is 6 * 7?"
    engine.reply(" 6 * 7 = 42")
    text = client.completions.create(model="m", prompt=prompt, max_tokens=16).choices[0].text
    assert text == " 6 * 7 = 42"
    reply = tokenizer.encode(" 6 * 7 = 42", add_special_tokens=False)
    assert prompt + text == tokenizer.decode(tokenizer.encode(prompt) + reply)
    engine.reply(" 6 * 7 = 42")
    chunks = client.completions.create(model="m", prompt=prompt, max_tokens=16, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks) == " 6 * 7 = 42"


def test_models_listed_and_retrieved_with_their_load_time(served):
    _, base, started = served
    client = openai_client(base)
    (listed,) = client.models.list().data
    retrieved = client.models.retrieve("m")
    assert listed.id == retrieved.id == "m" and started <= retrieved.created <= time.time()
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        client.models.retrieve("gpt-4")
    status, body, _ = call(base, "GET", "/v1/models/gpt-4")
    assert status == 404 and is_openai_error(body) and body["error"]["code"] == "model_not_found"


def test_unknown_routes_and_methods_answer_in_the_apis_shape(served):
    _, base, _ = served
    status, body, _ = call(base, "GET", "/v1/nothing")
    assert status == 404 and is_openai_error(body) and "no route GET /v1/nothing" in body["error"]["message"]
    status, body, headers = call(base, "GET", "/v1/chat/completions")
    assert status == 405 and is_openai_error(body) and headers["allow"] == "POST"
    status, body, _ = call(base, "GET", "/v1/messages")
    assert status == 405 and is_anthropic_error(body, "invalid_request_error")


def test_every_reply_names_the_system_that_made_it(served):
    engine, base, _ = served
    client = openai_client(base)
    assert all(part in FINGERPRINT for part in ("dspark_fn", "target m", "draft d"))
    engine.reply("hi")
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]).system_fingerprint \
        == FINGERPRINT
    engine.reply("hi")
    chunks = list(client.completions.create(model="m", prompt="x", stream=True))
    assert chunks and all(chunk.system_fingerprint == FINGERPRINT for chunk in chunks)


def test_a_second_streamed_call_gets_the_next_index(served):
    """Two calls in one reply, completed in different deliveries: indices 0
    and 1, so a client keeps their arguments apart."""
    engine, base, _ = served
    second = CALL.replace("get_weather", "get_time").replace('"Paris", "days": 2', '"Rome"')
    engine.reply(CALL + second)
    chunks = list(openai_client(base).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER], stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris", "days": 2}), (1, "get_time", {"city": "Rome"})]
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls]) == 2


# ---- the door: keys and sizes


ROUTES = [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
          ("POST", "/v1/completions", {"prompt": "x"}), ("POST", "/v1/responses", {"input": "x"}),
          ("POST", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
          ("GET", "/v1/models", None), ("GET", "/v1/models/m", None)]


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_every_route_asks_for_a_key(guarded, method, path, body):
    engine, base = guarded
    data = json.dumps(body).encode() if body else None
    shape = (lambda b: is_anthropic_error(b, "authentication_error")) if path == "/v1/messages" else is_openai_error
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "first-ke"}):
        status, reply, _ = call(base, method, path, data, headers)
        assert status == 401 and shape(reply) and "API key" in json.dumps(reply)
    for headers in ({"authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": KEYS[1]}):
        if body:
            engine.reply("ok")
        status, _, _ = call(base, method, path, data, headers)
        assert status == 200


def test_the_clients_send_their_keys_and_health_is_open(guarded):
    engine, base = guarded
    assert call(base, "GET", "/health")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai_client(base, "nope").models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(base, "nope").messages.create(model="m", max_tokens=4,
                                                       messages=[{"role": "user", "content": "x"}])
    assert openai_client(base, KEYS[0]).models.list().data[0].id == "m"
    engine.reply("fine")
    reply = anthropic_client(base, KEYS[1]).messages.create(model="m", max_tokens=4,
                                                            messages=[{"role": "user", "content": "x"}])
    assert reply.content[0].text == "fine"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_is_refused_before_it_is_read(served, chunked):
    _, base, _ = served
    body = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    status, reply, _ = call(base, "POST", "/v1/completions", body, chunked=chunked)
    assert status == 413 and is_openai_error(reply) and "--max-body-mb" in reply["error"]["message"]
    status, reply, _ = call(base, "POST", "/v1/messages", body, chunked=chunked)
    assert status == 413 and is_anthropic_error(reply, "request_too_large")
    status, _, _ = call(base, "GET", "/health")
    assert status == 200


def test_a_public_address_without_a_key_is_refused(capsys):
    """Before anything is loaded: the message names the flags."""
    from dspark_fn import cli

    assert cli.main(["serve", "--host", "0.0.0.0", "--model", "/nonexistent"]) == 2  # a usage error
    message = capsys.readouterr().err
    assert "--api-key" in message and "--no-api-key" in message and "0.0.0.0" in message


# ---- the Anthropic Messages API


def test_a_message_whole_with_usage_from_the_prompt_cache(served):
    engine, base, _ = served
    engine.reply("Paris is the capital.")
    engine.cached = 5
    try:
        reply = anthropic_client(base).messages.create(
            model="m", max_tokens=32, system="Be brief.", messages=[{"role": "user", "content": "Capital of France?"}])
    finally:
        engine.cached = 0
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == "Paris is the capital."
    assert reply.stop_reason == "end_turn" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert "Be brief." in engine.prompts[-1] and "Capital of France?" in engine.prompts[-1]
    prompt_tokens = len(engine.tokenizer.encode(engine.prompts[-1], add_special_tokens=False))
    assert reply.usage.cache_read_input_tokens == 5
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt_tokens
    assert reply.usage.output_tokens == len(engine.tokenizer.encode("Paris is the capital.", add_special_tokens=False))


def test_a_message_streamed_as_typed_events(served):
    engine, base, _ = served
    engine.reply("Looking it up. " + CALL)
    tools = [{"name": "get_weather", "description": "the forecast", "input_schema": {"type": "object"}}]
    with anthropic_client(base).messages.stream(model="m", max_tokens=64, tools=tools,
                                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type + (f":{event.delta.type}" if event.type == "content_block_delta" else "")
             for event in events if event.type not in ("text", "input_json")]
    runs = [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]  # repeated deltas as one
    assert runs == ["message_start", "content_block_start", "content_block_delta:text_delta", "content_block_stop",
                    "content_block_start", "content_block_delta:input_json_delta", "content_block_stop",
                    "message_delta", "message_stop"]
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Looking it up. " and final.content[1].input == {"city": "Paris", "days": 2}
    assert final.stop_reason == "tool_use"


def test_a_tool_round_trip(served):
    engine, base, _ = served
    client = anthropic_client(base)
    tools = [{"name": "get_weather", "description": "the forecast for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    engine.reply(CALL)
    first = client.messages.create(model="m", max_tokens=64, tools=tools,
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and first.stop_reason == "tool_use"
    assert "the forecast for a city" in engine.prompts[-1]
    engine.reply("It is sunny.")
    second = client.messages.create(model="m", max_tokens=64, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}])
    assert second.content[0].text == "It is sunny." and second.stop_reason == "end_turn"
    assert "sunny, 21 C" in engine.prompts[-1] and '"Paris"' in engine.prompts[-1]


def test_a_stop_sequence_ends_the_message(served):
    engine, base, _ = served
    engine.reply("one two STOP three")
    reply = anthropic_client(base).messages.create(model="m", max_tokens=32, stop_sequences=["STOP"],
                                                   messages=[{"role": "user", "content": "count"}])
    assert reply.content[0].text == "one two " and reply.stop_reason == "stop_sequence"
    assert reply.stop_sequence == "STOP"


@pytest.mark.parametrize("body, error, message", [
    ({"messages": [{"role": "user", "content": "x"}]}, "BadRequestError", "'max_tokens' is required"),
    ({"max_tokens": 4, "messages": []}, "BadRequestError", "'messages' must hold at least 1 item"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "BadRequestError", "'messages.0.content.0.source.type' is required"),
    ({"max_tokens": 4, "model": "claude", "messages": [{"role": "user", "content": "x"}]}, "NotFoundError",
     "'claude' is not served here"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                   "name": "web_search"}]},
     "BadRequestError", "server tools"),
])
def test_bad_messages_get_anthropic_errors(served, body, error, message):
    _, base, _ = served
    status, reply, _ = call(base, "POST", "/v1/messages", json.dumps({"model": "m", **body}).encode())
    assert is_anthropic_error(reply, "not_found_error" if status == 404 else "invalid_request_error")
    assert message in reply["error"]["message"]
    if "max_tokens" in body:  # the client itself refuses to send a body without it
        with pytest.raises(getattr(anthropic, error), match=message):
            anthropic_client(base).messages.create(**{"model": "m", **body})


def test_a_failed_engine_ends_a_streamed_message_with_an_error_event(served):
    engine, base, _ = served
    engine.replies.put(None)  # the next request fails
    original = engine.submit

    def failing(request):
        engine.replies.get_nowait()
        request.events.put(Update("error", "RuntimeError: injected"))
        return request

    engine.submit = failing
    try:
        with pytest.raises(anthropic.APIStatusError, match="injected"):
            with anthropic_client(base).messages.stream(model="m", max_tokens=8,
                                                        messages=[{"role": "user", "content": "x"}]) as stream:
                list(stream)
    finally:
        engine.submit = original
