"""Tool calls through the ``openai`` client, against the real HTTP app in
front of a scripted engine (the replies are chosen by the test, so a call
can be forced): on the embedded default's chat template, which knows no
tools (they go into a system message, calls are read by mlx-lm's
``json_tools`` parser), and on a stand-in Qwen3 template that renders tools
itself. Tools are rendered into the prompt, a forced reply comes back as
``tool_calls`` (whole and streamed, with ``finish_reason: "tool_calls"``),
the tool's result goes into the next turn's prompt, and a call the parser
cannot read comes back as text with status 200.

Breaks tried, and what caught them:
- the reader not holding back a partial start marker: the streamed call's
  marker leaks into the content;
- ``tool_choice: none`` still rendering the tools: the prompt check.
"""

import json
import queue

import pytest

from dspark_fn.chat import stop_tokens
from dspark_fn.serve.app import create_app
from dspark_fn.serve.engine import Update
from dspark_fn.serve.structured import Grammars
from helpers import running
from published import write_tokenizer

openai = pytest.importorskip("openai")

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": {}}}
QWEN3_TOOLS = (  # Qwen3's template, its tool parts only
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nFor each call return <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ScriptedEngine:
    """The engine surface the app uses; each request gets the next scripted reply (token ids), then stops."""

    max_context, failure, dead = 4096, None, False

    class decoder:  # noqa: N801 - the attribute the app reads
        widest = 1

    def __init__(self, tokenizer):
        self.tokenizer, self.replies, self.prompts = tokenizer, queue.Queue(), []
        # what a constraint compiles against: the tokenizer's own vocabulary stands in for a model's
        self.grammars = Grammars(tokenizer, max(tokenizer.get_vocab().values()) + 1, stop_tokens(tokenizer))

    def reply(self, text: str) -> None:
        self.replies.put(self.tokenizer.encode(text, add_special_tokens=False))

    def submit(self, request):
        self.prompts.append(self.tokenizer.decode(request.prompt))
        tokens = self.replies.get_nowait()
        for start in range(0, len(tokens), 3):  # a few tokens a round, as decoding delivers them
            request.events.put(Update("tokens", tokens[start : start + 3]))
        request.produced = len(tokens)
        request.events.put(Update("done", "stop"))
        return request

    def stats(self) -> dict:
        return {}

    def cancel_all(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module", params=["embedded", "qwen3-template"])
def served(request, tmp_path_factory):
    if request.param == "embedded":
        from dspark_fn.catalog import load_target_named

        tokenizer = load_target_named(None)[2]
    else:
        from dspark_fn.checkpoints import load_tokenizer

        directory = tmp_path_factory.mktemp("qwen3_tools")
        write_tokenizer(directory, 300, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "bos_token": None,
                         "chat_template": QWEN3_TOOLS})
        tokenizer = load_tokenizer(directory)
        assert tokenizer.has_tool_calling  # mlx-lm reads this template's calls with its json_tools parser
    engine = ScriptedEngine(tokenizer)
    with running(create_app(engine, tokenizer, "m")) as base:
        yield engine, openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def ask(client, messages, **options):
    return client.chat.completions.create(model="m", messages=messages, **options)


def test_tools_are_rendered_and_a_call_comes_back(served):
    engine, client = served
    engine.reply(CALL)
    reply = ask(client, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, CLOCK])
    assert "get_weather" in engine.prompts[-1] and "the forecast for a city" in engine.prompts[-1]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_a_streamed_call_arrives_as_tool_call_deltas(served):
    engine, client = served
    engine.reply("Let me look. " + CALL)
    chunks = list(ask(client, [{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look. "
    assert [(call.index, call.function.name) for call in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_result_goes_into_the_next_turn(served):
    engine, client = served
    engine.reply("It is sunny.")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = ask(client, messages, tools=[WEATHER])
    assert "sunny, 21 C" in engine.prompts[-1] and '"Paris"' in engine.prompts[-1]
    assert reply.choices[0].message.content == "It is sunny." and reply.choices[0].finish_reason == "stop"


def test_a_call_the_parser_cannot_read_is_text(served):
    engine, client = served
    broken = '<tool_call>{"name": get_weather</tool_call>'
    engine.reply(broken)
    reply = ask(client, [{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_tool_choice_none_and_named(served):
    engine, client = served
    engine.reply("no tools")
    ask(client, [{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in engine.prompts[-1]
    engine.reply(CALL)
    ask(client, [{"role": "user", "content": "hi"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "get_weather" in engine.prompts[-1] and "get_time" not in engine.prompts[-1]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(client, [{"role": "user", "content": "hi"}], tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}})


# ---- the Responses API (the same app and engine)


def test_a_response_whole_and_its_continuation(served):
    engine, client = served
    engine.reply("Paris is the capital.")
    first = client.responses.create(model="m", input="Capital of France?", instructions="Be brief.",
                                    max_output_tokens=32)
    assert first.output_text == "Paris is the capital." and first.status == "completed"
    assert "Be brief." in engine.prompts[-1] and first.usage.output_tokens > 0
    engine.reply("About two million.")
    second = client.responses.create(model="m", input="Its population?", previous_response_id=first.id)
    assert second.output_text == "About two million."
    prompt = engine.prompts[-1]
    assert all(part in prompt for part in ("Capital of France?", "Paris is the capital.", "Its population?"))
    with pytest.raises(openai.NotFoundError, match="is not held by this server"):
        client.responses.create(model="m", input="hi", previous_response_id="resp_gone")


def test_a_response_calls_a_function_and_takes_its_output(served):
    engine, client = served
    engine.reply(CALL)
    tool = {"type": "function", "name": "get_weather", "description": "the forecast for a city",
            "parameters": WEATHER["function"]["parameters"]}
    response = client.responses.create(model="m", input="Weather in Paris?", tools=[tool])
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    engine.reply("Sunny.")
    after = client.responses.create(model="m", previous_response_id=response.id, tools=[tool],
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "sunny, 21 C"}])
    assert after.output_text == "Sunny." and "sunny, 21 C" in engine.prompts[-1]


def test_a_streamed_response_sends_the_typed_events(served):
    engine, client = served
    engine.reply("Looking. " + CALL)
    events = list(client.responses.create(model="m", input="Weather?", stream=True,
                                          tools=[{"type": "function", "name": "get_weather", "parameters": {}}]))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Looking. "
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris", "days": 2}]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "'input' must hold at least 1 item"),
    ({"input": [{"type": "image", "url": "x"}]}, "input items of type 'image' are not supported"),
    ({"input": "hi", "tools": [{"type": "web_search", "name": "search"}]}, "'tools.0.type' must be 'function'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "response_format json_schema needs"),
])
def test_bad_responses_get_openai_errors(served, body, message):
    _, client = served
    with pytest.raises(openai.BadRequestError, match=message):
        client.responses.create(model="m", **body)
