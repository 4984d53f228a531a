"""``dspark serve`` through a real client: the ``openai`` package against a server this module starts
(and, per hybrid family, one serving a tiny hybrid target: recurrent layers beside attention).

Breaks tried, and the tests that catch them:
- a finished request storing its cache under every committed token even when
  the last round went past the reply (``Decoder._kept_cache`` without the
  states from before that round): the stored recurrent state then serves no
  follow-up, test_hybrid_conversation_resumes_from_its_stored_state[lfm2 / qwen3_5];
- that cache keeping the length from before the round but the recurrent
  states after it (``row_cache`` not given the earlier states): the same
  test (the second answer differs from mlx-lm's).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import urllib.error
import urllib.request

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.checkpoints import load_tokenizer
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.store import load as load_store
from helpers import build_draft, build_target, free_port, mlx_lm_greedy
from numerics import fp32_bound
from hybrids import HYBRID_SHAPES, hybrid_draft_config
from published import qwen3_pair, qwen_tokenizer

openai = pytest.importorskip("openai")

MARKER = "zebra-quartz-91"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    return root


@contextmanager
def running_server(root, max_batch: int, verify: str | int = "auto", launcher: tuple = (), extra: tuple = ()):
    """``dspark serve`` of ``root/target`` + ``root/draft`` (started through
    ``launcher``, e.g. ``mlx.launch -n 2``): ``(base url, process, log)``;
    stopped on leaving, whatever happened (killed if SIGTERM does not end it)."""
    port = free_port()
    log = root / "server.log"
    process = subprocess.Popen(
        [*launcher, sys.executable, "-m", "dspark_fn.cli", "serve", "--model", str(root / "target"), "--draft", str(root / "draft"),
         "--port", str(port), "--max-batch", str(max_batch), "--max-context", "512", "--dtype", "float32",
         "--width", str(verify), *extra],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ, DSPARK_FN_CACHE=str(root / "costs")),
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                get_json(base + "/health")
                break
            except OSError:
                if process.poll() is not None:
                    break
                time.sleep(0.2)
        else:
            pytest.fail("server did not start: " + log.read_text())
        if process.poll() is not None:
            pytest.fail("server exited: " + log.read_text())
        yield base, process, log
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def server(pair):
    # planned at the prior's costs: the decisions, and so a seeded sampled reply, the same every run
    with running_server(pair, max_batch=4, extra=("--costs", "prior")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def library(pair):
    """The same pair in this process, for reference outputs."""
    params = dspark_fn.catalog.load_named(str(pair / "target"), str(pair / "draft"), dtype=__import__("mlx.core").core.float32)[0]
    tokenizer = load_tokenizer(pair / "target")
    return params, tokenizer


def detokenized(tokenizer, tokens: list) -> str:
    """Text as the server's streaming detokenizer makes it (stop tokens left out)."""
    detokenizer, stops = tokenizer.detokenizer, set(stop_tokens(tokenizer))
    for token in tokens:
        if token not in stops:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def continued(tokenizer, prompt: list, tokens: list) -> str:
    """A completion's text: what ``tokens`` (stop tokens left out) add to the decoded prompt."""
    stops = set(stop_tokens(tokenizer))
    head = tokenizer.decode(prompt)
    whole = tokenizer.decode(prompt + [t for t in tokens if t not in stops])
    assert whole.startswith(head)
    return whole[len(head) :]


def reference_tokens(library, prompt: list, max_tokens: int) -> list:
    params, tokenizer = library
    stops = stop_tokens(tokenizer)
    return [t for e in dspark_fn.generate(params, prompt, max_tokens, stop_tokens=stops) for t in e.emitted]


def reference_text(library, text: str, max_tokens: int) -> str:
    tokenizer = library[1]
    return detokenized(tokenizer, reference_tokens(library, chat_tokens(tokenizer, text), max_tokens))


def chat(client, text: str, **options):
    options.setdefault("temperature", 0)
    return client.chat.completions.create(model=options.pop("model", MODEL), messages=[{"role": "user", "content": text}],
                                          **options)


MODEL = None


@pytest.fixture(scope="module", autouse=True)
def model_name(pair):
    global MODEL
    MODEL = str(pair / "target")


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = get_json(server[0] + "/health")
    assert health["status"] == "ok" and health["active"] == 0


def test_greedy_chat_equals_the_library(client, library):
    reply = chat(client, "hello world", max_tokens=24)
    assert reply.choices[0].message.content == reference_text(library, "hello world", 24)
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 0
    assert reply.model_extra["dspark"]["rounds"] >= 1
    assert reply.system_fingerprint.startswith("dspark_fn ") and f"target {MODEL}; draft {MODEL[:-len('target')]}draft" \
        in reply.system_fingerprint


def test_stream_carries_the_same_text(client, library):
    stream = chat(client, "the quick brown fox", max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference_text(library, "the quick brown fox", 20)
    assert chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_concurrent_requests_each_equal_their_run_alone(server, client, library):
    """Six requests on a server of four rows: the batch grows to four while
    they run, each reply equals its run alone, and once they are done the
    batch shrinks: a request that then runs alone runs in a batch of one."""
    texts = ["hello", "lazy dog jumps", "def add(a, b)", "brown fox", "world world", "quick"]
    replies = [None] * len(texts)

    def ask(i):
        replies[i] = chat(client, texts[i], max_tokens=30).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    batches = set()
    while any(t.is_alive() for t in threads):
        batches.add(get_json(server[0] + "/health")["batch"])
    for t in threads:
        t.join()
    assert replies == [reference_text(library, t, 30) for t in texts]
    assert max(batches) == 4
    alone = threading.Thread(target=ask, args=(0,))
    alone.start()
    batches = set()
    while alone.is_alive():
        batches.add(get_json(server[0] + "/health")["batch"])
    assert batches == {1}


def test_text_completions_and_usage(client, library):
    params, tokenizer = library
    reply = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0)
    prompt = tokenizer.encode("hello world")
    tokens = reference_tokens(library, prompt, 10)
    assert reply.choices[0].text == continued(tokenizer, prompt, tokens)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(tokens)


def test_seeded_sampling_is_reproducible(client):
    runs = [chat(client, "hello", max_tokens=20, temperature=1.0, seed=7).choices[0].message.content for _ in range(2)]
    other = chat(client, "hello", max_tokens=20, temperature=1.0, seed=8).choices[0].message.content
    assert runs[0] == runs[1] and len(runs[0]) > 0
    assert other != runs[0] or len(runs[0]) < 3


def test_n_choices(client):
    reply = chat(client, "hello", max_tokens=12, temperature=1.0, seed=3, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]


def test_stop_strings_cut_the_text(client, library):
    full = reference_text(library, "hello world", 40)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    reply = chat(client, "hello world", max_tokens=40, stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_a_growing_conversation_reuses_its_prefix(client, library):
    params, tokenizer = library
    first = [{"role": "user", "content": "tell me about the lazy dog and the quick brown fox"}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=30, temperature=0)
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "and the world?"}]
    reply = client.chat.completions.create(model=MODEL, messages=second, max_tokens=20, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens > 16
    assert reply.model_extra["dspark"]["prompt_cache_hit"]
    prompt = list(tokenizer.apply_chat_template(second, add_generation_prompt=True))
    assert reply.choices[0].message.content == detokenized(tokenizer, reference_tokens(library, prompt, 20))


BAD = {
    "unknown model": ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "not served here"),
    "missing messages": ({"max_tokens": 3}, 400, "'messages' must be a non-empty list"),
    "top_k past the vocabulary": ({"messages": [{"role": "user", "content": "hi"}], "top_k": 10_000_000_000}, 400,
                                  "'top_k' must be <= "),
    "max_tokens overflowing a float": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e300}, 400,
                                       "'max_tokens' must be an integer"),
    "stream_options not an object": ({"messages": [{"role": "user", "content": "hi"}], "stream_options": "yes"},
                                     400, "'stream_options' must be an object"),
    "a number as a text part": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
                                "'messages.0.content.0.text' must be a string"),
    "max_tokens zero": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    "max_tokens past the context": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400,
                                    "exceed the context"),
    "prompt longer than the context": ({"messages": [{"role": "user", "content": "hello world " * 400}]}, 400,
                                       "the context holds 512"),
    "bad temperature": ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "'temperature' must be >= 0"),
    "bad top_p": ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "'top_p' must be > 0"),
    "image content": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                      400, "this target (qwen3) takes no images"),
    "audio content": ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
                      400, "'text' and 'image_url' parts (no audio or files)"),
    "top_logprobs without logprobs": ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
                                      "'top_logprobs' needs 'logprobs': true"),
    "too many top_logprobs": ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                               "top_logprobs": 21}, 400, "'top_logprobs' must be <= 20"),
    "xml output": ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400,
                   "response_format 'xml' is not supported: its 'type' is one of text, json_object, json_schema"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400,
                     "unknown role 'wizard': a message's role is one of system, developer, user, assistant, tool"),
}


def test_a_response_continued_by_id_reuses_the_cached_prompt(client, library):
    """``client.responses.create`` on the real engine: the reply is the
    library's, and its continuation by ``previous_response_id`` is served
    from the prompt cache (``cached_tokens``)."""
    text = "tell me about the lazy dog and the quick brown fox"
    first = client.responses.create(model=MODEL, input=text, max_output_tokens=12, temperature=0)
    assert first.output_text == reference_text(library, text, 12)
    streamed = client.responses.create(model=MODEL, input=text, max_output_tokens=12, temperature=0, stream=True)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == first.output_text
    second = client.responses.create(model=MODEL, input="and the world?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens > first.usage.input_tokens


def test_an_anthropic_message_equals_the_chat_completion(server, client, library):
    """The same conversation through the ``anthropic`` client (whole and
    streamed) and through chat completions: the same greedy text."""
    anthropic = pytest.importorskip("anthropic")
    messages = [{"role": "user", "content": "tell me about the lazy dog"}]
    chat_reply = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be kind."}] +
                                                messages, max_tokens=20, temperature=0)
    claude = anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # this client sends sampling settings as extra body fields
    message = claude.messages.create(model=MODEL, system="Be kind.", messages=messages, max_tokens=20,
                                     extra_body=greedy)
    assert message.content[0].text == chat_reply.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat_reply.choices[0].finish_reason]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat_reply.usage.prompt_tokens
    with claude.messages.stream(model=MODEL, system="Be kind.", messages=messages, max_tokens=20,
                                extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == message.content[0].text


def log_softmax_reference(pair, prompt: list, tokens: list) -> np.ndarray:
    """mlx-lm's (float32) log-softmax of the target's logits at each of ``tokens``."""
    from mlx_lm.utils import load_model

    model, _ = load_model(pair / "target")
    model.set_dtype(mx.float32)
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(scores)


def test_chat_log_probs_are_the_targets(client, library, pair):
    """Each token's log-probability is mlx-lm's log-softmax of the target's
    logits there; the top ones are its most likely, in order; a stream
    carries the same, chunk by chunk."""
    params, tokenizer = library
    text = "tell me about the lazy dog"
    prompt = chat_tokens(tokenizer, text)
    tokens = reference_tokens(library, prompt, 16)
    reply = chat(client, text, max_tokens=16, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    shown = [i for i, t in enumerate(tokens) if t not in set(stop_tokens(tokenizer))]
    expected = log_softmax_reference(pair, prompt, tokens)
    assert len(content) == len(shown)
    bound = fp32_bound(expected, layers=8, reduction=320)
    for entry, position in zip(content, shown):
        assert abs(entry.logprob - expected[position, tokens[position]]) <= bound
        values = [top.logprob for top in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert abs(values[0] - expected[position].max()) <= bound
    stream = chat(client, text, max_tokens=16, logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # the second run reuses the cached prompt:
    assert all(abs(a.logprob - b.logprob) <= bound for a, b in zip(streamed, content))  # sums in another order


def test_completion_log_probs_in_the_legacy_layout(client, library, pair):
    params, tokenizer = library
    prompt = tokenizer.encode("the quick brown fox")
    tokens = reference_tokens(library, prompt, 8)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    log_probs = reply.choices[0].logprobs
    expected = log_softmax_reference(pair, prompt, tokens)
    shown = [i for i, t in enumerate(tokens) if t not in set(stop_tokens(tokenizer))]
    bound = fp32_bound(expected, layers=8, reduction=320)
    assert len(log_probs.token_logprobs) == len(shown) == len(log_probs.top_logprobs)
    assert all(abs(v - expected[p, tokens[p]]) <= bound for v, p in zip(log_probs.token_logprobs, shown))
    assert all(len(top) <= 2 for top in log_probs.top_logprobs)
    assert reply.choices[0].text == "".join(log_probs.tokens)


def test_sampled_log_probs_follow_the_temperature(client):
    """A drawing request is scored under its own (tempered) distribution: the same tokens' scores at a
    higher temperature are flatter."""
    cold = chat(client, "hello there", max_tokens=6, temperature=0.5, seed=3, logprobs=True, top_logprobs=2)
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in cold.choices[0].logprobs.content)
    spread = [e.top_logprobs[0].logprob - e.top_logprobs[1].logprob for e in cold.choices[0].logprobs.content]
    hot = chat(client, "hello there", max_tokens=6, temperature=1.5, seed=3, logprobs=True, top_logprobs=2)
    hot_spread = [e.top_logprobs[0].logprob - e.top_logprobs[1].logprob for e in hot.choices[0].logprobs.content]
    assert np.mean(hot_spread) < np.mean(spread)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, case):
    body, status, message = BAD[case]
    body = {"model": MODEL, **body} if "model" not in body else body
    code, reply = post(server[0] + "/v1/chat/completions", json.dumps(body).encode())
    assert code == status
    assert message in reply["error"]["message"]
    assert chat(client, "hello", max_tokens=2).choices[0].message is not None


def test_malformed_json(server):
    code, reply = post(server[0] + "/v1/chat/completions", b"{not json")
    assert code == 400 and "not valid JSON" in reply["error"]["message"]


# ---- prompt scoring: echo with log-probabilities, as lm-eval asks for it


def scored_completion(base: str, prompts: list, max_tokens: int, logprobs: int = 1, **extra) -> dict:
    status, body = post(base + "/v1/completions", json.dumps({
        "model": MODEL, "prompt": prompts, "echo": True, "logprobs": logprobs, "max_tokens": max_tokens,
        "temperature": 0, **extra}).encode())
    assert status == 200, body
    return body


def test_echo_scores_every_prompt_token_then_the_generated_one(server, library, pair):
    """lm-eval's request (``prompt: [[ids]], echo, logprobs: 1, max_tokens: 1``),
    two prompts at once: per choice, the prompt's text then the token's,
    one entry per prompt token (the first without a score, the others
    mlx-lm's log-softmax of the target's logits at the position before) and
    one for the generated token, whose top-1 is the greedy token; sums over
    ``[ctxlen:-1]`` are then the continuation's log-likelihood."""
    params, tokenizer = library
    prompts = [tokenizer.encode("the quick brown fox jumps"), tokenizer.encode("hello world, the lazy dog")]
    reply = scored_completion(server[0], prompts, max_tokens=1)
    assert [choice["index"] for choice in reply["choices"]] == [0, 1]
    bound = None
    for prompt, choice in zip(prompts, reply["choices"]):
        (token,) = reference_tokens(library, prompt, 1)
        expected = log_softmax_reference(pair, prompt[:1], prompt[1:] + [token])
        bound = bound or fp32_bound(expected, layers=8, reduction=320)
        log_probs = choice["logprobs"]
        assert len(log_probs["token_logprobs"]) == len(prompt) + 1 and log_probs["token_logprobs"][0] is None
        wanted = expected[np.arange(len(prompt)), prompt[1:] + [token]]
        assert np.abs(np.array(log_probs["token_logprobs"][1:]) - wanted).max() <= bound
        assert choice["text"] == tokenizer.decode(prompt) + continued(tokenizer, prompt, [token])
        assert "".join(log_probs["tokens"]) == choice["text"]
        assert log_probs["text_offset"][-1] == len(tokenizer.decode(prompt))
        assert [len(top) for top in log_probs["top_logprobs"][1:]] == [1] * len(prompt)
        greedy_top = log_probs["top_logprobs"][-1]
        assert list(greedy_top.values()) == [log_probs["token_logprobs"][-1]]  # lm-eval's is_greedy reads this
    assert reply["usage"]["prompt_tokens"] == sum(map(len, prompts)) and reply["usage"]["completion_tokens"] == 2


def test_echo_with_no_new_tokens_and_then_the_prompt_cache(server, client, library, pair):
    """``max_tokens: 0`` with echo scores the prompt and generates nothing;
    its cache is kept, so a request that continues the prompt reuses it."""
    params, tokenizer = library
    prompt = tokenizer.encode("tell me about the lazy dog and the quick brown fox, and the world")
    (choice,) = scored_completion(server[0], [prompt], max_tokens=0, logprobs=3)["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == tokenizer.decode(prompt)
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt)
    tops = choice["logprobs"]["top_logprobs"][1:]  # texts as keys: tokens that decode alike share one
    assert all(1 <= len(top) <= 3 and max(top.values()) >= lp for top, lp in zip(tops, choice["logprobs"]["token_logprobs"][1:]))
    follow = client.completions.create(model=MODEL, prompt=prompt + tokenizer.encode(" again"), max_tokens=4,
                                       temperature=0)
    assert follow.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 1


def test_echo_with_a_row_generates_as_without(server, client, library):
    """Echo with several new tokens: the scored prompt's cache is the row's
    prefix, and the tokens are those of the same request without echo."""
    params, tokenizer = library
    prompt = tokenizer.encode("the lazy dog")
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    (choice,) = scored_completion(server[0], [prompt], max_tokens=6, logprobs=0)["choices"]
    assert choice["text"] == tokenizer.decode(prompt) + plain.choices[0].text
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + len(plain.choices[0].logprobs.tokens)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == choice["text"]


def test_a_client_that_leaves_frees_its_row(server, client):
    stream = chat(client, "hello world", max_tokens=400, stream=True)
    next(iter(stream))
    stream.close()
    for _ in range(100):
        if get_json(server[0] + "/health")["active"] == 0:
            break
        time.sleep(0.1)
    assert get_json(server[0] + "/health")["active"] == 0


def test_prompts_are_not_logged_and_sigterm_stops_cleanly(server, client):
    """SIGTERM finishes or cancels an in-flight stream (its last chunk says
    which), the server shuts down without a traceback, and no prompt text
    reached the log."""
    base, process, log = server
    chat(client, f"please remember {MARKER}", max_tokens=3)
    streaming = iter(chat(client, "hello world", max_tokens=400, stream=True))
    next(streaming)
    process.send_signal(signal.SIGTERM)
    chunks = list(streaming)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    text = log.read_text()
    assert MARKER not in text and "Traceback" not in text


# ---- a hybrid target: recurrent states in the batch and in the prompt cache

HYBRID_NEW_TOKENS = 21
# first-turn lengths whose last round commits accepted drafts past the reply (asserted below)
FIRST_TURN = {"lfm2": 22, "qwen3_5": 21}
OPENING = "tell me about the lazy dog and the quick brown fox"


def memorising_draft(directory, config: dict, stream: list) -> None:
    """A draft whose Markov head knows ``stream`` by heart: after each of its
    tokens it proposes the next one (right all along that stream, as a
    trained draft often is, and wrong elsewhere)."""
    vocab, last = config["vocab_size"], config["num_hidden_layers"] - 1
    build_draft(directory, hybrid_draft_config(config, layers=1, taps=(0, last - 1), block_size=4, markov_rank=vocab),
                seed=1)
    table = np.zeros((vocab, vocab), np.float32)
    for token, following in zip(stream, stream[1:]):
        table[token] = 0.0
        table[token, following] = 1e4  # far above any logit of the random draft
    weights = mx.load(str(directory / "model.safetensors"))
    weights["markov_head.markov_w1.weight"] = mx.eye(vocab)
    weights["markov_head.markov_w2.weight"] = mx.array(table.T)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5"])
def hybrid(request, tmp_path_factory):
    """A tiny hybrid pair served at verify width 4 (a chat tokenizer; the
    draft knows the target's answer to ``OPENING``), mlx-lm's model of its
    target, and its tokenizer."""
    root = tmp_path_factory.mktemp(request.param)
    config = dict(HYBRID_SHAPES[request.param], vocab_size=320)
    model = build_target(root / "target", config, seed=3, vector_spread=0.4)
    qwen_tokenizer(root / "target")
    tokenizer = load_tokenizer(root / "target")
    opening = chat_tokens(tokenizer, OPENING)
    memorising_draft(root / "draft", config, opening + mlx_lm_greedy(model, opening, 2 * HYBRID_NEW_TOKENS))
    with running_server(root, max_batch=2, verify=4) as (base, _, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        yield client, base, model, tokenizer, str(root / "target"), FIRST_TURN[request.param]


def greedy_reply(model, tokenizer, prompt: list, max_tokens: int) -> list:
    """mlx-lm's greedy reply to ``prompt``, cut after a stop token as the server cuts it."""
    tokens, stops = mlx_lm_greedy(model, prompt, max_tokens), set(stop_tokens(tokenizer))
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))]


def test_hybrid_concurrent_requests_equal_mlx_lm_greedy(hybrid):
    """Two chats decoded together in one batch of two rows, each as mlx-lm alone."""
    client, base, model, tokenizer, name, _ = hybrid
    texts = ["hello world", "the lazy dog jumps over the quick brown fox"]
    replies, batches = [None, None], set()

    def ask(i):
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": texts[i]}],
                                               max_tokens=HYBRID_NEW_TOKENS, temperature=0)
        replies[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        batches.add(get_json(base + "/health")["batch"])
    for t in threads:
        t.join()
    expected = [greedy_reply(model, tokenizer, chat_tokens(tokenizer, text), HYBRID_NEW_TOKENS) for text in texts]
    assert replies == [detokenized(tokenizer, tokens) for tokens in expected]
    assert max(batches) == 2


def test_hybrid_conversation_resumes_from_its_stored_state(hybrid):
    """The second turn of a conversation (as token ids: the first prompt, the
    reply as sent, a new user turn) starts from the first turn's stored
    recurrent states and answers as mlx-lm does from scratch. The first
    turn's last round committed drafts past the reply: what is stored is the
    state before that round."""
    client, base, model, tokenizer, name, first_turn = hybrid
    opening = chat_tokens(tokenizer, OPENING)
    answer = client.completions.create(model=name, prompt=opening, max_tokens=first_turn, temperature=0)
    reply = greedy_reply(model, tokenizer, opening, first_turn)
    assert answer.choices[0].text == continued(tokenizer, opening, reply)
    assert answer.model_extra["dspark"]["acceptance_rate"] > 0.5  # the draft knows this answer
    follow_up = opening + reply + chat_tokens(tokenizer, "and the world?")
    second = client.completions.create(model=name, prompt=follow_up, max_tokens=HYBRID_NEW_TOKENS, temperature=0)
    assert second.model_extra["dspark"]["prompt_cache_hit"]
    assert len(opening) < second.usage.prompt_tokens_details.cached_tokens < len(opening) + len(reply)
    assert second.choices[0].text == continued(tokenizer, follow_up, greedy_reply(model, tokenizer, follow_up, HYBRID_NEW_TOKENS))


def test_hybrid_echo_scores_the_prompt_and_generates_as_mlx_lm(hybrid):
    """Echo with log-probabilities and several new tokens on a recurrent
    target: the prompt scored as mlx-lm's log-softmax, the tokens after it
    mlx-lm's greedy ones (the scored prefill's states are those after the
    whole prompt, so the row does not go on from them cut short)."""
    client, base, model, tokenizer, name, _ = hybrid
    prompt = chat_tokens(tokenizer, "the lazy dog jumps over the quick brown fox")
    status, reply = post(base + "/v1/completions", json.dumps({
        "model": name, "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 8, "temperature": 0}).encode())
    (choice,) = reply["choices"]
    answer = greedy_reply(model, tokenizer, prompt, 8)
    assert choice["text"] == tokenizer.decode(prompt) + continued(tokenizer, prompt, answer)
    logits = model(mx.array([prompt]))[0, :-1].astype(mx.float32)
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[np.arange(len(prompt) - 1), prompt[1:]]
    served = np.array(choice["logprobs"]["token_logprobs"][1 : len(prompt)])
    assert np.abs(served - expected).max() <= fp32_bound(expected, layers=6, reduction=320)


# ---- a reply that reaches its stop token


@pytest.fixture(scope="module")
def stopping(tmp_path_factory):
    """A tiny qwen3 pair served at verify width 4 whose draft knows the
    target's greedy answer to ``OPENING`` (so rounds carry several tokens),
    and whose end-of-turn token is that answer's token k, chosen where the
    round that emits token k - 1 emits token k too (read from the library's
    own rounds); the server's stop token is then reached inside a round,
    one past a budget of k tokens. ``(base url, tokenizer, prompt, answer up to k)``."""
    from dspark_fn.driver import Decoder
    from helpers import target_config

    root = tmp_path_factory.mktemp("stopping")
    config = target_config("qwen3", vocab=320, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16)
    model = build_target(root / "target", config, seed=3, vector_spread=0.4)
    qwen_tokenizer(root / "target")
    tokenizer = load_tokenizer(root / "target")
    prompt = tokenizer.encode(OPENING)
    answer = mlx_lm_greedy(model, prompt, 40)
    memorising_draft(root / "draft", config, prompt + answer)
    params = dspark_fn.catalog.load_named(str(root / "target"), str(root / "draft"), dtype=mx.float32)[0]
    decoder = Decoder(params, 1, width=4)
    ends = [len(decoder.insert([prompt]).emitted[0])]
    while ends[-1] < len(answer):
        ends.append(ends[-1] + len(decoder.step().emitted[0]))
    firsts = set(ends)  # the index of each round's first token
    special = set(stop_tokens(tokenizer)) | set(tokenizer.encode("<|endoftext|><|im_start|>"))
    k = next(k for k in range(3, len(answer)) if k not in firsts and answer[k] not in answer[:k] + prompt
             and answer[k] < len(tokenizer._tokenizer) and answer[k] not in special)
    settings = json.loads((root / "target" / "tokenizer_config.json").read_text())
    settings["eos_token"] = tokenizer._tokenizer.convert_ids_to_tokens(answer[k])
    (root / "target" / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = load_tokenizer(root / "target")
    assert stop_tokens(tokenizer) == [answer[k]]
    with running_server(root, max_batch=2, verify=4) as (base, _, _):
        yield base, tokenizer, prompt, answer[: k + 1]


def test_log_probs_of_a_reply_ending_at_its_stop_token_list_its_text_only(stopping):
    base, tokenizer, prompt, answer = stopping
    status, reply = post(base + "/v1/completions", json.dumps({
        "prompt": prompt, "max_tokens": 30, "temperature": 0, "logprobs": 0}).encode())
    (choice,) = reply["choices"]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == len(answer)  # the stop token counted, not shown
    assert choice["text"] == continued(tokenizer, prompt, answer)
    assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"]) == len(answer) - 1


def test_a_stop_token_one_past_the_budget_ends_by_length(stopping):
    """The round that emits the budget's last token carries the stop token
    next: the reply ends by its length, and one token more ends by the stop."""
    base, tokenizer, prompt, answer = stopping
    for budget, finish in ((len(answer) - 1, "length"), (len(answer), "stop")):
        status, reply = post(base + "/v1/completions", json.dumps({
            "prompt": prompt, "max_tokens": budget, "temperature": 0}).encode())
        assert (reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]) == (finish, budget)
        assert reply["dspark"]["acceptance_rate"] > 0  # rounds of several tokens


def test_echo_lists_a_generated_stop_token(stopping):
    """lm-eval reads one entry past the prompt: when the next token is the
    stop token, that entry is the stop token's."""
    base, tokenizer, prompt, answer = stopping
    context = prompt + answer[:-1]
    status, reply = post(base + "/v1/completions", json.dumps({
        "prompt": [context], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}).encode())
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["token_logprobs"]) == len(context) + 1
    assert choice["logprobs"]["tokens"][-1] == tokenizer.decode([answer[-1]])
    assert choice["text"] == tokenizer.decode(context)


# ---- overload: a bounded queue


BURST = ["hello", "lazy dog jumps", "brown fox", "world world", "quick", "the dog"]


def burst(base: str) -> tuple[list, list]:
    """``BURST`` as concurrent chat requests, started together: each one's
    ``(status, body, headers, seconds)``, and the queue lengths /health showed meanwhile."""
    outcomes, barrier = [None] * len(BURST), threading.Barrier(len(BURST))

    def ask(i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": BURST[i]}], "max_tokens": 24,
                "temperature": 0}
        request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        barrier.wait()
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                outcomes[i] = (response.status, json.loads(response.read()), {}, time.monotonic() - start)
        except urllib.error.HTTPError as error:
            outcomes[i] = (error.code, json.loads(error.read()), dict(error.headers), time.monotonic() - start)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(BURST))]
    for thread in threads:
        thread.start()
    waiting = []
    while any(thread.is_alive() for thread in threads):
        health = get_json(base + "/health")
        assert health["status"] == "ok"
        waiting.append(health["queue"]["waiting"])
    for thread in threads:
        thread.join()
    return outcomes, waiting


def test_a_burst_past_the_queue_is_refused_at_once_and_the_rest_answered(pair, library):
    """Twice ``--max-queue`` requests at once on a server of one row, twice:
    those past the queue get 429 with Retry-After within a second, the
    others answer as the library does; /health counts the refusals, never
    shows more waiting than the bound, and the resident memory after the
    second burst is within 5 % of that after the first."""
    max_queue, refusals, memory = len(BURST) // 2, 0, []
    with running_server(pair, max_batch=1, extra=("--max-queue", str(max_queue))) as (base, _, _):
        for _ in range(2):
            outcomes, waiting = burst(base)
            refused = [o for o in outcomes if o[0] == 429]
            answered = [(i, o) for i, o in enumerate(outcomes) if o[0] == 200]
            assert len(refused) + len(answered) == len(BURST) and len(refused) >= len(BURST) - max_queue - 1
            assert len(answered) >= max_queue and max(waiting) <= max_queue
            for status, body, headers, seconds in refused:
                assert seconds < 1 and headers["retry-after"] == "1" and body["error"]["code"] == "queue_full"
            for i, (_, body, _, _) in answered:
                assert body["choices"][0]["message"]["content"] == reference_text(library, BURST[i], 24)
            refusals += len(refused)
            health = get_json(base + "/health")
            assert health["queue"]["refused"] == refusals
            assert health["queue"]["waiting"] == 0 and health["active"] == 0
            memory.append(health["memory"]["resident_bytes"])
    assert memory[1] <= memory[0] * 1.05


def test_a_store_fed_by_the_server_answers_a_repeated_request(pair, library, tmp_path):
    """``dspark serve --store PATH --store-learn``: the first answer joins the
    store, the same request again verifies the store's proposals (its rounds
    reported under "store"), both answers are the library's, and the store
    is saved to PATH when the server stops. The server says on stderr when
    it accepts requests and when it has stopped."""
    path = tmp_path / "answers.npz"
    with running_server(pair, max_batch=2, extra=("--store", str(path), "--store-learn")) as (base, process, log):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        replies = [chat(client, "count with me", max_tokens=24) for _ in range(2)]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    said = log.read_text()
    assert f"dspark serve: ready on {base}/v1 (model " in said
    assert "dspark serve: stopped (" in said and "for 2 requests)" in said
    expected = reference_text(library, "count with me", 24)
    assert [reply.choices[0].message.content for reply in replies] == [expected, expected]
    sources = [reply.model_extra["dspark"]["sources"] for reply in replies]
    assert "store" not in sources[0] and sources[1]["store"]["rounds"] > 0, sources
    saved = load_store(path, library[0].spec.target.vocab_size, MODEL)
    assert len(saved) > 0
