"""Tool calling: function tools rendered into the prompt, calls read back out of the text.

A tokenizer whose chat template takes ``tools`` renders them itself, and
mlx-lm's tool parser for that template (``TokenizerWrapper.tool_parser``,
between its ``tool_call_start`` and ``tool_call_end`` markers) reads the
calls. A template that knows nothing of tools gets them as a system message
asking for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the
Hermes / Qwen convention), read by mlx-lm's ``json_tools`` parser; earlier
calls and tool results then go into the conversation as text the same way.
A call that its parser cannot read stays in the reply as text.

``tool_choice`` "required" or a named function holds the reply to calls
(``call_constraint``): the start marker, ``{"name": ..., "arguments":
...}`` with the name one of the tools' and the arguments valid under its
parameters schema, the end marker, written as the template writes a call
(a marker that is one token by that token; what lies between a marker and
the JSON, e.g. Qwen's newline, as the template puts it). That is the form
mlx-lm's ``json_tools`` parser reads; a model whose parser reads another
form gets a 400 for those choices.
"""

import json
import uuid
from dataclasses import dataclass

from mlx_lm.tool_parsers import json_tools

from ..constraints import Constraint
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
    required: bool = False  # the reply must call one of them ("required", or the one named)

    @classmethod
    def from_body(cls, tools, choice) -> "Tools":
        if tools is None:
            if choice not in (None, "auto", "none"):
                raise ApiError(f"'tool_choice' {choice!r} asks for a call, and the request offers no 'tools'",
                               "tool_choice")
            return cls(())
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools
        ):
            raise ApiError("'tools' must be a list of {'type': 'function', 'function': {'name': ..., ...}}", "tools")
        names = [t["function"]["name"] for t in tools]
        if choice is None or choice in ("auto", "required"):
            return cls(tuple(tools), choice == "required")
        if choice == "none":
            return cls(())
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if named is None:
            raise ApiError("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
                           "'function': {'name': ...}}", "tool_choice")
        if named not in names:
            raise ApiError(f"'tool_choice' names {named!r}, which is not among the tools ({', '.join(names)})",
                           "tool_choice")
        return cls(tuple(t for t in tools if t["function"]["name"] == named), True)


def template_takes_tools(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))


def markers(tokenizer) -> tuple[str, str, object]:
    """``(start, end, parse)`` of the tool calls this tokenizer's model writes."""
    if template_takes_tools(tokenizer):
        return tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser
    return json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call


def marker_tokens(tokenizer, text: str) -> "str | list[int]":
    """A marker as the grammar takes it: its token's id when one token spells it, else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if len(ids) == 1 else text


def call_padding(tokenizer, start: str) -> str:
    """What the chat template writes between a call's start marker and its
    JSON (Qwen's templates: a newline), from a call it renders; nothing for
    templates without tools (the form ``TOOL_PREAMBLE`` asks for)."""
    if not template_takes_tools(tokenizer):
        return ""
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template that cannot render a call: the JSON follows the marker
        return ""
    after = text[text.rfind(start) + len(start):] if start in text else ""
    padding = after[: after.find("{")] if "{" in after else ""
    return padding if padding.isspace() else ""


def call_constraint(tokenizer, tools: Tools, parallel: bool = True) -> Constraint:
    """The reply as one call of ``tools`` (or several, with ``parallel``) in the model's format."""
    start, end, parse = markers(tokenizer)
    if getattr(parse, "__module__", "").rsplit(".", 1)[-1] != "json_tools":
        raise ApiError(f"this model writes tool calls in another form than JSON between markers (its parser: "
                       f"{parse.__module__.rsplit('.', 1)[-1]}), so a call cannot be required of it: use "
                       f"tool_choice 'auto'", "tool_choice")
    functions = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters")}
                 for t in tools.functions]
    return Constraint.tool_calls(functions, marker_tokens(tokenizer, start), marker_tokens(tokenizer, end),
                                 call_padding(tokenizer, start), parallel)


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
