"""What each endpoint accepts, declared: one pydantic model per request body,
every field typed and bounded.

A body is first read as strict JSON (``strict_json``: no ``NaN`` or
``Infinity``, no number that overflows to one, nesting at most
``MAX_DEPTH`` deep), then parsed by its endpoint's model (``parsed``):
integers where integers are meant (``1.0`` is not a token count), numbers
finite and within their range, strings where strings are meant, lists and
strings no longer than their bound. The first violation is an ``ApiError``
naming the field by its path (``messages.0.content``) and what it takes.
Fields other clients send and this server does not read are let through
untouched; fields it declares but does not implement are refused when they
ask for something (``unimplemented``), never ignored. Bounds that depend on
the model served (``top_k`` up to the vocabulary, tokens within the
context) are the reader's (``validation``).

The models are also the app's OpenAPI schema (``openapi_schemas``).
"""

import json
import math
from functools import cache
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from .errors import ApiError

MAX_DEPTH = 64  # JSON nesting: a tool schema a few levels deep fits many times over
MAX_NODES = 300_000  # JSON objects and numbers in a body: 64 prompts of 4,096 token ids fit
MAX_INT = (1 << 63) - 1  # the largest integer any count or seed may be (past it: not a count)
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOPS = 4  # OpenAI's bound on stop strings
MAX_STOP_SEQUENCES = 16
MAX_CHOICES = 8  # n
MAX_PROMPTS = 64  # completions prompts in one request
MAX_TOP_LOG_PROBS = 20  # OpenAI's bound
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
NAME_LENGTH = 256  # model names, ids, tool names, roles


class TooManyNodes(ValueError):
    pass


def strict_json(raw: bytes):
    """``raw`` as JSON, or an ``ApiError``: refuses ``NaN``, ``Infinity``,
    numbers that overflow a float, invalid UTF-8, nesting past ``MAX_DEPTH``
    and more than ``MAX_NODES`` objects and numbers (counted as the parser
    meets them, so a body of a million small parts stops early: the parse
    holds the interpreter, and with it every other request, while it runs)."""
    nodes = [0]

    def counted(value):
        nodes[0] += 1
        if nodes[0] > MAX_NODES:
            raise TooManyNodes(f"the request body holds more than {MAX_NODES} JSON objects and numbers")
        return value

    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:32]} is out of range")
        return counted(value)

    try:
        body = json.loads(raw, parse_constant=no_constant, parse_float=finite,
                          parse_int=lambda text: counted(int(text)), object_pairs_hook=lambda pairs: counted(dict(pairs)))
    except TooManyNodes as error:
        raise ApiError(str(error)) from None
    except RecursionError:
        raise ApiError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise ApiError(f"the request body is not valid JSON: {error}") from None
    if nesting(body) > MAX_DEPTH:
        raise ApiError(f"the request body nests deeper than {MAX_DEPTH} levels")
    return body


def nesting(value) -> int:
    """How deep ``value``'s lists and objects nest (without recursion: the depth is what is checked)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_DEPTH:  # deeper than the bound already: no need to walk further
            pending.extend((child, depth + 1) for child in children)
    return deepest


# ---- field types

Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Seed = Annotated[int, Field(ge=-MAX_INT - 1, le=MAX_INT)]
Name = Annotated[str, Field(max_length=NAME_LENGTH)]
Salt = Annotated[str, Field(max_length=NAME_LENGTH)]  # cache_salt: a request's own prompt-cache scope (vLLM's field)
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TopLogProbs = Annotated[int, Field(ge=0, le=MAX_TOP_LOG_PROBS)]
JsonObject = dict[str, Any]  # free-form (a JSON schema, tool arguments): bounded by the body's size and depth


class Declared(BaseModel):
    """Strict types (no string read as a number, no float as an integer), finite
    numbers, other fields let through."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


# ---- OpenAI chat completions


class ImageUrl(Declared):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class OtherPart(Declared):
    """A part of a kind not declared here: refused by name where it is read."""

    type: Name


def by_type(**variants) -> Any:
    """A union of part models chosen by the part's ``type`` (``OtherPart`` for any other)."""
    def tag(value) -> str:  # not an identifier: error paths leave it out (``field_path``)
        kind = value.get("type") if isinstance(value, dict) else None
        return f"{kind}-part" if isinstance(kind, str) and kind in variants else "other-part"

    tagged = [Annotated[model, Tag(f"{kind}-part")] for kind, model in variants.items()]
    return Annotated[Union[tuple(tagged) + (Annotated[OtherPart, Tag("other-part")],)], Discriminator(tag)]


class TextPart(Declared):
    type: str
    text: str


class ImagePart(Declared):
    type: Literal["image_url"]
    image_url: str | ImageUrl


ContentPart = by_type(text=TextPart, image_url=ImagePart)


class CalledFunction(Declared):
    name: Name
    arguments: str | JsonObject = "{}"


class ToolCall(Declared):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Declared):
    role: Name  # refused by name in ``validation`` when it is none of the roles
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None


class FunctionSpec(Declared):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ChatTool(Declared):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Declared):
    name: Name


class NamedToolChoice(Declared):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(Declared):
    name: Name | None = None
    description: str | None = None
    schema_: JsonObject | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Declared):
    type: Name  # text, json_object or json_schema; others refused by name in ``structured``
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Declared):
    include_usage: bool = False


Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)]


class Sampled(Declared):
    """What chat and text completions share."""

    model: Name | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Count | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    cache_salt: Salt | None = None


class ChatRequest(Sampled):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogProbs | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


TokenIds = list[Count]


class CompletionRequest(Sampled):
    prompt: str | TokenIds | Annotated[list[Union[str, TokenIds]], Field(max_length=MAX_PROMPTS)] | None = None
    echo: bool | None = None
    logprobs: TopLogProbs | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None


# ---- OpenAI Responses


class InputImage(Declared):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: Name | None = None
    detail: Literal["auto", "low", "high"] | None = None


InputPart = by_type(input_text=TextPart, output_text=TextPart, text=TextPart, input_image=InputImage)


class InputItem(Declared):
    type: Name = "message"  # message, function_call or function_call_output; others refused by name
    role: Name | None = None
    content: str | Annotated[list[InputPart], Field(max_length=MAX_MESSAGES)] | None = None
    call_id: Name | None = None
    name: Name | None = None
    arguments: str | None = None
    output: Any = None  # a tool's output: text, or any JSON written back as text


class ResponsesTool(Declared):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class NamedResponsesTool(Declared):
    type: Literal["function"]
    name: Name


class TextFormat(Declared):
    type: Name
    name: Name | None = None
    description: str | None = None
    schema_: JsonObject | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(Declared):
    format: TextFormat | None = None


class ResponsesRequest(Declared):
    model: Name | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: Name | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedResponsesTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool | None = None
    store: bool | None = None
    user: str | None = None
    cache_salt: Salt | None = None


# ---- Anthropic Messages


class ToolUse(Declared):
    type: Literal["tool_use"]
    id: Name | None = None
    name: Name
    input: JsonObject = {}


class ToolResult(Declared):
    type: Literal["tool_result"]
    tool_use_id: Name | None = None
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] = ""
    is_error: bool | None = None


class ImageSource(Declared):
    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(Declared):
    type: Literal["image"]
    source: ImageSource


Block = by_type(text=TextPart, image=ImageBlock, tool_use=ToolUse, tool_result=ToolResult)


class AnthropicMessage(Declared):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_MESSAGES)]


class TextBlock(Declared):
    type: Literal["text"]
    text: str


class AnthropicTool(Declared):
    type: Name | None = None  # "custom" or none: server tools are refused by name in ``messages``
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    input_schema: JsonObject | None = None


class AnthropicToolChoice(Declared):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Declared):
    model: Name | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)]
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: TopP | None = None
    top_k: Count | None = None
    stream: bool | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: JsonObject | None = None
    cache_salt: Salt | None = None


ENDPOINTS = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
             "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest}


# ---- reading a body

PHRASES = {
    "greater_than_equal": "must be >= {ge}", "less_than_equal": "must be <= {le}", "greater_than": "must be > {gt}",
    "less_than": "must be < {lt}", "int_type": "must be an integer", "int_from_float": "must be an integer",
    "float_type": "must be a number", "finite_number": "must be a finite number", "bool_type": "must be true or false",
    "string_type": "must be a string", "list_type": "must be a list", "dict_type": "must be an object",
    "model_type": "must be an object", "missing": "is required", "literal_error": "must be {expected}",
    "too_long": "may hold at most {max_length} items", "too_short": "must hold at least {min_length} item(s)",
    "string_too_long": "may be at most {max_length} characters long",
    "string_too_short": "must be at least {min_length} characters long",
}


UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def field_path(location: tuple) -> str:
    """A pydantic error location as a field path: ``messages.0.content``
    (the alternatives of a union, named by their type, left out)."""
    kept = [str(part) for part in location if isinstance(part, int) or (
        part.isidentifier() and part[:1].islower() and part not in UNION_TAGS)]
    return ".".join(kept)


TYPE_ERRORS = ("int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type",
               "literal_error", "none_required")


def problem(error: dict, alternatives: list = ()) -> str:
    """One pydantic error as a sentence naming the field and what it takes;
    ``alternatives``: the other type errors at the same field (a union's
    alternatives), whose types are named with its own."""
    path = field_path(error["loc"]) or "the request body"
    said = " or ".join(dict.fromkeys(phrase(e).removeprefix("must be ") for e in [error, *alternatives]))
    said = said if said.startswith(("must", "may", "is ")) else f"must be {said}"
    given = error.get("input")
    shown = "" if error["type"] == "missing" or isinstance(given, (dict, list)) else f", got {short(given)}"
    return f"'{path}' {said}{shown}"


def phrase(error: dict) -> str:
    known = PHRASES.get(error["type"])
    return known.format(**error.get("ctx", {})) if known else error["msg"][0].lower() + error["msg"][1:]


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def parsed(model: type[Declared], body) -> Declared:
    """``body`` read by ``model``, or an ``ApiError`` (400) naming the first field at fault."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as invalid:
        errors = invalid.errors(include_url=False)
        # a union reports each alternative's complaint: the one that went deepest, or that is not about the
        # type, says most; where every alternative only says its type, all are named
        first = max(errors, key=lambda e: (len(field_path(e["loc"])), e["type"] not in TYPE_ERRORS))
        path = field_path(first["loc"])
        others = [e for e in errors if e is not first and field_path(e["loc"]) == path and e["type"] in TYPE_ERRORS] \
            if first["type"] in TYPE_ERRORS else []
        raise ApiError(problem(first, others), path.split(".")[0] or None) from None


def parsed_body(path: str, raw: bytes) -> dict:
    """The body of a request for ``path`` read as strict JSON and checked by
    that endpoint's model: the dict the readers take (fields as sent)."""
    body = strict_json(raw)
    parsed(ENDPOINTS[path], body)
    unimplemented(body)
    return body


def unimplemented(body: dict) -> None:
    """Declared fields that ask for what this server does not do are refused, never ignored."""
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            raise ApiError(f"'{name}' is not supported (only 0): the target's own distribution is sampled", name)
    if body.get("logit_bias"):
        raise ApiError("'logit_bias' is not supported: the target's own distribution is sampled", "logit_bias")


@cache
def openapi_schemas() -> dict:
    """The request models as OpenAPI components, and each endpoint's body referring to one."""
    template = "#/components/schemas/{model}"
    components: dict = {}
    bodies = {}
    for path, model in ENDPOINTS.items():
        schema = model.model_json_schema(ref_template=template, by_alias=True)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        bodies[path] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": template.format(model=model.__name__)}}}}
    return {"components": components, "bodies": bodies}
