"""Two grammar engines for constrained decoding, measured side by side on the
embedded default's vocabulary (SmolLM2, 49,152 tokens): llguidance (installed
with mlx-vlm) and xgrammar (optional here: its PyPI package requires torch, so
it is measured from a side directory, never a dependency).

For each JSON Schema below (shaped like real requests: an issue tracker's
record, a tool call, an order with SKU patterns, a recursive tree through
``$ref``, a discriminated union, a map, nullable fields) and each engine:

- coverage: does it compile, accept a valid instance token by token and end
  in an accepting state, and reject an instance that breaks one keyword?
  ("enforced"; "ignored" when the broken instance passes, "error" when it
  refuses the schema, with the message);
- compile time: the grammar built from the schema (median of 5, no cache);
- mask time per token: along the valid instance, the allowed-token bitmask
  computed and the token consumed (median over tokens and repeats);
- masks along a proposal: the bitmasks of the 6 positions a verify of width
  6 reads (the state after each proposed token, then rolled back).

    python bench/grammar_engines.py
    PYTHONPATH=/path/to/xgrammar-and-torch python bench/grammar_engines.py   # both engines
"""

import json
import statistics
import time

import numpy as np

from dspark_fn import gguf
from workloads import median_seconds

VOCAB = 49152
WIDTH = 6
REPEATS = 5

USER = {"type": "object", "properties": {"login": {"type": "string"}, "id": {"type": "integer", "minimum": 1}},
        "required": ["login", "id"], "additionalProperties": False}

SCHEMAS = {
    "issue (nested, enums, arrays, nullable $ref)": (
        {
            "type": "object",
            "$defs": {"user": USER},
            "properties": {
                "title": {"type": "string", "maxLength": 80},
                "state": {"enum": ["open", "closed"]},
                "labels": {"type": "array", "items": {"enum": ["bug", "docs", "feature"]}, "minItems": 1,
                           "maxItems": 3},
                "assignee": {"anyOf": [{"$ref": "#/$defs/user"}, {"type": "null"}]},
            },
            "required": ["title", "state", "labels", "assignee"],
            "additionalProperties": False,
        },
        '{"title": "Crash on start", "state": "open", "labels": ["bug"], "assignee": {"login": "ana", "id": 7}}',
        '{"title": "Crash on start", "state": "open", "labels": [], "assignee": null}',  # minItems
    ),
    "tool call (const name, enum argument)": (
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',  # enum
    ),
    "order (patterns, numeric bounds, maxItems)": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                            "price": {"type": "number", "exclusiveMinimum": 0},
                        },
                        "required": ["sku", "quantity", "price"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
                "date": {"type": "string", "format": "date"},
            },
            "required": ["id", "items", "date"],
            "additionalProperties": False,
        },
        '{"id": "ORD-004211", "items": [{"sku": "ABC-1234", "quantity": 2, "price": 9.5}], "date": "2024-05-01"}',
        '{"id": "ORD-004211", "items": [{"sku": "abc-1234", "quantity": 2, "price": 9.5}], "date": "2024-05-01"}',
    ),
    "tree (recursive $ref)": (
        {
            "$ref": "#/$defs/node",
            "$defs": {"node": {
                "type": "object",
                "properties": {"name": {"type": "string"},
                               "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["name", "children"],
                "additionalProperties": False,
            }},
        },
        '{"name": "root", "children": [{"name": "leaf", "children": []}]}',
        '{"name": "root", "children": [{"name": "leaf"}]}',  # required, one level down
    ),
    "shape (oneOf union, const tags)": (
        {
            "oneOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
                 "required": ["kind", "radius"], "additionalProperties": False},
                {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                                   "h": {"type": "number"}},
                 "required": ["kind", "w", "h"], "additionalProperties": False},
            ]
        },
        '{"kind": "rect", "w": 2, "h": 3.5}',
        '{"kind": "rect", "radius": 2}',
    ),
    "metrics (additionalProperties map, type arrays)": (
        {
            "type": "object",
            "properties": {"host": {"type": ["string", "null"]},
                           "values": {"type": "object", "additionalProperties": {"type": "number"}}},
            "required": ["host", "values"],
        },
        '{"host": null, "values": {"cpu": 0.25, "mem": 512}}',
        '{"host": null, "values": {"cpu": "high"}}',  # additionalProperties' type
    ),
    "person (allOf, string lengths)": (
        {
            "allOf": [
                {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 20}},
                 "required": ["name"]},
                {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]},
            ]
        },
        '{"name": "Li", "age": 31}',
        '{"name": "L", "age": 31}',  # minLength
    ),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    "not": ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"]},
            '{"x": 1}', '{"x": "s"}'),
    "dependentRequired": (
        {"type": "object", "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
         "dependentRequired": {"card": ["billing"]}},
        '{"card": "4111", "billing": "home"}', '{"card": "4111"}',
    ),
}


def default_tokenizer():
    """The embedded SmolLM2's tokenizer, read from its GGUF (no weights)."""
    _, metadata = gguf.read_gguf(gguf.find_smollm2_gguf())
    return gguf.tokenizer_from_metadata(metadata)._tokenizer


class Llguidance:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.setup = median_seconds(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB), 3)
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB)
        self.executor = llguidance.LLExecutor()
        self.eos = self.tokenizer.eos_token

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        failed, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise ValueError(messages[0])
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fresh(self, compiled):
        return compiled.deep_copy()

    def mask(self, matcher, out):
        self.np.fill_next_token_bitmask(matcher, out)

    def consume(self, matcher, token) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    def accepting(self, matcher) -> bool:
        return matcher.is_accepting()

    def proposal_masks(self, matcher, tokens, out):
        self.np.fill_next_token_bitmask_par_with_draft_tokens(self.executor, [(matcher, 0, tokens)], out)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf):
        import xgrammar

        self.xgr = xgrammar
        self.setup = median_seconds(lambda: xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB), 3)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB)
        self.eos = self.info.stop_token_ids[0]

    def compile(self, schema):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def fresh(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher, out):
        matcher.fill_next_token_bitmask(out)

    def consume(self, matcher, token) -> bool:
        return matcher.accept_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.accept_token(self.eos) or matcher.is_terminated()

    def proposal_masks(self, matcher, tokens, out):
        consumed = 0
        for row, token in enumerate([*tokens, None]):
            matcher.fill_next_token_bitmask(out, row)
            if token is None or not matcher.accept_token(token):
                break
            consumed += 1
        matcher.rollback(consumed)


def engine_buffer(engine, rows):
    if engine.name == "xgrammar":
        return engine.xgr.allocate_token_bitmask(rows, VOCAB)
    return np.full((rows, (VOCAB + 31) // 32), -1, np.int32)


def coverage(engine, hf, schema, valid, broken):
    try:
        compiled = engine.compile(schema)
    except Exception as error:  # the engine's own refusal, reported as it words it
        return "error: " + str(error).strip().splitlines()[-1][:70]

    def passes(text):
        matcher = engine.fresh(compiled)
        tokens = hf.encode(text, add_special_tokens=False)
        return all(engine.consume(matcher, t) for t in tokens) and engine.accepting(matcher)

    if not passes(valid):
        return "rejects a valid instance"
    return "ignored" if passes(broken) else "enforced"


def timings(engine, hf, schema, valid):
    compile_s = median_seconds(lambda: engine.compile(schema), REPEATS)
    compiled = engine.compile(schema)
    tokens = hf.encode(valid, add_special_tokens=False)
    out = engine_buffer(engine, WIDTH)
    per_token, per_proposal = [], []
    for _ in range(REPEATS):
        matcher = engine.fresh(compiled)
        for token in tokens:
            start = time.perf_counter()
            engine.mask(matcher, out)
            engine.consume(matcher, token)
            per_token.append(time.perf_counter() - start)
        matcher = engine.fresh(compiled)
        for i, token in enumerate(tokens):
            start = time.perf_counter()
            engine.proposal_masks(matcher, tokens[i : i + WIDTH - 1], out)
            per_proposal.append(time.perf_counter() - start)
            engine.consume(matcher, token)
    return compile_s, statistics.median(per_token), statistics.median(per_proposal), len(tokens)


def main():
    hf = default_tokenizer()
    engines = []
    for kind in (Llguidance, Xgrammar):
        try:
            engines.append(kind(hf))
        except ImportError as error:
            print(f"{kind.name}: not installed ({error})")
    for engine in engines:
        print(f"{engine.name}: tokenizer set up in {engine.setup * 1e3:.0f} ms")
    print()
    print("| schema | engine | coverage | compile ms | mask+consume µs/token | 6 masks along a proposal µs "
          "| tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, (schema, valid, broken) in SCHEMAS.items():
        for engine in engines:
            verdict = coverage(engine, hf, schema, valid, broken)
            if verdict.startswith("error") or verdict.startswith("rejects"):
                print(f"| {name} | {engine.name} | {verdict} | | | | |")
                continue
            compile_s, token_s, proposal_s, count = timings(engine, hf, schema, valid)
            print(f"| {name} | {engine.name} | {verdict} | {compile_s * 1e3:.2f} | {token_s * 1e6:.1f} | "
                  f"{proposal_s * 1e6:.1f} | {count} |")


if __name__ == "__main__":
    main()
