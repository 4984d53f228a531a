"""Request bodies for fuzzing the server, as hypothesis strategies: for each
endpoint a valid body with some fields replaced by hostile values (wrong
types, huge or negative numbers, deep nesting, long strings, hostile image
URLs), fields deleted, or nested parts mangled; raw bodies that are not
JSON or that a lenient parser would take (``NaN``, ``1e999``, nesting
thousands deep); and keys that are wrong or empty. ``check_answer`` says
whether one answer is acceptable: never a 5xx, every 4xx an error in the
endpoint's API shape, every 200 a whole reply of the API, a stream's every
event in its shape, none an error, its last the one that ends it."""

import http.client
import json

from hypothesis import strategies as st

HOSTILE_URLS = ["file:///dev/zero", "file:///proc/self/environ", "file:///etc/passwd", "http://169.254.169.254/",
                "http://127.0.0.1:1/x.png", "http://[::1]/x.png", "ftp://example.com/x.png", "data:,nothing",
                "data:image/png;base64,!!!", "data:image/png;base64," + "A" * 64, ""]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70), st.sampled_from([0, -1, 1, 2, 20, 21, 300, 1 << 31, 1 << 63]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.5, -0.0, 1e300, -1e300, 2.5, 1e-300]),
    st.text(max_size=24), st.sampled_from(["", " ", "auto", "none", "required", "json_schema", "function", "user",
                                           "assistant", "text", "image_url", "tool_use", "\x00", "\ud7ff" * 4]),
    st.sampled_from(HOSTILE_URLS),
)
# numbers at the edges of what fields take: ranges, int32 and int64, float precision
edges = st.sampled_from([-1, 0, 1, 2, 8, 9, 20, 21, 255, 256, 257, 4096, 10 ** 10, (1 << 31) - 1, 1 << 31, 1 << 32,
                         (1 << 53) + 1, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63) - 1, 0.0, 0.5, -0.5, 1.0, 2.0,
                         2.0000001, 1e10, 1e300, 5e-324])
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)

USER = {"role": "user", "content": "hi"}
VALID = {
    "/v1/chat/completions": {"messages": [USER], "max_tokens": 3, "temperature": 0},
    "/v1/completions": {"prompt": "hello", "max_tokens": 3, "temperature": 0},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3, "temperature": 0},
    "/v1/messages": {"messages": [USER], "max_tokens": 3, "temperature": 0},
}
FIELDS = {
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
                             "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "tools",
                             "tool_choice", "parallel_tool_calls", "response_format", "logit_bias",
                             "frequency_penalty", "presence_penalty", "model", "user"],
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
                        "stream_options", "echo", "logprobs", "suffix", "best_of", "response_format", "logit_bias",
                        "model"],
    "/v1/responses": ["input", "instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p",
                      "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "model"],
    "/v1/messages": ["messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                     "tools", "tool_choice", "metadata", "model"],
}


def image_part(endpoint: str, url) -> dict:
    if endpoint == "/v1/responses":
        return {"type": "input_image", "image_url": url}
    if endpoint == "/v1/messages":
        return {"type": "image", "source": {"type": "url", "url": url}}
    return {"type": "image_url", "image_url": {"url": url}}


@st.composite
def mangled_messages(draw, endpoint: str):
    """A conversation whose parts are of the wrong kind or carry hostile values."""
    part = draw(st.one_of(
        st.builds(lambda v: {"type": "text", "text": v}, values),
        st.builds(lambda url: image_part(endpoint, url), st.one_of(st.sampled_from(HOSTILE_URLS), values)),
        st.dictionaries(st.sampled_from(["type", "text", "image_url", "id", "name", "input", "content", "tool_use_id"]),
                        values, max_size=4),
        values,
    ))
    role = draw(st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), values))
    message = {"role": role, "content": draw(st.one_of(st.just([part]), st.just([part] * 3), values))}
    if draw(st.booleans()):
        message["tool_calls"] = draw(st.one_of(values, st.just([{"id": "c", "type": "function", "function": {
            "name": draw(values), "arguments": draw(values)}}])))
    key = "input" if endpoint == "/v1/responses" else "prompt" if endpoint == "/v1/completions" else "messages"
    return key, draw(st.lists(st.just(message), min_size=0, max_size=3))


@st.composite
def bodies(draw, endpoint: str) -> dict:
    """A valid body of ``endpoint`` with a few fields replaced, deleted or mangled."""
    body = json.loads(json.dumps(VALID[endpoint])) | {"temperature": draw(st.sampled_from([0, 0.7]))}
    for name in draw(st.lists(st.sampled_from(FIELDS[endpoint]), max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(st.one_of(edges, values))
    if draw(st.integers(0, 3)) == 0:
        key, messages = draw(mangled_messages(endpoint))
        body[key] = messages
    return body


SWEPT = [None, True, -1, 0, 1 << 31, (1 << 63) - 1, 0.5, 1e300, "", "x", [], [None], {}, {"": None}]


def sweep(endpoint: str):
    """Every declared field of ``endpoint`` set to each value of ``SWEPT`` in
    a valid sampled body, and so are a message's role and a content part's
    fields: each field's edges, met once each."""
    valid = VALID[endpoint] | {"temperature": 0.7}
    for name in FIELDS[endpoint]:
        for value in SWEPT:
            yield valid | {name: value}
    key = "input" if endpoint == "/v1/responses" else "prompt" if endpoint == "/v1/completions" else "messages"
    part = {"type": "text", "text": "hi"}
    for value in SWEPT:
        for mangled in ({"role": value, "content": "hi"}, {"role": "user", "content": value},
                        {"role": "user", "content": [part | {"type": value}]},
                        {"role": "user", "content": [part | {"text": value}]}):
            yield valid | {key: [mangled]}


# valid on every endpoint but for one number a lenient parser takes, in a free-form field
LENIENT = b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", "max_tokens": 1, ' \
    b'"metadata": {"x": %s}}'
raw_bodies = st.one_of(
    st.sampled_from([LENIENT % number for number in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999")]),
    st.sampled_from([b"", b"{", b"null", b"[]", b"\"text\"", b"42", b'{"max_tokens": NaN}', b'{"temperature": Infinity}',
                     b'{"max_tokens": 1e999, "messages": []}', b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" +
                     b"}" * 3000, b"\xff\xfe", b'{"messages": "\xc3\x28"}']),
    st.binary(max_size=64),
)


def is_error_shaped(endpoint: str, body) -> bool:
    """An error in the API's own shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if not isinstance(body, dict):
        return False
    if endpoint.startswith("/v1/messages"):
        error = body.get("error")
        return body.get("type") == "error" and isinstance(error, dict) and isinstance(error.get("message"), str) \
            and isinstance(error.get("type"), str)
    error = body.get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


OPENAI_CHUNKS = {"/v1/chat/completions": "chat.completion.chunk", "/v1/completions": "text_completion"}
WHOLE_OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
                 "/v1/responses": "response", "/v1/messages": "message"}
MESSAGES_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                   "message_delta", "message_stop", "ping")


def events(text: str) -> list[tuple[str | None, str]]:
    """A stream's server-sent events as ``(event name or None, data)``."""
    found = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        found.append((name, "\n".join(data)))
    return found


def check_event(endpoint: str, name: str | None, data: str) -> str | None:
    """What is wrong with one event of a stream of ``endpoint`` (an error event is: once a stream has
    begun, every request a fuzzer sends has been accepted, and a failure there is the server's)."""
    if endpoint in OPENAI_CHUNKS and data == "[DONE]":
        return None
    try:
        body = json.loads(data)
    except ValueError:
        return f"an event whose data is not JSON: {data[:200]!r}"
    if not isinstance(body, dict) or "error" in body or name in ("error", "response.failed"):
        return f"an error inside a stream: {data[:300]!r}"
    if endpoint in OPENAI_CHUNKS:
        return None if body.get("object") == OPENAI_CHUNKS[endpoint] and isinstance(body.get("choices"), list) \
            else f"a chunk not in the API's shape: {data[:200]!r}"
    if endpoint == "/v1/messages":
        return None if name in MESSAGES_EVENTS and body.get("type") == name \
            else f"an event not in the Messages API's shape: {name} {data[:200]!r}"
    return None if name and name.startswith("response.") and body.get("type") == name \
        else f"an event not in the Responses API's shape: {name} {data[:200]!r}"


def check_stream(endpoint: str, text: str) -> str | None:
    """Each event in its API's shape, and the stream's last the one that ends it."""
    found = events(text)
    for name, data in found:
        if (wrong := check_event(endpoint, name, data)) is not None:
            return wrong
    last_name, last_data = found[-1]
    ended = {"/v1/responses": last_name == "response.completed", "/v1/messages": last_name == "message_stop"}
    if not ended.get(endpoint, last_data == "[DONE]"):
        return f"a stream that ends without its final event: {last_name} {last_data[:200]!r}"
    return None


def check_answer(endpoint: str, status: int, headers: dict, raw: bytes) -> str | None:
    """What is wrong with an answer (None: nothing): a 5xx; an error not in
    the API's shape; a stream with an event out of shape, an error event or
    no final event; a 200 that is not the API's whole reply."""
    if status >= 500:
        return f"status {status}: {raw[:300]!r}"
    content_type = headers.get("content-type", "")
    if status != 200:
        try:
            body = json.loads(raw)
        except ValueError:
            return f"status {status} with a body that is not JSON: {raw[:200]!r}"
        return None if is_error_shaped(endpoint, body) else f"status {status} not in the API's shape: {body}"
    if content_type.startswith("text/event-stream"):
        return check_stream(endpoint, raw.decode())
    try:
        body = json.loads(raw)
    except ValueError:
        return f"a 200 whose body is not JSON: {raw[:200]!r}"
    if endpoint in WHOLE_OBJECTS and not (isinstance(body, dict) and body.get(
            "type" if endpoint == "/v1/messages" else "object") == WHOLE_OBJECTS[endpoint]):
        return f"a 200 not in the API's shape: {raw[:200]!r}"
    return None


def send(base: str, path: str, raw: bytes, key: str, headers: dict | None = None, method: str = "POST",
         timeout: float = 60) -> tuple:
    """``(status, headers, whole body)`` of one request to the server at
    ``base`` carrying ``key``, streams read to their end."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=raw, headers={"content-type": "application/json",
                                                            "authorization": f"Bearer {key}", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()
