"""Grammars for the tests: tiny tokenizers whose vocabularies fit tiny random
targets, constraints over them, and the reference every constrained run is
held to: the target alone, decoded by mlx-lm with llguidance's mask applied
as a logits processor (the engine driven directly, not through
``dspark_fn.constraints``).
"""

import json
import re

import jsonschema
import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

import dspark_fn
from dspark_fn.constraints import GRAMMARS, Constraint, Vocabulary
from helpers import build_draft, build_target, draft_config, target_config

EOS = 0


class PieceTokenizer:
    """A tokenizer over a fixed list of pieces (id 0 the end of sequence), in
    llguidance's ``TokenizerWrapper`` protocol; encoding takes the longest
    piece first. Multi-character pieces give the grammar engine what real
    vocabularies give it: several tokenizations of one text."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.tokens = [piece.encode() for piece in pieces]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = EOS, None, [EOS]

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        ids, at = [], 0
        while at < len(text):
            best = max((i for i in range(1, len(self.pieces)) if text.startswith(self.pieces[i], at)),
                       key=lambda i: len(self.pieces[i]), default=None)
            if best is None:  # a character no piece holds has no token
                at += 1
                continue
            ids.append(best)
            at += len(self.pieces[best])
        return ids

    def text(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids if i != EOS)


# 127 pieces for a 128-token target: id 127 is a padding id no grammar allows.
JSON_PIECES = list(dict.fromkeys(
    ["<eos>"] + [chr(c) for c in range(32, 127)] + [
        '{"', '":', '",', '"}', ' "', '": ', "true", "false", "null", "name", '"]', '["', "kind", "tags", "size",
        "arguments", "unit", "city", "small", "large", "red", "blue", "<tool_call>", "</tool_call>", "get_weather",
        "celsius", "fahrenheit", '{"name":', "com", "org", ".com",
    ]
))
JSON_VOCAB = 128
COMPACT = {"whitespace_flexible": False}  # no free whitespace: a random model cannot pad forever

NESTED_SCHEMA = {
    "type": "object",
    "x-guidance": COMPACT,
    "properties": {
        "kind": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue", "green"]}, "maxItems": 3},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99},
                           "h": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["w", "h"],
            "additionalProperties": False,
        },
        "name": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"},
    },
    "required": ["kind", "tags", "size", "name"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8, "pattern": "^[A-Za-z ]+$"},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,5}@[a-z]{3,6}\.(com|org)"
TOOL_CALL = ('start: "<tool_call>" call "</tool_call>"\ncall: %json '
             + json.dumps(dict(TOOL_SCHEMA, **{"x-guidance": COMPACT})))

CONSTRAINTS = {
    "nested object": Constraint.json_schema(NESTED_SCHEMA),
    "regex": Constraint.regex(EMAIL),
    "tool call": Constraint.grammar(TOOL_CALL),
}

# The sampling harness's 32-token vocabulary and a grammar that changes the
# target's law at every position: characters alternate between a-d and e-h
# (so which pieces are legal depends on the phase), x, y, z and doubled
# letters never fit, and the end may come only after 24 characters.
SAMPLING_PIECES = ["<eos>", *"abcdefgh", "ab", "bc", "cd", "de", "ef", "fg", "gh", "ha", "abc", "cde", "efg", "gha",
                   "aa", "bb", "cc", "dd", "ee", "ff", "gg", "hh", "x", "y", "z"]
ALTERNATING = Constraint.regex("([a-d][e-h]){12,}")


def vocabulary(pieces: list[str], size: int) -> Vocabulary:
    return Vocabulary(PieceTokenizer(pieces), size)


def constrained_pair(root, block_size: int):
    """``(mlx-lm model, Params)``: a tiny random target over ``JSON_VOCAB`` tokens and a one-layer draft."""
    config = target_config("qwen3", vocab=JSON_VOCAB, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
    model = build_target(root / "target", config, seed=3)
    build_draft(root / "draft", draft_config(config, layers=1, taps=(0, 1), block_size=block_size), seed=4)
    return model, dspark_fn.load(root / "target", root / "draft")


class EngineMask:
    """llguidance driven directly: the allowed tokens after a sequence, as bools ``[V]``."""

    def __init__(self, constraint: Constraint, vocabulary: Vocabulary):
        self.grammar = GRAMMARS[constraint.kind](constraint.source)
        self.tokenizer, self.size = vocabulary.engine, vocabulary.size
        self.path = [llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)]  # the state after each token
        self.seen: list = []

    def after(self, tokens) -> np.ndarray:
        """The mask after ``tokens``; successive calls share their common prefix."""
        tokens = [int(t) for t in tokens]
        shared = next((i for i, (a, b) in enumerate(zip(tokens, self.seen)) if a != b),
                      min(len(tokens), len(self.seen)))
        del self.path[shared + 1:], self.seen[shared:]
        for token in tokens[shared:]:
            state = self.path[-1].deep_copy()
            state.consume_token(token)
            self.path.append(state)
            self.seen.append(token)
        return self.mask(self.path[-1])

    def along(self, rows: np.ndarray) -> np.ndarray:
        """``[N, T, V]``: the mask after each row's first ``t`` tokens, ``t < T``
        (rows visited in sorted order, so shared prefixes are walked once)."""
        out = np.zeros((*rows.shape, self.size), bool)
        previous = None
        for row in sorted(range(len(rows)), key=lambda r: rows[r].tolist()):
            start = 0
            if previous is not None:  # positions up to the first difference have the previous row's prefixes
                differ = np.flatnonzero(rows[row] != rows[previous]).tolist() + [rows.shape[1]]
                start = min(differ[0] + 1, rows.shape[1])
                out[row, :start] = out[previous, :start]
            for t in range(start, rows.shape[1]):
                out[row, t] = self.after(rows[row, :t])
            previous = row
        return out

    def mask(self, state) -> np.ndarray:
        bits = np.zeros((1, -(-self.tokenizer.vocab_size // 32)), np.int32)
        llguidance.numpy.fill_next_token_bitmask(state, bits)
        allowed = np.zeros(self.size, bool)
        unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool)
        allowed[: self.tokenizer.vocab_size] = unpacked[: self.tokenizer.vocab_size]
        return allowed


def mlx_lm_constrained_greedy(model, prompt: list, constraint: Constraint, vocabulary: Vocabulary, n: int) -> list:
    """The target alone, greedy, under the grammar: mlx-lm's ``generate_step``
    with llguidance's mask as a logits processor; ends at the end-of-sequence
    token (kept) or after ``n`` tokens."""
    from mlx_lm.generate import generate_step

    engine = EngineMask(constraint, vocabulary)

    def mask(tokens, logits):
        allowed = engine.after(np.array(tokens)[len(prompt):])
        return mx.where(mx.array(allowed), logits, -mx.inf)

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
                                  logits_processors=[mask]):
        out.append(int(token))
        if out[-1] == EOS:
            break
    return out


def check_valid(name: str, stream: list) -> None:
    """``stream`` (ids of ``JSON_PIECES``) ends with the end of sequence and its text satisfies ``CONSTRAINTS[name]``."""
    assert stream[-1] == EOS, f"{name}: no end of sequence"
    text = PieceTokenizer(JSON_PIECES).text(stream)
    if name == "nested object":
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    elif name == "regex":
        assert re.fullmatch(EMAIL, text), text
    else:
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
        jsonschema.validate(json.loads(text[len("<tool_call>"): -len("</tool_call>")]), TOOL_SCHEMA)
