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
to an llguidance grammar), so a new kind (tool calls in a model's format) is
one entry that builds a grammar from the others (Lark with ``%json``).
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


def _json_schema_grammar(source: str) -> str:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


def _lark_or_gbnf(text: str) -> str:
    return llguidance.grammar_from("grammar", text)  # GBNF is converted to Lark; Lark passes as it is


GRAMMARS: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema_grammar,
    "json_object": lambda _: llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}),
    "regex": llguidance.LLMatcher.grammar_from_regex,
    "grammar": _lark_or_gbnf,
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

    def copy(self) -> "Matcher":
        """An independent matcher in the same state (a fork)."""
        twin = Matcher(self.grammar, self._state.deep_copy())
        twin.refused = self.refused
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

    def mask(self) -> np.ndarray:
        """The tokens allowed next, ``[ceil(V/32)]`` uint32 bits."""
        vocabulary = self.grammar.vocabulary
        engine = np.zeros((1, vocabulary.engine_words), np.int32)
        if not self.dead_end:
            self._state.unsafe_compute_mask_ptr(engine.ctypes.data, engine.nbytes)
        return vocabulary.widened(engine)[0]

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here: while exactly
        one token is allowed (keys, punctuation, an enum's tail), that token.
        Each is a point-mass proposal the constrained target accepts with
        probability one; the matcher is left where it was."""
        forced, consumed = [], 0
        while len(forced) < limit and not self.dead_end:
            allowed = np.flatnonzero(np.unpackbits(self.mask().view(np.uint8), bitorder="little"))
            if len(allowed) != 1:
                break
            forced.append(int(allowed[0]))
            if forced[-1] in self.grammar.vocabulary.eos:  # nothing follows an end (and the engine
                break  # does not count one among the tokens it rolls back)
            self._state.consume_token(forced[-1])
            consumed += 1
        self._state.rollback(consumed)
        return forced


_EXECUTOR: list = []  # llguidance's thread pool, made on first use


def _executor() -> llguidance.LLExecutor:
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]


def verify_masks(matchers: Sequence["Matcher | None"], proposals, vocab_size: int) -> np.ndarray:
    """Bits ``[B, W, ceil(V/32)]`` for a verify of ``proposals [B, W - 1]``:
    row ``b``'s position ``j`` allows what its grammar allows after its
    committed tokens and ``proposals[b, :j]``; rows whose matcher is None
    allow every token. Masks are computed in parallel (llguidance's
    executor, along each row's proposals, each matcher rolled back after)."""
    proposals = np.asarray(proposals).astype(np.int64)
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
    along = [job for job in jobs if job[2]]  # the engine takes rows with proposals and rows without apart
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
