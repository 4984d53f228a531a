"""Structured output: what a request's fields hold a reply to, as a
``constraints.Constraint``, compiled while the request is read.

``response_format`` (chat and text completions; the Responses API's
``text.format`` arrives as it) asks for any JSON object (``json_object``) or
JSON valid under a schema (``json_schema``, whose ``strict`` is taken either
way: the schema is enforced, and a keyword that cannot be is refused).
``tool_choice`` "required" or a named function (``tools.Tools.required``)
asks for calls in the model's tool-call format (``tools.call_constraint``).
Tools offered under "auto" beside a JSON format leave the model the choice:
a call, or the JSON. A model that thinks first is held from the end of its
thinking on (``chat.thinking_ahead``).

Each distinct constraint is compiled once (``Grammars``, a bounded cache:
agents send the same schema with every request) against the server's
tokenizer; what cannot be compiled, or exceeds ``constraints.Limits``, is a
400 naming the problem, before any row is taken.
"""

import threading
from collections import OrderedDict

from ..chat import thinking_ahead
from ..constraints import LIMITS, Constraint, Grammar, Limits, Vocabulary, compile_constraint
from .errors import ApiError
from .tools import Tools, call_constraint

FORMATS = ("text", "json_object", "json_schema")
HELD_GRAMMARS = 128


class Grammars:
    """Compiled constraints for one tokenizer and model, the latest
    ``HELD_GRAMMARS`` kept. The tokenizer is read for the grammar engine on
    first use (a fraction of a second); ``end_tokens``: the tokens that end a
    reply (every stop token)."""

    def __init__(self, tokenizer, vocab_size: int, end_tokens, limits: Limits = LIMITS):
        self.tokenizer, self.vocab_size, self.end_tokens, self.limits = tokenizer, vocab_size, list(end_tokens), limits
        self.vocabulary: Vocabulary | None = None
        self.held: OrderedDict = OrderedDict()
        self.lock = threading.Lock()  # requests are read on several threads at once

    def compile(self, constraint: Constraint) -> Grammar:
        """``constraint`` compiled (``ValueError`` naming what is wrong)."""
        with self.lock:
            if constraint in self.held:
                self.held.move_to_end(constraint)
                return self.held[constraint]
            if self.vocabulary is None:
                self.vocabulary = Vocabulary(self.tokenizer, self.vocab_size, end_tokens=self.end_tokens)
        grammar = compile_constraint(constraint, self.vocabulary, self.limits)  # outside the lock: it may take long
        with self.lock:
            self.held[constraint] = grammar
            while len(self.held) > HELD_GRAMMARS:
                self.held.popitem(last=False)
        return grammar


def response_constraint(form) -> Constraint | None:
    """``response_format`` as a constraint (None for text)."""
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind not in FORMATS:
        raise ApiError(f"response_format {kind if kind is not None else form!r} is not supported: its 'type' is "
                       f"one of {', '.join(FORMATS)}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    spec = form.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise ApiError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}, "
                       "'strict': ...}", "response_format")
    return Constraint.json_schema(spec["schema"])


def reply_constraint(form, tools: Tools, parallel: bool, tokenizer, prompt: list) -> tuple[Constraint, str] | None:
    """``(constraint, the field it came from)`` for one chat reply, or None."""
    if tools.required:
        held, field = call_constraint(tokenizer, tools, parallel), "tools"
    else:
        held, field = response_constraint(form), "response_format"
        if held is None:
            return None
        if tools.functions:  # "auto": a call, or the format
            held = Constraint.any_of(held, call_constraint(tokenizer, tools, parallel))
    thinking = thinking_ahead(tokenizer, prompt)
    if thinking is not None:
        held = Constraint.after_thinking(held, end=thinking[1], start=thinking[0])
    return held, field


def compiled(grammars: Grammars, constraint: Constraint, field: str) -> Grammar:
    """``constraint`` compiled, or a 400 naming the field and the problem."""
    try:
        return grammars.compile(constraint)
    except ValueError as error:
        raise ApiError(f"{field}: {error}", field) from None
