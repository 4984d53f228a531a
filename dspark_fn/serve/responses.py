"""The Responses API (``POST /v1/responses``) over the same engine as chat completions.

A request becomes a chat completion: ``instructions`` a system message,
``input`` (a string, or items: messages, whose content may hold
``input_image`` parts, earlier ``function_call`` items and
``function_call_output`` results) the turns after it, function tools in
the Responses layout (``{"type": "function", "name", ...}``) the chat
tools. ``previous_response_id`` puts that response's whole conversation
first: the server holds the last ``HELD_RESPONSES`` responses, and the
prompt cache still holds the decoded turn, so the prefix is not computed
again (``usage.input_tokens_details.cached_tokens``). The reply is a
``response`` object (output text as a ``message`` item, calls as
``function_call`` items), or, streamed, the typed events from
``response.created`` to ``response.completed``.
"""

import json
import threading
import time
from collections import OrderedDict

from .errors import ApiError

HELD_RESPONSES = 256


TEXT_PARTS = ("input_text", "output_text", "text")


def _content(content, param: str):
    """A message item's content as chat content: its text, or (with
    ``input_image`` parts) chat parts, each image an ``image_url`` part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS + ("input_image",)
                                                 for p in content):
        raise ApiError("a message's content is a string or a list of input_text, output_text and input_image parts "
                       "(no files or audio)", param)
    if all(part["type"] in TEXT_PARTS for part in content):
        return "".join(part.get("text", "") for part in content)
    return [{"type": "text", "text": part.get("text", "")} if part["type"] in TEXT_PARTS
            else {"type": "image_url", "image_url": {"url": input_image_url(part, param)}} for part in content]


def input_image_url(part: dict, param: str) -> str:
    if part.get("file_id") is not None and part.get("image_url") is None:
        raise ApiError("input_image by file_id is not supported (no file storage here): give its image_url, e.g. "
                       "a data: URL", param)
    return part.get("image_url")


def input_messages(items) -> list:
    """Responses ``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError("'input' must be a string or a non-empty list of items", "input")
    messages = []
    for item in items:
        if not isinstance(item, dict):
            raise ApiError("each 'input' item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), "input")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ApiError(f"input items of type {kind!r} are not supported (message, function_call, "
                           f"function_call_output)", "input")
    return messages


def chat_tools(tools) -> list | None:
    """Responses function tools in the chat layout."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
        raise ApiError("'tools' must be a list of function tools ({'type': 'function', 'name': ...}); other "
                       "tool types are not supported", "tools")
    return [{"type": "function", "function": {key: t[key] for key in ("name", "description", "parameters")
                                              if key in t}} for t in tools]


def chat_response_format(text) -> dict | None:
    """``text.format`` as chat's ``response_format`` (its ``json_schema``
    fields sit one level up here: ``{"type": "json_schema", "name",
    "schema", "strict"}``)."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if form is None:
        return None
    if not isinstance(form, dict):
        raise ApiError("'text.format' must be an object: {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       "text")
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {key: form[key] for key in ("name", "schema", "strict")
                                                       if key in form}}
    return form


def chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


class Conversations:
    """The last ``HELD_RESPONSES`` responses' conversations (chat messages, the reply included), by id."""

    def __init__(self, held: int = HELD_RESPONSES):
        self.held, self.entries = held, OrderedDict()
        self.lock = threading.Lock()  # read on the threads that read requests, kept on the event loop

    def before(self, ident) -> list:
        if ident is None:
            return []
        with self.lock:
            if ident in self.entries:
                self.entries.move_to_end(ident)
                return list(self.entries[ident])
        raise ApiError(f"previous response {ident!r} is not held by this server (it keeps the last "
                       f"{self.held}); send the whole conversation as input instead", "previous_response_id",
                       status=404, code="previous_response_not_found")

    def keep(self, ident: str, messages: list) -> None:
        with self.lock:
            self.entries[ident] = messages
            while len(self.entries) > self.held:
                self.entries.popitem(last=False)


def chat_request(body, conversations: Conversations) -> tuple[dict, list]:
    """``(chat completion body, its messages)`` of a Responses body."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    messages = conversations.before(body.get("previous_response_id"))
    if body.get("instructions"):
        messages = [{"role": "system", "content": body["instructions"]}] + [m for m in messages if m["role"] != "system"]
    messages += input_messages(body.get("input"))
    chat = {"messages": messages, "stream": bool(body.get("stream", False))}
    for name, value in (("model", body.get("model")), ("max_tokens", body.get("max_output_tokens")),
                        ("temperature", body.get("temperature")), ("top_p", body.get("top_p")),
                        ("tools", chat_tools(body.get("tools"))), ("tool_choice", chat_tool_choice(body.get("tool_choice"))),
                        ("response_format", chat_response_format(body.get("text"))),
                        ("parallel_tool_calls", body.get("parallel_tool_calls"))):
        if value is not None:
            chat[name] = value
    return chat, messages


def message_item(ident: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": content}


def call_item(call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    """A chat ``tool_calls`` entry as a Responses ``function_call`` item."""
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments, "status": status}


def output_items(message_id: str, text: str, calls: list) -> list:
    """The reply as Responses output items: a message with the text (if any), then a ``function_call`` per call."""
    return ([message_item(message_id, text)] if text or not calls else []) + [call_item(call) for call in calls]


def reply_messages(text: str, calls: list) -> list:
    """The reply as the chat turn a later response continues from."""
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def response_object(ident: str, body: dict, model: str, output: list, usage: dict | None, status: str) -> dict:
    return {
        "id": ident, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
        "output": output, "usage": usage, "previous_response_id": body.get("previous_response_id"),
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "error": None,
        "incomplete_details": None, "text": body.get("text") or {"format": {"type": "text"}},
    }


def responses_usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


class EventStream:
    """Numbered server-sent events of one streamed response."""

    def __init__(self):
        self.number = 0

    def __call__(self, kind: str, **fields) -> str:
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.number, **fields})}\n\n"
