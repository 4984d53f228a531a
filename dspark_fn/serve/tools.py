"""Tool calling: function tools rendered into the prompt, calls read back out of the text.

A tokenizer whose chat template takes ``tools`` renders them itself, and
mlx-lm's tool parser for that template (``TokenizerWrapper.tool_parser``,
between its ``tool_call_start`` and ``tool_call_end`` markers) reads the
calls. A template that knows nothing of tools gets them as a system message
asking for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the
Hermes / Qwen convention), read by mlx-lm's ``json_tools`` parser; earlier
calls and tool results then go into the conversation as text the same way.
A call that its parser cannot read stays in the reply as text.
"""

import json
import uuid
from dataclasses import dataclass

from mlx_lm.tool_parsers import json_tools

from .errors import ApiError

TOOL_PREAMBLE = (
    "You may call these functions. To call one, answer with\n"
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
    "and nothing else. The functions:\n"
)


@dataclass(frozen=True)
class Tools:
    """The function tools a request offers the model, after ``tool_choice``."""

    functions: tuple  # OpenAI chat tool objects: {"type": "function", "function": {...}}

    @classmethod
    def from_body(cls, tools, choice) -> "Tools":
        if tools is None:
            return cls(())
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools
        ):
            raise ApiError("'tools' must be a list of {'type': 'function', 'function': {'name': ..., ...}}", "tools")
        names = [t["function"]["name"] for t in tools]
        if choice is None or choice in ("auto", "required"):
            return cls(tuple(tools))
        if choice == "none":
            return cls(())
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if named is None:
            raise ApiError("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
                           "'function': {'name': ...}}", "tool_choice")
        if named not in names:
            raise ApiError(f"'tool_choice' names {named!r}, which is not among the tools ({', '.join(names)})",
                           "tool_choice")
        return cls(tuple(t for t in tools if t["function"]["name"] == named))


def template_takes_tools(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))


def markers(tokenizer) -> tuple[str, str, object]:
    """``(start, end, parse)`` of the tool calls this tokenizer's model writes."""
    if template_takes_tools(tokenizer):
        return tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser
    return json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call


def as_text(call: dict) -> str:
    """An earlier call in the Hermes form (templates without tools of their own)."""
    function = call.get("function", {})
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    body = json.dumps({"name": function.get("name"), "arguments": arguments})
    return f"{json_tools.tool_call_start}{body}{json_tools.tool_call_end}"


def template_turns(messages: list, text_of, tokenizer, tools: Tools) -> tuple[list, dict]:
    """The conversation as the chat template takes it, and the template's
    keywords: tools passed to a template that renders them, or described in
    a system message otherwise; assistant turns' calls and tool results put
    in the form each path reads."""
    native = template_takes_tools(tokenizer)
    turns = []
    for message in messages:
        turn = {"role": message["role"], "content": text_of(message)}
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ApiError("an assistant message's 'tool_calls' must be a list", "messages")
            if native:
                turn["tool_calls"] = [
                    {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])
                                          if isinstance(call["function"].get("arguments"), str)
                                          else call["function"].get("arguments", {})}}
                    for call in calls
                ]
            else:
                turn["content"] = (turn["content"] + "".join(as_text(call) for call in calls)).strip()
        if message["role"] == "tool" and not native:
            turn = {"role": "user", "content": f"<tool_response>{turn['content']}</tool_response>"}
        turns.append(turn)
    if not tools.functions:
        return turns, {}
    if native:
        return turns, {"tools": list(tools.functions)}
    described = TOOL_PREAMBLE + "\n".join(json.dumps(t["function"]) for t in tools.functions)
    if turns and turns[0]["role"] == "system":
        return [{"role": "system", "content": turns[0]["content"] + "\n\n" + described}] + turns[1:], {}
    return [{"role": "system", "content": described}] + turns, {}


def openai_call(parsed: dict, index: int | None = None) -> dict:
    """A parsed call as an OpenAI ``tool_calls`` entry (with ``index`` in a stream)."""
    call = {"id": parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"], "arguments": json.dumps(parsed.get("arguments", {}))}}
    return call if index is None else {"index": index, **call}


class CallReader:
    """Splits a reply's text, piece by piece, into content and tool calls:
    text between the start and end markers is held back and parsed when the
    end arrives (a call its parser cannot read goes back into the content)."""

    def __init__(self, tokenizer, tools: Tools):
        self.start, self.end, self.parse = markers(tokenizer)
        self.tools, self.active = list(tools.functions), bool(tools.functions)
        self.pending, self.calls = "", []

    def feed(self, text: str, final: bool = False) -> tuple[str, list]:
        """``(content to send now, calls completed now)``."""
        if not self.active:
            return text, []
        self.pending += text
        content, calls = "", []
        while True:
            begin = self.pending.find(self.start)
            if begin < 0:
                # keep what could be the start of a marker, unless the reply ended
                keep = 0 if final else next((n for n in range(len(self.start) - 1, 0, -1)
                                             if self.pending.endswith(self.start[:n])), 0)
                content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return content, calls
            content += self.pending[:begin]
            finish = self.pending.find(self.end, begin + len(self.start))
            if finish < 0:
                if final:  # a call cut off: it is text
                    content += self.pending[begin:]
                    self.pending = ""
                else:
                    self.pending = self.pending[begin:]
                return content, calls
            body = self.pending[begin + len(self.start) : finish]
            self.pending = self.pending[finish + len(self.end) :]
            try:
                parsed = self.parse(body, self.tools)
            except (ValueError, KeyError, TypeError, SyntaxError):
                parsed = None
            parsed = parsed if isinstance(parsed, list) else [parsed]
            if all(isinstance(one, dict) and isinstance(one.get("name"), str) for one in parsed):
                calls += parsed
                self.calls += parsed
            else:  # its parser cannot read it: the reply keeps it as text
                content += self.start + body + self.end
