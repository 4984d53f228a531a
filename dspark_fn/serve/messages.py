"""The Anthropic Messages API (``POST /v1/messages``) over the same engine as chat completions.

A request becomes a chat completion: ``system`` a system message, each
message's text blocks its text, ``image`` blocks of a user turn its image
parts, in order (a base64 source as a ``data:`` URL, a url source as its
URL: the same bounds and refusals as images in chat completions),
``tool_use`` blocks an assistant turn's
tool calls and ``tool_result`` blocks tool messages; ``tools``
(``input_schema``) and ``tool_choice`` (auto, any, tool, none: "any" and
"tool" hold the reply to calls, one only with ``disable_parallel_tool_use``)
the chat tools; ``stop_sequences`` stop strings. The reply is a ``message`` (text
and ``tool_use`` blocks, ``stop_reason`` end_turn, max_tokens,
stop_sequence or tool_use, ``usage`` with the tokens the prompt cache
served as ``cache_read_input_tokens``), or, streamed, the typed events from
``message_start`` to ``message_stop``. Errors have Anthropic's shape
(``errors.py``). Not supported: documents, thinking (earlier thinking
blocks are dropped), server tools, batches.
"""

import json
import uuid

from .errors import ApiError, server_error

ROLES = ("user", "assistant")


def _blocks(content, role: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise ApiError(f"a {role} message's 'content' must be a string or a list of content blocks", "messages")
    return content


def _text(blocks: list, where: str) -> str:
    if not all(block.get("type") == "text" for block in blocks):
        raise ApiError(f"{where} takes text blocks only", "messages")
    return "".join(block.get("text", "") for block in blocks)


def image_url(block: dict) -> str:
    """An ``image`` block's source as the URL an ``image_url`` chat part takes."""
    source = block.get("source") or {}
    if source.get("type") == "base64":
        if not source.get("media_type") or not isinstance(source.get("data"), str):
            raise ApiError("an image block's base64 source needs its 'media_type' and 'data'", "messages")
        return f"data:{source['media_type']};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError("an image block's source is {'type': 'base64', 'media_type', 'data'} or {'type': 'url', 'url'}",
                   "messages")


def _turns(message) -> list:
    """One Messages turn as chat messages: tool results first (each a tool
    message), then the text (with a user turn's images, as chat parts) and
    the calls it makes."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(f"each message needs a 'role' ({' or '.join(ROLES)}) and a 'content'", "messages")
    role, text, calls, results, parts = message["role"], "", [], [], []
    for block in _blocks(message.get("content"), message["role"]):
        kind = block.get("type")
        if kind == "text":
            text += block.get("text", "")
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": image_url(block)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            output = block.get("content", "")
            output = output if isinstance(output, str) else _text(_blocks(output, "tool_result"), "a tool_result")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"error: {output}" if block.get("is_error") else output})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # nothing here thinks: an earlier turn's thinking does not go back in
        else:
            raise ApiError(f"content blocks of type {kind!r} are not supported in a {role} message (text, tool_use "
                           f"in assistant turns, image and tool_result in user turns)", "messages")
    pictured = any(part["type"] == "image_url" for part in parts)
    content = parts if pictured else text or None
    turn = [{"role": role, "content": content, **({"tool_calls": calls} if calls else {})}]
    return results + (turn if text or calls or pictured or not results else [])


def _chat_tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise ApiError("'tools' must be a list of {'name', 'description', 'input_schema'} client tools", "tools")
    if any(t.get("type") not in (None, "custom") for t in tools):
        raise ApiError("server tools (web search, code execution, ...) are not supported; only client tools are",
                       "tools")
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools]


def _chat_tool_choice(choice):
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise ApiError("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                   "tool_choice")


def chat_request(body) -> dict:
    """A Messages body as a chat completions body."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if "max_tokens" not in body:
        raise ApiError("'max_tokens' is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    system = body.get("system")
    turns = [{"role": "system", "content": _text(_blocks(system, "system"), "'system'")}] if system else []
    for message in messages:
        turns += _turns(message)
    stop = body.get("stop_sequences")
    chat = {"messages": turns, "stream": body.get("stream", False), "stop": stop}
    for name in ("model", "max_tokens", "temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    tools, choice = _chat_tools(body.get("tools")), _chat_tool_choice(body.get("tool_choice"))
    if tools is not None:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
        chat["parallel_tool_calls"] = not body["tool_choice"].get("disable_parallel_tool_use", False)
    return chat


def tool_use(call: dict) -> dict:
    """A call as its parser read it, as a ``tool_use`` block."""
    arguments = call.get("arguments", {})
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call["name"],
            "input": json.loads(arguments) if isinstance(arguments, str) else arguments}


def stop_reason(finish: str, stop: str | None) -> str:
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish, "stop_sequence" if stop else "end_turn")


def usage(chat_usage: dict) -> dict:
    """Anthropic counts the prompt tokens the cache served apart from the rest."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message(ident: str, model: str, content: list, reason: str | None, stop: str | None, counts: dict) -> dict:
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop, "usage": counts}


def event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


async def answer(api, job, requests: list) -> dict:
    """The whole reply as a ``message``."""
    (request,) = requests
    try:
        reply = await api.whole(job, request)
    finally:
        request.cancel()
    content = ([{"type": "text", "text": reply.text}] if reply.text else []) + [tool_use(c) for c in reply.calls]
    counts, _ = api.usage(job, [request])
    reply_message = message(f"msg_{uuid.uuid4().hex}", api.model_name, content,
                            stop_reason(reply.finish, reply.stop), reply.stop, usage(counts))
    return reply_message | ({"stop_detail": reply.detail} if reply.detail else {})  # an extension field


async def answer_streaming(api, job, requests: list):
    """The reply as Messages events: a text block open while text arrives, a
    ``tool_use`` block (its whole input as one ``input_json_delta``) per call."""
    (request,) = requests
    blocks, text_open = 0, False  # blocks started so far; whether the last one is text still open
    try:
        start = message(f"msg_{uuid.uuid4().hex}", api.model_name, [], None, None,
                        usage(api.usage(job, [request])[0]))
        yield event("message_start", message=start)
        async for piece in api.replies(job, request):
            if piece.text and not text_open:
                yield event("content_block_start", index=blocks, content_block={"type": "text", "text": ""})
                blocks, text_open = blocks + 1, True
            if piece.text:
                yield event("content_block_delta", index=blocks - 1, delta={"type": "text_delta", "text": piece.text})
            for call in map(tool_use, piece.calls):
                if text_open:
                    yield event("content_block_stop", index=blocks - 1)
                    text_open = False
                yield event("content_block_start", index=blocks, content_block=call | {"input": {}})
                yield event("content_block_delta", index=blocks,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(call["input"])})
                yield event("content_block_stop", index=blocks)
                blocks += 1
            if piece.finish is not None:
                if text_open:
                    yield event("content_block_stop", index=blocks - 1)
                detail = {"stop_detail": piece.detail} if piece.detail else {}  # an extension field
                yield event("message_delta", delta={"stop_reason": stop_reason(piece.finish, piece.stop),
                                                    "stop_sequence": piece.stop} | detail,
                            usage=usage(api.usage(job, [request])[0]))
        yield event("message_stop")
    except Exception as error:  # a failed engine: an error event ends the stream
        yield event("error", error=server_error(error).anthropic_body["error"])
    finally:
        request.cancel()
