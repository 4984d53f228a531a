"""Structured output from ``dspark serve``, through real clients (the ``openai``
package, the ``openai-agents`` SDK, the ``anthropic`` package) against the
HTTP app and a real engine in this process (a tiny random target, whose
every reply is held to the grammar: nothing but the mask makes it valid).

``response_format`` json_schema and json_object replies parse and validate
and equal the library's constrained greedy (``generate(...,
constraint=...)``); ``tool_choice`` "required" and a named function give a
call that validates against the tool's parameters schema (whole and
streamed, ``finish_reason: "tool_calls"``), also through the Responses API
(``text.format``, ``tool_choice``) and Anthropic's Messages (``tool_choice``
any / tool); the agents SDK runs an agent with a required tool and one with
an output type; constrained and free requests share the batch, tracing
no kernel that free traffic does not; a constraint that cannot be enforced is a 400 naming it
before any row is taken; a thinking model is held from the end of its
thinking on.

Breaks tried, and what caught them: ``tool_choice`` "required" left
unconstrained (the call tests: the random model writes no call); the
constraint compiled after the request was queued (the bad-constraint test:
a row taken); the engine inserting rows without their grammar (the
equality test).
"""

import json
import threading

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.buffers import init_cache
from dspark_fn.chat import chat_tokens, stop_tokens, thinking_ahead
from dspark_fn.checkpoints import load_tokenizer
from dspark_fn.constraints import Constraint
from dspark_fn.kernel import TRACES
from dspark_fn.rounds import no_proposal, propose, undrafted, verify
from dspark_fn.sampling import Mode
from dspark_fn.schedule import CostCurve, width_buckets
from dspark_fn.serve.app import create_app
from dspark_fn.serve.engine import Engine, running_batch
from dspark_fn.serve.structured import Grammars, reply_constraint
from dspark_fn.serve.tools import Tools
from helpers import running
from published import CHATML, qwen3_pair, write_tokenizer

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast for a city",
                                            "parameters": SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "the time in a city",
                                          "parameters": {"type": "object", "properties": {
                                              "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                                              "additionalProperties": False}}}
HELLO = [{"role": "user", "content": "hello world"}]
TOKENS = 80
CALL_TOKENS = 200  # a call spelled in a tiny vocabulary: markers and keys take many tokens


# fixed costs: the policy drafts while drafts pay, with no timing
costs = CostCurve(0.2, {width: 1.0 + 0.05 * width for width in range(1, 33)})


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_structured")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    params = dspark_fn.catalog.load_named(str(root / "target"), str(root / "draft"),
                                          dtype=mx.float32)[0]
    return params, load_tokenizer(root / "target")


@pytest.fixture(scope="module")
def served(library):
    params, tokenizer = library
    engine = Engine(params, max_batch=4, max_context=2048, costs=costs)
    with running(create_app(engine, tokenizer, "m")) as base:
        yield engine, base
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def library_reply(library, constraint: Constraint, messages=HELLO) -> str:
    """The library's greedy reply under ``constraint`` (the server's prompt, stop tokens and grammar)."""
    params, tokenizer = library
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    stops = stop_tokens(tokenizer)
    grammar = Grammars(tokenizer, params.spec.target.vocab_size, stops).compile(constraint)
    tokens = [t for e in dspark_fn.generate(params, prompt, TOKENS, stop_tokens=stops, constraint=grammar,
                                            costs=costs) for t in e.emitted]
    return tokenizer.decode([t for t in tokens if t not in stops])


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def test_a_json_schema_reply_validates_and_equals_the_library(client, library):
    reply = client.chat.completions.create(model="m", messages=HELLO, max_tokens=TOKENS, temperature=0,
                                           response_format=schema_format(SCHEMA))
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    assert content == library_reply(library, Constraint.json_schema(SCHEMA))
    chunks = list(client.chat.completions.create(model="m", messages=HELLO, max_tokens=TOKENS, temperature=0,
                                                 response_format=schema_format(SCHEMA, strict=False), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    anything = client.chat.completions.create(model="m", messages=HELLO, max_tokens=TOKENS, temperature=0,
                                              response_format={"type": "json_object"}).choices[0]
    assert anything.message.content == library_reply(library, Constraint.json_object())
    if anything.finish_reason == "stop":  # a random model may not close its strings within the budget
        assert isinstance(json.loads(anything.message.content), dict)
    else:
        assert anything.finish_reason == "length" and anything.message.content.startswith("{")
    sampled = client.chat.completions.create(model="m", messages=HELLO, max_tokens=TOKENS, temperature=1.0, seed=3,
                                             n=3, response_format=schema_format(SCHEMA))
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def check_call(call, tools=(WEATHER, CLOCK)) -> None:
    """A call names one of ``tools`` and its arguments validate against that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_required_tool_call_validates_whole_and_streamed(client):
    ask = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=CALL_TOKENS,
               temperature=0, tools=[WEATHER, CLOCK])
    calls = client.chat.completions.create(tool_choice="required", **ask).choices[0].message.tool_calls
    assert calls  # parallel calls: the random model may call until its budget ends, every call valid
    for call in calls:
        check_call(call)
    ask["parallel_tool_calls"] = False  # one call, then the reply must end
    reply = client.chat.completions.create(tool_choice="required", **ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **ask))
    streamed = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **ask)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call(call)
    free = client.chat.completions.create(tool_choice="auto", **ask)  # nothing holds the random model to a call
    assert free.choices[0].finish_reason != "tool_calls"


def test_the_responses_and_messages_apis_hold_replies_too(client, served):
    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    response = client.responses.create(model="m", input="Weather?", tools=[tool], tool_choice="required",
                                       max_output_tokens=CALL_TOKENS, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
    formatted = client.responses.create(model="m", input="Weather?", max_output_tokens=TOKENS, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                                                         "strict": True}})
    jsonschema.validate(json.loads(formatted.output_text), SCHEMA)
    assert formatted.text.format.type == "json_schema"
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=served[1], api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "the forecast", "input_schema": SCHEMA}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        message = claude.messages.create(model="m", max_tokens=CALL_TOKENS, tools=tools, tool_choice=choice,
                                         messages=[{"role": "user", "content": "Weather?"}],
                                         extra_body={"temperature": 0})
        uses = [block for block in message.content if block.type == "tool_use"]
        assert uses and all(u.name == "get_weather" for u in uses)
        # parallel calls: the random model may call until its budget ends; one call, and the reply ends
        assert message.stop_reason == ("tool_use" if "disable_parallel_tool_use" in choice else message.stop_reason)
        assert message.stop_reason in ("tool_use", "max_tokens")
        for use in uses:
            jsonschema.validate(use.input, SCHEMA)


def test_an_agent_calls_its_required_tool_and_returns_its_output_type(served):
    """The ``openai-agents`` SDK, offline against this server, through chat
    completions and through the Responses API: an agent whose tool is
    required calls it with valid arguments; an agent with an output type
    gets a reply that validates into it."""
    agents = pytest.importorskip("agents")
    from typing import Literal

    from pydantic import BaseModel, Field

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: int = Field(ge=1, le=5)) -> str:
        """The forecast for a city."""
        calls.append((city, days))
        return "sunny"

    class Forecast(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7)

    client = openai.AsyncOpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)
    settings = dict(temperature=0.0, max_tokens=CALL_TOKENS)
    for model in (agents.OpenAIChatCompletionsModel(model="m", openai_client=client),
                  agents.OpenAIResponsesModel(model="m", openai_client=client)):
        caller = agents.Agent(name="caller", model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                              model_settings=agents.ModelSettings(tool_choice="required", **settings))
        result = agents.Runner.run_sync(caller, "Weather in Paris?")
        assert result.final_output == "sunny" and calls and calls[-1][0] in ("Paris", "Rome")
        typed = agents.Agent(name="typed", model=model, output_type=Forecast,
                             model_settings=agents.ModelSettings(**settings))
        assert isinstance(agents.Runner.run_sync(typed, "Weather in Oslo?").final_output, Forecast)


def free_kernels(params, capacity: int, max_batch: int) -> set:
    """The (kernel number, signature) of the draft at each batch size the
    engine runs and of the verify there at each width the planner may
    pick, with no masks, as the decoder calls them (no proposal at width
    1): traced in a thread of their own (kernels are
    compiled per thread, so each call there traces)."""
    def trace_each():
        for batch in sorted({running_batch(n, max_batch) for n in range(1, max_batch + 1)}):
            cache, anchors = init_cache(params, batch, capacity), mx.zeros((batch,), mx.int32)
            mx.eval(propose(params, cache, anchors))
            for width in width_buckets(params.spec.block_size):
                proposal = no_proposal(batch) if width == 1 else undrafted(params, batch, Mode())
                mx.eval(verify(params, cache, anchors, proposal, width, check_room=False))

    return traced_kernels(lambda: running_alone(trace_each))


def traced_kernels(work) -> set:
    """The (kernel number, signature) of each trace while ``work`` runs."""
    start = len(TRACES)
    work()
    return {(number, signature) for _, number, signature in TRACES[start:]}


def running_alone(work) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_constrained_and_free_requests_share_the_batch_without_new_kernels(client, served, library):
    """Requests with a schema, any JSON object and none at once, each equal
    to its run alone; every kernel traced for them is one free traffic
    traces: free requests (their prefills) or free batches of every size
    the engine runs at every width (which sizes and widths requests reach
    depends on when they arrive, so those are traced directly)."""
    engine, _ = served
    results = {}

    def ask(name, **options):
        results[name] = client.chat.completions.create(model="m", messages=HELLO, max_tokens=TOKENS, temperature=0,
                                                       **options).choices[0]

    def at_once(asks: dict) -> None:
        threads = [threading.Thread(target=ask, args=(name,), kwargs=options) for name, options in asks.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def free_crowds():
        for crowd in (1, 2, 3, 4, 3):
            at_once({f"warm {i}": {} for i in range(crowd)})

    free = traced_kernels(free_crowds) | free_kernels(library[0], engine.decoder.cache.capacity, engine.max_batch)
    start = len(TRACES)
    at_once({"schema": dict(response_format=schema_format(SCHEMA)), "free": {},
             "object": dict(response_format={"type": "json_object"})})
    new = [(name, [leaf for leaf in shapes if not leaf[0].startswith(("0.", "1."))])  # past the weights
           for name, number, shapes in TRACES[start:] if (number, shapes) not in free]
    assert not new, new
    assert results["schema"].message.content == library_reply(library, Constraint.json_schema(SCHEMA))
    assert results["object"].message.content == library_reply(library, Constraint.json_object())
    params, tokenizer = library
    prompt = chat_tokens(tokenizer, "hello world")
    stops = stop_tokens(tokenizer)
    free_reply = [t for e in dspark_fn.generate(params, prompt, TOKENS, stop_tokens=stops, costs=costs)
                  for t in e.emitted]
    assert results["free"].message.content == tokenizer.decode([t for t in free_reply if t not in stops])


@pytest.mark.parametrize("options, field, message", [
    (dict(response_format=schema_format({"type": "array", "uniqueItems": True})), "response_format",
     "cannot be enforced while generating"),
    (dict(response_format=schema_format({"type": "string", "minLength": 3, "maxLength": 1})), "response_format",
     "admits no value"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
     "json_schema needs"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], tool_choice="required"),
     "tools", "cannot be enforced while generating"),
    (dict(tool_choice="required"), "tool_choice", "offers no 'tools'"),
    (dict(response_format=schema_format({"enum": [f"value {i}" for i in range(20000)]})), "response_format",
     "over the limit"),
])
def test_a_constraint_that_cannot_be_enforced_is_a_400_before_a_row_is_taken(client, served, options, field,
                                                                             message):
    engine, _ = served
    taken = engine.taken
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, **options)
    assert refused.value.body["param"] == field and engine.taken == taken


def test_a_thinking_model_is_held_from_the_end_of_its_thinking(tmp_path):
    """Where the prompt leaves a thinking model: thinking off (the template
    closed it), inside its thinking (the template opened it), or free to
    think first; the reply's constraint is wrapped to start after the
    thinking in the last two, and the wrapped grammar takes free thinking
    then only the schema."""
    write_tokenizer(tmp_path, 300, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                    {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "bos_token": None,
                     "chat_template": CHATML})
    tokenizer = load_tokenizer(tmp_path)
    start, end = tokenizer.think_start_id, tokenizer.think_end_id
    head = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    closed = head + tokenizer.encode("<think>\n\n</think>\n\n")
    opened = head + tokenizer.encode("<think>\n")
    assert thinking_ahead(tokenizer, closed) is None
    assert thinking_ahead(tokenizer, opened) == (None, [end])
    assert thinking_ahead(tokenizer, head) == ([start], [end])
    form = schema_format(SCHEMA)
    assert reply_constraint(form, Tools(()), True, tokenizer, closed)[0] == Constraint.json_schema(SCHEMA)
    held, field = reply_constraint(form, Tools(()), True, tokenizer, head)
    assert field == "response_format" and held.kind == "after_thinking"
    grammar = Grammars(tokenizer, 320, [tokenizer.eos_token_id]).compile(held)
    answer = tokenizer.encode('{"city": "Rome", "days": 2}')
    for reply, whole in ((tokenizer.encode("<think>I guess</think>\n\n") + answer, True),
                         (answer, True), (tokenizer.encode("<think>x</think>no") + answer, False)):
        matcher = grammar.matcher()
        assert (matcher.commit(reply) == len(reply) and matcher.accepting) == whole
    matcher = grammar.matcher()
    matcher.commit(tokenizer.encode("<think>done</think>"))
    assert not (np.unpackbits(matcher.mask().view(np.uint8), bitorder="little")[: 320]
                [tokenizer.encode("no")[0]])
