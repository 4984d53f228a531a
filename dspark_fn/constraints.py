"""Structured generation on the host: what a row's output must match, and a
matcher per row that follows the tokens the row commits and writes the
allowed-token bits the kernels read.

A ``Constraint`` (a JSON Schema, any JSON object, a regular expression, a
Lark or GBNF grammar) is compiled once per request by llguidance against a
``Vocabulary`` (the tokenizer as the engine sees it, sized to the model's
vocabulary), within ``Limits``; what cannot be compiled, uses a keyword the
engine does not enforce, admits no output or exceeds a limit raises a
``ValueError`` naming the problem, before any row runs. Each row then owns a
``Matcher``: its grammar state after every token it committed, its anchor
(the last token it emitted) included. The matcher advances only by
committed tokens; masks along a proposal come from the state after each
proposed token, rolled back afterwards.

Bits: a mask is ``ceil(V / 32)`` uint32 words, token ``v`` being bit
``v % 32`` of word ``v // 32`` (``sampling.allowed_tokens``); rows without a
constraint allow every token. For a verify of width ``W``, position ``j``
holds what the grammar allows after the committed tokens and the first
``j`` proposals. Positions after a proposal the grammar refuses allow every
token: the constrained target gives that proposal probability 0, so it is
never kept and nothing after it is read.

Kinds are a table (``GRAMMARS``: kind -> function from the constraint's text
to an llguidance grammar). Besides the plain kinds (a JSON Schema, any JSON
object, a regular expression, a Lark or GBNF grammar) it holds tool calls in
a model's format (markers around ``{"name": ..., "arguments": ...}``, each
tool's parameters a JSON Schema: Lark with ``%json``) and two kinds made of
others: ``after_thinking`` (free text until the model's end-of-thinking
marker, then the constraint) and ``any_of`` (any one of several).

JSON is held to one layout unless the schema says otherwise in its own
``"x-guidance"``: the separators ``", "`` and ``": "`` and no other
whitespace outside strings (``JSON_LAYOUT``). llguidance's default, free
whitespace at every separator, lets a model pad without bound; one layout
also makes the keys and punctuation forced tokens.
"""

import json
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import llguidance
import numpy as np

from .sampling import mask_words


class Constraint(NamedTuple):
    """What a row's output must match: ``kind`` (a key of ``GRAMMARS``) and its text."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: "dict | str") -> "Constraint":
        """JSON that validates against ``schema`` (a dict or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text that matches ``pattern`` whole (Rust regex syntax)."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """Text in the language of a Lark grammar (llguidance's dialect) or a GBNF one."""
        return cls("grammar", text)

    @classmethod
    def tool_calls(cls, tools: Sequence[dict], start: "str | Sequence[int]" = "<tool_call>",
                   end: "str | Sequence[int]" = "</tool_call>", padding: str = "",
                   parallel: bool = True) -> "Constraint":
        """One call (or, with ``parallel``, one or more) of ``tools`` in the
        model's format: ``start``, ``padding``, ``{"name": ..., "arguments":
        ...}`` (the name one of the tools', the arguments valid under its
        ``parameters`` schema; an absent schema takes any object),
        ``padding``, ``end``; calls separated by up to 4 spaces or newlines.
        ``tools``: ``{"name", "parameters"}`` each (OpenAI's ``function``
        objects). A marker is its text, or the ids of the tokens that spell
        it (a marker that is one special token of the vocabulary must be
        given as its id). ``padding`` is what the model's template writes
        between a marker and the JSON (Qwen's: a newline)."""
        if not tools:
            raise ValueError("a tool-call constraint needs at least one tool")
        listed = [{"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}} for tool in tools]
        return cls("tool_calls", json.dumps({"tools": listed, "start": _marker_data(start), "end": _marker_data(end),
                                             "padding": padding, "parallel": parallel}))

    @classmethod
    def after_thinking(cls, then: "Constraint", end: "str | Sequence[int]",
                       start: "str | Sequence[int] | None" = None) -> "Constraint":
        """Free text while the model thinks, then ``then``: with ``start`` (the
        output does not begin inside the thinking) the thinking is optional
        and opens with ``start``; without, the output begins inside it. It ends
        at ``end`` (its first occurrence: one token id, or text), then up to
        8 whitespace characters, then ``then``."""
        if not isinstance(end, str) and len(end) != 1:
            raise ValueError(f"the end of thinking must be one token id or text, got ids {list(end)}")
        return cls("after_thinking", json.dumps({"start": None if start is None else _marker_data(start),
                                                 "end": _marker_data(end), "then": list(then)}))

    @classmethod
    def any_of(cls, *choices: "Constraint") -> "Constraint":
        """Output that matches any one of ``choices``."""
        if len(choices) < 2:
            raise ValueError("any_of takes at least two constraints")
        return cls("any_of", json.dumps([list(choice) for choice in choices]))


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _laid_out(schema):
    """``schema`` with ``JSON_LAYOUT`` unless it sets its own (``"x-guidance"``)."""
    return schema if not isinstance(schema, dict) or "x-guidance" in schema else {**schema, "x-guidance": JSON_LAYOUT}


def _json_schema_grammar(source: str) -> str:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
    return llguidance.LLMatcher.grammar_from_json_schema(_laid_out(schema))


def _lark_or_gbnf(text: str) -> str:
    return llguidance.grammar_from("grammar", text)  # GBNF is converted to Lark; Lark passes as it is


def _marker_data(marker) -> "str | list[int]":
    return marker if isinstance(marker, str) else [int(token) for token in marker]


def _marker(marker: "str | list[int]") -> str:
    """A marker in Lark: its text as a literal, or its tokens by id."""
    return json.dumps(marker, ensure_ascii=False) if isinstance(marker, str) else " ".join(f"<[{token}]>" for token in marker)


SEPARATOR = r"/[ \t\r\n]{1,4}/"  # between tool calls


def _tool_calls_grammar(source: str) -> str:
    spec = json.loads(source)
    calls = [{"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in spec["tools"]]
    body = _laid_out(calls[0] if len(calls) == 1 else {"anyOf": calls})
    repeat = " (SEP? call)*" if spec["parallel"] else ""
    padding = f" {_marker(spec['padding'])} " if spec["padding"] else " "
    return (f"start: call{repeat}\ncall: {_marker(spec['start'])}{padding}%json {json.dumps(body)}{padding}"
            f"{_marker(spec['end'])}\nSEP: {SEPARATOR}")


def _after_thinking_parts(source: str, prefix: str) -> tuple[str, list]:
    spec = json.loads(source)
    end = spec["end"]
    if isinstance(end, str):  # text: the thinking stops at its first occurrence, which it takes in
        thinking, rules = "think", f"think[stop={_marker(end)}]: /(?s:.*)/"
    else:  # a token: text cannot hold it, so the thinking ends where it comes
        thinking, rules = f"THINK {_marker(end)}", "THINK: /(?s:.*)/"
    if spec["start"] is not None:
        thinking = f"({_marker(spec['start'])} {thinking} WS?)?"
    else:
        thinking = f"{thinking} WS?"
    then = prefix + "then"
    return f"start: {thinking} @{then}\n{rules}\nWS: /[ \\t\\r\\n]{{1,8}}/", [(then, Constraint(*spec["then"]))]


def _any_of_parts(source: str, prefix: str) -> tuple[str, list]:
    choices = [Constraint(*choice) for choice in json.loads(source)]
    names = [f"{prefix}choice{i}" for i in range(len(choices))]
    return "start: " + " | ".join(f"@{name}" for name in names), list(zip(names, choices))


# Kinds made of other constraints: kind -> (source, a prefix for the names of its parts) -> (the Lark
# grammar it starts with, naming each part ``@name``, and the parts as (name, Constraint)).
COMPOSITES: dict[str, Callable[[str, str], tuple[str, list]]] = {
    "after_thinking": _after_thinking_parts,
    "any_of": _any_of_parts,
}


def _top_level(constraint: Constraint, name: str | None = None) -> list[dict]:
    """``constraint`` as llguidance's list of named grammars, the first (named
    ``name``) where it starts; a composite's parts get names under its own."""
    if constraint.kind not in GRAMMARS:
        raise ValueError(f"unknown constraint kind {constraint.kind!r}: one of {', '.join(GRAMMARS)}")
    if constraint.kind in COMPOSITES:
        start, parts = COMPOSITES[constraint.kind](constraint.source, f"{name}_" if name else "")
        grammars = [{"lark_grammar": start}]
        for part_name, part in parts:
            grammars += _top_level(part, part_name)
    else:
        text = GRAMMARS[constraint.kind](constraint.source)
        grammars = json.loads(text)["grammars"] if text.lstrip().startswith("{") else [{"lark_grammar": text}]
        if len(grammars) != 1:
            raise ValueError(f"a {constraint.kind} constraint inside another must be one grammar")
    return [dict(grammars[0], name=name)] + grammars[1:] if name else grammars


def _composite_grammar(kind: str) -> Callable[[str], str]:
    return lambda source: json.dumps({"grammars": _top_level(Constraint(kind, source))})


GRAMMARS: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema_grammar,
    "json_object": lambda _: llguidance.LLMatcher.grammar_from_json_schema(_laid_out({"type": "object"})),
    "regex": llguidance.LLMatcher.grammar_from_regex,
    "grammar": _lark_or_gbnf,
    "tool_calls": _tool_calls_grammar,
    **{kind: _composite_grammar(kind) for kind in COMPOSITES},
}


@dataclass(frozen=True)
class Limits:
    """Bounds on what a constraint may cost. Compiling is bounded by the
    source's size and llguidance's fuel (work units, so the bound is the
    same on every machine: about 50k units a millisecond while building the
    lexer, 14k while computing a mask); a mask step by its fuel and items."""

    source_bytes: int = 256 * 1024
    grammar_size: int = 500_000  # symbols in the grammar's productions
    lexer_fuel: int = 1_000_000  # building the lexer (about 20 ms)
    step_fuel: int = 200_000  # one mask (about 15 ms at most; typical masks take microseconds)
    step_items: int = 50_000  # Earley items in one mask step

    def engine(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(max_grammar_size=self.grammar_size, initial_lexer_fuel=self.lexer_fuel,
                                         step_lexer_fuel=self.step_fuel, step_max_items=self.step_items)


LIMITS = Limits()


class Vocabulary:
    """A tokenizer as the grammar engine sees it (every token's bytes, the
    end-of-sequence ids), and the model's vocabulary size, which sets the
    masks' width (ids past the tokenizer's tokens are never allowed).

    ``tokenizer``: an mlx-lm ``TokenizerWrapper``, a Hugging Face fast
    tokenizer, an ``llguidance.LLTokenizer``, or any object with ``tokens``
    (each token's bytes), ``eos_token_id``, ``bos_token_id``,
    ``special_token_ids`` and a call that encodes a string
    (``llguidance.TokenizerWrapper``'s protocol). ``end_tokens`` (default:
    the tokenizer's end-of-sequence id) are the ids that may end a whole
    match: give every stop token the rows use (``chat.stop_tokens``), so
    none of them is refused. Building it takes a fraction of a second for a
    50k vocabulary: build one per tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, end_tokens: Sequence[int] | None = None):
        self.engine = _engine_tokenizer(tokenizer, vocab_size, None if end_tokens is None else list(end_tokens))
        if self.engine.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer has {self.engine.vocab_size} tokens but the model only {vocab_size}: "
                             "pass the model's tokenizer")
        self.size = vocab_size
        self.words = mask_words(vocab_size)
        self.engine_words = mask_words(self.engine.vocab_size)
        self.eos = tuple(self.engine.eos_tokens)

    def widened(self, engine_masks: np.ndarray) -> np.ndarray:
        """Engine masks ``[..., engine words]`` (int32) as uint32 masks over the model's vocabulary."""
        masks = np.zeros((*engine_masks.shape[:-1], self.words), np.uint32)
        masks[..., : self.engine_words] = engine_masks.view(np.uint32)
        return masks


def _engine_tokenizer(tokenizer, vocab_size: int, end_tokens: list | None) -> llguidance.LLTokenizer:
    if isinstance(tokenizer, llguidance.LLTokenizer):
        return tokenizer
    if hasattr(tokenizer, "tokens") and hasattr(tokenizer, "eos_token_id"):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(tokenizer), n_vocab=vocab_size, eos_token=end_tokens)
    from transformers import PreTrainedTokenizerFast

    inner = getattr(tokenizer, "_tokenizer", None)  # mlx-lm's wrapper holds the Hugging Face tokenizer
    tokenizer = inner if isinstance(inner, PreTrainedTokenizerFast) else tokenizer
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        from llguidance.hf import from_tokenizer

        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_tokens)
    raise ValueError(f"cannot read the tokens of a {type(tokenizer).__name__}: pass an mlx-lm or Hugging Face fast "
                     "tokenizer, or an object with tokens (bytes) and eos_token_id")


class Grammar:
    """A constraint compiled against a vocabulary (``compile_constraint``):
    what every row under it starts from."""

    def __init__(self, constraint: Constraint, vocabulary: Vocabulary, start: llguidance.LLMatcher):
        self.constraint, self.vocabulary, self._start = constraint, vocabulary, start

    def matcher(self) -> "Matcher":
        """A fresh matcher at the grammar's start, for one row."""
        return Matcher(self, self._start.deep_copy())


def compile_constraint(constraint: Constraint, vocabulary: Vocabulary, limits: Limits = LIMITS) -> Grammar:
    """Check and compile ``constraint`` once (per request): a ``ValueError``
    names what is wrong (not compilable, a keyword the engine would not
    enforce, no output admitted, over a limit) and what to change."""
    if constraint.kind not in GRAMMARS:
        raise ValueError(f"unknown constraint kind {constraint.kind!r}: one of {', '.join(GRAMMARS)}")
    size = len(constraint.source.encode())
    if size > limits.source_bytes:
        raise ValueError(f"the {constraint.kind} constraint is {size} bytes, over the limit of {limits.source_bytes} "
                         "(Limits.source_bytes): send a smaller one")
    grammar = GRAMMARS[constraint.kind](constraint.source)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary.engine,
                                                                           limits=limits.engine())
    if failed:
        raise ValueError(_refusal(constraint.kind, messages[0]))
    start = llguidance.LLMatcher(vocabulary.engine, grammar, log_level=0, limits=limits.engine())
    matcher = Matcher(Grammar(constraint, vocabulary, start), start.deep_copy())
    first = matcher.mask()  # the engine finds some dead ends only while computing a mask
    if matcher.dead_end or not first.any():
        reason = matcher._state.get_error().splitlines()[0] if matcher.dead_end else "no token can start it"
        raise ValueError(f"the {constraint.kind} constraint admits no output with this tokenizer ({reason})")
    return matcher.grammar


def _refusal(kind: str, message: str) -> str:
    """The engine's reason in words a request's author can act on."""
    first = message.strip().splitlines()[0]
    for known in ("Unimplemented keys", "Unsatisfiable schema"):  # a schema's own, or one inside a grammar
        if known in first:
            first = first[first.index(known):]
    if first.startswith("Unimplemented keys"):
        return (f"the JSON schema uses keywords that cannot be enforced while generating ({first.split(': ', 1)[1]}): "
                "remove them (the output would not be checked against them)")
    if first.startswith("Unsatisfiable schema"):
        return f"the JSON schema admits no value ({first.split(': ', 1)[1]})"
    if "too big" in first or "limit" in first:
        return f"the {kind} constraint is too large to compile ({first}): simplify it, or raise the Limits"
    return f"cannot compile the {kind} constraint: {first}"


class Matcher:
    """One row's grammar state after every token it committed, its anchor included."""

    def __init__(self, grammar: Grammar, state: llguidance.LLMatcher):
        self.grammar, self._state = grammar, state
        self.refused: int | None = None  # the committed token the grammar refused, if any
        self._allowed: np.ndarray | None = None  # the engine's mask of this state, once computed: a round reads it
        #                                          twice (the dead-end check, then the forced tokens)

    def copy(self) -> "Matcher":
        """An independent matcher in the same state (a fork)."""
        twin = Matcher(self.grammar, self._state.deep_copy())
        twin.refused, twin._allowed = self.refused, self._allowed
        return twin

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance by tokens the row committed; returns how many the grammar
        allows. A refused token (only possible when the caller did not apply
        the masks) leaves the matcher before it, at a ``dead_end``."""
        if self.dead_end:
            return 0
        for count, token in enumerate(int(t) for t in tokens):
            if not self._allows(token):
                self.refused = token
                return count
            self._state.consume_token(token)
            self._allowed = None
        return len(tokens)

    def _allows(self, token: int) -> bool:
        if token in self.grammar.vocabulary.eos:  # the engine validates text tokens; an end is allowed once whole
            return self._state.is_accepting()
        return self._state.validate_tokens([token]) == 1

    @property
    def accepting(self) -> bool:
        """The text so far is a whole match: an end-of-sequence token may follow."""
        return self._state.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing but an end-of-sequence token may follow (or one was committed)."""
        return self._state.is_stopped()

    @property
    def dead_end(self) -> bool:
        """The grammar cannot go on from here and is not satisfied: the row must
        end (its finish reason says so, never an illegal token)."""
        return self.refused is not None or self._state.is_error()

    def stuck(self) -> bool:
        """Whether no token may follow (``dead_end``), after computing what is
        allowed next: the engine finds some dead ends only then."""
        if not self.dead_end:
            self._mask(self._state)
        return self.dead_end

    def mask(self) -> np.ndarray:
        """The tokens allowed next, ``[ceil(V/32)]`` uint32 bits."""
        return self._mask(self._state) if not self.dead_end else np.zeros(self.grammar.vocabulary.words, np.uint32)

    def _mask(self, state: llguidance.LLMatcher) -> np.ndarray:
        """The engine's mask of ``state`` (this matcher's own state's computed once)."""
        if state is self._state and self._allowed is not None:
            return self._allowed
        vocabulary = self.grammar.vocabulary
        engine = np.zeros((1, vocabulary.engine_words), np.int32)
        state.unsafe_compute_mask_ptr(engine.ctypes.data, engine.nbytes)
        allowed = vocabulary.widened(engine)[0]
        if state is self._state:
            self._allowed = allowed
        return allowed

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here: while exactly
        one token is allowed (keys, punctuation, an enum's tail), that token.
        Each is a point-mass proposal the constrained target accepts with
        probability one. The matcher stays where it was (the tokens after the
        first are followed on a copy: a state the engine finds at a dead end
        stays there, so only this state's own dead end may mark it)."""
        forced, state = [], self._state
        while len(forced) < limit and not self.dead_end:
            allowed = np.flatnonzero(np.unpackbits(self._mask(state).view(np.uint8), bitorder="little"))
            if len(allowed) != 1 or state.is_error():  # at a dead end the engine allows an end of sequence
                break
            forced.append(int(allowed[0]))
            if forced[-1] in self.grammar.vocabulary.eos:  # nothing follows an end
                break
            state = state.deep_copy() if state is self._state else state
            state.consume_token(forced[-1])
        return forced


_EXECUTOR: list = []  # llguidance's thread pool, made on first use


def _executor() -> llguidance.LLExecutor:
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]


def verify_masks(matchers: Sequence["Matcher | None"], proposals, vocab_size: int, limits=None) -> np.ndarray:
    """Bits ``[B, W, ceil(V/32)]`` for a verify of ``proposals [B, W - 1]``:
    row ``b``'s position ``j`` allows what its grammar allows after its
    committed tokens and ``proposals[b, :j]``; rows whose matcher is None
    allow every token. With ``limits [B]`` (the proposals each row may keep)
    positions past ``limits[b]``, which the verify never reads, allow every
    token and cost nothing. Masks are computed in parallel (llguidance's
    executor, along each row's proposals, each matcher rolled back after)."""
    proposals = np.asarray(proposals).astype(np.int64)
    if limits is not None:  # an id past any vocabulary ends a row's proposals where it stands
        kept = np.arange(proposals.shape[1]) < np.asarray(limits)[:, None]
        proposals = np.where(kept, proposals, np.iinfo(np.int32).max)
    if proposals.ndim != 2 or len(proposals) != len(matchers):
        raise ValueError(f"proposals of shape {proposals.shape} for {len(matchers)} rows: need [rows, width - 1]")
    width = proposals.shape[1] + 1
    masks = np.full((len(matchers), width, mask_words(vocab_size)), 0xFFFFFFFF, np.uint32)
    # A row at a dead end keeps every token: it ends now, and whatever it emits is cut by its matcher.
    live = [(b, m) for b, m in enumerate(matchers) if m is not None and not m.dead_end]
    if len({id(m) for _, m in live}) < len(live):
        raise ValueError("one matcher serves two rows: give each row its own (Grammar.matcher(), Matcher.copy())")
    if not live:
        return masks
    vocabulary = live[0][1].grammar.vocabulary
    engine = np.full((len(live) * width, vocabulary.engine_words), -1, np.int32)
    jobs = [(m._state, i * width, tokens) for i, ((_, m), tokens) in
            enumerate(zip(live, _known(proposals[[b for b, _ in live]], vocabulary)))]
    # The engine takes rows with proposals and rows without apart. Along a proposal it works on a copy:
    # a proposal may lead where the grammar admits nothing, and a state found there stays there.
    along = [(state.deep_copy(), start, tokens) for state, start, tokens in jobs if tokens]
    if along:
        _executor().unsafe_compute_mask_ptr_with_draft_token(along, engine.ctypes.data, engine.shape[1] * 4,
                                                             len(engine))
    if len(along) < len(jobs):
        _executor().unsafe_compute_mask_ptr([job[:2] for job in jobs if not job[2]], engine.ctypes.data,
                                            engine.shape[1] * 4, len(engine))
    masks[[b for b, _ in live]] = vocabulary.widened(engine).reshape(len(live), width, -1)
    return masks


def _known(proposals: np.ndarray, vocabulary: Vocabulary) -> list[list[int]]:
    """Each row's proposals up to its first id past the tokenizer's (a padding
    id of the model's vocabulary, which no grammar allows: masks after it
    stay open)."""
    past = np.concatenate([proposals >= vocabulary.engine.vocab_size, np.ones((len(proposals), 1), bool)], axis=1)
    ends = past.argmax(axis=1)
    return [row[:end] for row, end in zip(proposals.tolist(), ends.tolist())]


def next_masks(matchers: Sequence["Matcher | None"], vocab_size: int) -> np.ndarray:
    """Bits ``[B, ceil(V/32)]`` of the tokens each row may emit next (a
    prefill's first token, a verify of width 1)."""
    return verify_masks(matchers, np.zeros((len(matchers), 0), np.int64), vocab_size)[:, 0]


def draft_masks(matchers: Sequence["Matcher | None"], slots: int, vocab_size: int) -> np.ndarray:
    """Bits ``[B, slots, ceil(V/32)]`` for the draft: its first slot follows
    the row's grammar (the state after the anchor is known before the draft
    runs), the later slots are open. The draft's distributions are computed
    under exactly these masks, so the verify divides by the q that drafted."""
    masks = np.full((len(matchers), slots, mask_words(vocab_size)), 0xFFFFFFFF, np.uint32)
    masks[:, 0] = next_masks(matchers, vocab_size)
    return masks


def commit(matchers: Sequence["Matcher | None"], emitted: Sequence[Sequence[int]]) -> list[int]:
    """Advance each row's matcher by the tokens it committed this round (its
    accepted proposals and the target's token after them); returns, per
    row, how many of them its grammar allows (all of them for rows without
    a constraint)."""
    return [len(tokens) if m is None else m.commit(tokens) for m, tokens in zip(matchers, emitted)]
