"""The HTTP API (FastAPI): OpenAI's chat and text completions, Responses and
models, Anthropic's Messages (``messages.py``), and health.

Requests, read by ``validation`` (images in chat and Responses messages read
by ``images.py`` and laid out by the release's processor, off the event
loop), become engine ``Request``s; errors are
bodies in the API's own shape (``errors.py``) with a 4xx status, unknown
routes and methods included, and the server keeps serving. Keys and body
sizes are checked at the door (``access.py``), before a route reads a body. Streams are server-sent
events in OpenAI's chunk format ending with ``data: [DONE]``; a client that
goes away cancels its request, which frees its row at the next round.
Prompt text is never logged.

A failure of the decoding engine ends each request in its batch with a 500
(code ``engine_failure``; a stream gets an error event, then ends), and
``/health`` answers 503 until the engine runs again; an engine that cannot
start again shuts the server down (``serve`` returns 1).
"""

import asyncio
import json
import secrets
import sys
import time
import uuid
from importlib import metadata
from typing import NamedTuple

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import stop_tokens as tokenizer_stop_tokens
from ..stats import combined
from ..types import prompt_ids
from . import messages as anthropic
from . import responses, schema
from .access import TENANT, Door, tenant_scope, usable_keys
from .detokenizer import ContinuingText, text_after
from .engine import Engine, EngineFailure, QueueFull, QueueTimeout, Request
from .errors import ApiError, server_error
from .structured import Grammars
from .images import ImageSources
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .metrics import Counted, Metrics
from .tools import CallReader, openai_call
from .validation import Job, Reader


DEFAULT_MAX_BODY_BYTES = 16 << 20


class Piece(NamedTuple):
    """What a reply adds at once: its text, its end, its tokens' scores and tool calls."""

    text: str
    finish: str | None = None  # "stop", "length" or "tool_calls" on the last piece
    scored: list = []  # (token, TokenScore or None, the token before it) per listed token, when asked
    calls: list = []  # tool calls completed here (as their parser read them)
    stop: str | None = None  # the stop string that ended the reply
    detail: str | None = None  # why it stopped, where the API's finish reason does not say ("dead_end")


# Engine finishes that the APIs name otherwise: the reply ended without its stop token
FINISHES = {"cancelled": "stop", "dead_end": "stop"}


def system_fingerprint(target: str, draft: str | None) -> str:
    """Names what answers: the library's version, the target and the draft."""
    try:
        version = metadata.version("dspark-fn")
    except metadata.PackageNotFoundError:
        version = "unreleased"
    return f"dspark_fn {version}; target {target}; draft {draft or 'unnamed'}"


class Api:
    """Turns HTTP bodies into jobs for the engine and jobs' events into responses."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, fingerprint: str | None = None,
                 images: ImageSources = ImageSources(), tenants: bool = False):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.tenants = tenants  # keys in use: a reply tells nothing of what others' requests proposed
        self.metrics = Metrics(engine)
        self.fingerprint = fingerprint or system_fingerprint(model_name, None)
        self.stop_ids = frozenset(tokenizer_stop_tokens(tokenizer))
        grammars = engine.grammars if engine.grammars is not None else Grammars(
            tokenizer, engine.params.spec.target.vocab_size, self.stop_ids)
        self.reader = Reader(engine, tokenizer, model_name, grammars, images)
        self.conversations = responses.Conversations()

    # ---- running

    def submit(self, job: Job, scope: str = "") -> list[Request]:
        """``n`` requests per prompt, in choice order (prompt by prompt), all
        queued or none (a full queue: those queued already are cancelled),
        in the prompt-cache ``scope`` given (``access.tenant_scope``)."""
        prompts = [prompt for prompt in job.prompts for _ in range(job.n)]
        seeds = [job.seed + i if job.seed is not None else secrets.randbits(31) for i in range(len(prompts))]
        requests = [Request(prompt=prompt, max_tokens=job.max_tokens, sampling=job.sampling, seed=seed,
                            stop_tokens=self.stop_ids, top_log_probs=job.top_log_probs, score_prompt=job.scores_prompt,
                            constraint=job.constraint, grammar=job.grammar, scope=scope)
                    for prompt, seed in zip(prompts, seeds)]
        try:
            for request in requests:
                self.engine.submit(request)
        except QueueFull as full:
            for request in requests:
                request.cancel()
            raise ApiError(str(full), status=429, code="queue_full", kind="rate_limit_exceeded",
                           headers={"Retry-After": str(full.retry_after)}) from None
        return requests

    def echoed(self, job: Job, index: int) -> str | None:
        """The prompt text choice ``index`` starts with (completions with echo)."""
        return job.echo[index // job.n] if job.echo else None

    def prompt_scored(self, prompt: list, scores: list) -> list:
        """Echoed prompt tokens as scored entries: the first has no score."""
        return [(token, score, prompt[i - 1 : i]) for i, (token, score) in enumerate(zip(prompt, [None, *scores]))]

    async def pieces(self, job: Job, request: Request, echo: str | None = None):
        """``Piece``s as the request's tokens arrive: its text (after ``echo``,
        the prompt's text, when asked), its end, and the scores of the tokens
        that arrived since the last piece ([] when not asked; a stop token is
        listed only with echo, as it is not in the text). A stop string ends
        it (the text cut before it); a partial one is held back until it is
        ruled out. A completion's text continues its prompt's (a leading space
        kept); a chat reply's is a text of its own."""
        detokenizer = ContinuingText(self.tokenizer, request.prompt) if job.kind == "text" else self.tokenizer.detokenizer
        sent, scored, before, arrived = 0, [], prompt_ids(request.prompt)[-1:], None
        hold = max((len(s) for s in job.stop), default=1) - 1
        if echo is not None and not request.score_prompt:
            yield Piece(echo)
        while True:
            kind, value, scores = await request.events.receive()
            if kind == "error":
                raise EngineFailure(f"the decoding engine failed: {value}")
            if kind == "timeout":
                raise QueueTimeout(f"the request waited {value:g} s for a row without getting one; the server is "
                                   f"busy: retry later")
            if kind == "prompt":
                yield Piece(echo, scored=self.prompt_scored(request.prompt, scores))
                continue
            if kind == "done":
                detokenizer.finalize()
                yield Piece(detokenizer.text[sent:], FINISHES.get(value, value), scored,
                            detail=value if value in FINISHES else None)
                return
            arrived = self.metrics.arrived(request.submitted, arrived, len(value))
            for token, score in zip(value, scores or [None] * len(value)):
                hidden = token in self.stop_ids
                if not hidden:
                    detokenizer.add_token(token)
                if score is not None and (not hidden or echo is not None):
                    scored.append((token, score, before))
                before = [token]
            text = detokenizer.text
            found = [(i, s) for s in job.stop if (i := text.find(s, max(0, sent - hold))) >= 0]
            if found:
                cut, stop = min(found)
                request.cancel()
                yield Piece(text[sent:cut], "stop", scored, stop=stop)
                return
            ready = max(sent, len(text) - hold)
            if ready > sent:
                yield Piece(text[sent:ready], None, scored)
                sent, scored = ready, []

    def usage(self, job: Job, requests: list[Request]) -> dict:
        completion = sum(r.produced for r in requests)
        prompt = sum(len(r.prompt) for r in requests)
        acceptance = combined(r.acceptance for r in requests)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in requests)},
        }, {
            "tau": acceptance.tau,
            "acceptance_rate": acceptance.acceptance_rate,
            "rounds": acceptance.rounds,
            "prompt_cache_hit": any(r.cached_tokens for r in requests),
        } | ({} if self.tenants else {"sources": acceptance.sources()})  # a source's rates: others' answers

    def envelope(self, job: Job, ident: str, created: int, chunk: bool) -> dict:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
        return {"id": ident, "object": kind.get((job.kind, chunk), "text_completion"), "created": created,
                "model": self.model_name, "system_fingerprint": self.fingerprint}

    def choice(self, job: Job, index: int, piece: Piece, chunk: bool, calls: list = (), offset: int = 0) -> dict:
        """A choice (or a chunk's) of ``piece``; ``offset``: the choice's text before it."""
        log_probs = self.log_probs(job, piece.scored, offset) if job.top_log_probs is not None else None
        detail = {"finish_detail": piece.detail} if piece.detail else {}  # an extension field: why it stopped
        if job.kind == "text":
            return {"index": index, "text": piece.text, "finish_reason": piece.finish, "logprobs": log_probs} | detail
        body = {"role": "assistant", "content": piece.text or (None if calls else piece.text)}
        if calls:
            body["tool_calls"] = list(calls)
        return {"index": index, ("delta" if chunk else "message"): body, "finish_reason": piece.finish,
                "logprobs": log_probs} | detail

    async def replies(self, job: Job, request: Request, echo: str | None = None):
        """``pieces`` with the tool calls read out of the text; a reply that
        made calls finishes with "tool_calls"."""
        reader = CallReader(self.tokenizer, job.tools)
        async for piece in self.pieces(job, request, echo):
            content, calls = reader.feed(piece.text, final=piece.finish is not None)
            finish = "tool_calls" if piece.finish == "stop" and reader.calls else piece.finish
            yield piece._replace(text=content, finish=finish, calls=calls)

    async def whole(self, job: Job, request: Request, echo: str | None = None) -> Piece:
        """The whole reply as one ``Piece`` (every call, every score)."""
        text, scored, calls, last = "", [], [], Piece("")
        async for last in self.replies(job, request, echo):
            text, scored, calls = text + last.text, scored + last.scored, calls + last.calls
        return last._replace(text=text, scored=scored, calls=calls)

    def log_probs(self, job: Job, scored: list, offset: int = 0) -> dict:
        """OpenAI's ``logprobs`` object for ``scored`` ``[(token, TokenScore or
        None, the token before it)]``: chat's ``content`` list, or the
        completions' parallel lists (``text_offset`` from ``offset``). Each
        token's text, and its alternatives', is what it adds after the token
        before it."""
        top = job.top_log_probs
        texts = [[text_after(self.tokenizer, before, [token])] + [
            text_after(self.tokenizer, before, [t]) for t, _ in (score.top[:top] if score else [])
        ] for token, score, before in scored]
        if job.kind == "chat":
            def entry(text: str, log_prob: float) -> dict:
                return {"token": text, "logprob": log_prob, "bytes": list(text.encode())}

            return {"content": [
                entry(text, score.log_prob) | {"top_logprobs": [entry(t, v) for t, (_, v) in zip(alternatives, score.top)]}
                for (_, score, _), (text, *alternatives) in zip(scored, texts)
            ]}
        starts = [offset + sum(len(t[0]) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": [t[0] for t in texts],
                "token_logprobs": [score.log_prob if score else None for _, score, _ in scored],
                "top_logprobs": [{t: v for t, (_, v) in zip(alternatives, score.top)} if score else None
                                 for (_, score, _), (_, *alternatives) in zip(scored, texts)],
                "text_offset": starts}

    def ident(self, job: Job) -> str:
        return f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"

    async def complete(self, job: Job, requests: list[Request]) -> dict:
        created, ident = int(time.time()), self.ident(job)
        choices = []
        try:
            for index, request in enumerate(requests):
                reply = await self.whole(job, request, self.echoed(job, index))
                choices.append(self.choice(job, index, reply, False, [openai_call(c) for c in reply.calls]))
        finally:  # a failed choice, or a client gone: the others free their rows too
            for request in requests:
                request.cancel()
        usage, stats = self.usage(job, requests)
        return self.envelope(job, ident, created, False) | {"choices": choices, "usage": usage, "dspark": stats}

    async def stream(self, job: Job, requests: list[Request]):
        created, ident = int(time.time()), self.ident(job)
        head = self.envelope(job, ident, created, True)
        merged: asyncio.Queue = asyncio.Queue()

        async def follow(index: int, request: Request):
            made = 0  # calls streamed so far in this reply: each has its index
            try:
                async for piece in self.replies(job, request, self.echoed(job, index)):
                    entries = [openai_call(call, made + i) for i, call in enumerate(piece.calls)]
                    made += len(piece.calls)
                    await merged.put((index, piece, entries))
            except Exception as error:  # reported in the stream, as an error chunk
                await merged.put((index, error, None))

        tasks = [asyncio.create_task(follow(i, r)) for i, r in enumerate(requests)]
        try:
            if job.kind == "chat":
                for index in range(len(requests)):
                    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield sse(head | {"choices": [first]})
            finished, sent = 0, [0] * len(requests)
            while finished < len(requests):
                index, piece, calls = await merged.get()
                if calls is None:  # a stream that has begun still ends as streams end
                    yield sse(server_error(piece).body)
                    break
                finished += piece.finish is not None
                if not (piece.text or calls or piece.scored or piece.finish):
                    continue
                choice = self.choice(job, index, piece, True, calls, sent[index])
                sent[index] += len(piece.text)
                if job.kind == "chat" and piece.finish is not None and not piece.text and not calls:
                    choice["delta"] = {}
                yield sse(head | {"choices": [choice]})
            else:
                usage, stats = self.usage(job, requests)
                if job.include_usage:
                    yield sse(head | {"choices": [], "usage": usage, "dspark": stats})
            yield "data: [DONE]\n\n"
        finally:
            for request, task in zip(requests, tasks):
                request.cancel()  # a client that left frees its row at the next round
                task.cancel()

    # ---- the Responses API

    def response_job(self, body) -> tuple[Job, list]:
        chat, messages = responses.chat_request(body, self.conversations)
        return self.reader.job(chat, "chat"), messages

    async def respond(self, job: Job, requests: list[Request], body: dict, messages: list) -> dict:
        (request,) = requests
        ident = f"resp_{uuid.uuid4().hex}"
        try:
            reply = await self.whole(job, request)
        finally:
            request.cancel()
        text, calls = reply.text, [openai_call(call) for call in reply.calls]
        usage, _ = self.usage(job, [request])
        self.conversations.keep(ident, messages + responses.reply_messages(text, calls))
        output = responses.output_items(f"msg_{uuid.uuid4().hex}", text, calls)
        return responses.response_object(ident, body, self.model_name, output, responses.responses_usage(usage),
                                         "completed")

    async def respond_streaming(self, job: Job, requests: list[Request], body: dict, messages: list):
        (request,) = requests
        ident, message_id, event = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", responses.EventStream()
        start = responses.response_object(ident, body, self.model_name, [], None, "in_progress")
        text, calls = "", []
        try:
            yield event("response.created", response=start)
            async for piece in self.replies(job, request):
                if piece.text and not text:
                    yield event("response.output_item.added", output_index=0,
                                item=responses.message_item(message_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                if piece.text:
                    text += piece.text
                    yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                                delta=piece.text)
                calls += [openai_call(call) for call in piece.calls]
            if text:
                part = {"type": "output_text", "text": text, "annotations": []}
                yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0,
                            text=text)
                yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0,
                            part=part)
                yield event("response.output_item.done", output_index=0, item=responses.message_item(message_id, text))
            for index, call in enumerate(calls, start=1 if text else 0):
                item = responses.call_item(call)
                yield event("response.output_item.added", output_index=index,
                            item=responses.call_item(call, "", "in_progress"))
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            usage, _ = self.usage(job, [request])
            self.conversations.keep(ident, messages + responses.reply_messages(text, calls))
            output = responses.output_items(message_id, text, calls)
            yield event("response.completed", response=responses.response_object(
                ident, body, self.model_name, output, responses.responses_usage(usage), "completed"))
        except Exception as error:  # a stream that has begun ends with its final event: this one failed
            failed = server_error(error)
            yield event("response.failed", response=responses.response_object(
                ident, body, self.model_name, [], None, "failed") | {"error": {"code": failed.code or "server_error",
                                                                              "message": failed.message}})
        finally:
            request.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def error_response(error: Exception, path: str) -> JSONResponse:
    """The response of a request for ``path`` that failed, in its API's error
    shape; anything unforeseen is a 500 whose traceback goes to the log, not
    to the client (``errors.server_error``)."""
    if isinstance(error, ApiError):
        return error.response(path)
    if isinstance(error, (EngineFailure, QueueTimeout)):
        return server_error(error).response(path)
    if isinstance(error, ValueError):  # raised by the engine or sampling checks
        return ApiError(str(error)).response(path)
    if isinstance(error, RuntimeError):
        return ApiError(str(error), status=503, kind="server_error").response(path)
    return server_error(error).response(path)


def request_body(path: str) -> dict:
    """The OpenAPI request body of ``path``: its declared model (``schema``)."""
    return {"requestBody": schema.openapi_schemas()["bodies"][path]}


def openapi(app: FastAPI) -> dict:
    """The app's OpenAPI document, the request models among its components."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        document.setdefault("components", {}).setdefault("schemas", {}).update(schema.openapi_schemas()["components"])
        app.openapi_schema = document
    return app.openapi_schema


DISCONNECT_POLL = 0.5  # seconds between looks at whether a whole reply's client is still there


async def cancel_when_gone(http: HttpRequest, requests: list) -> None:
    """Cancel ``requests`` once their client has left (a whole reply waits
    with no stream to fail on: without this, a client gone would keep its
    rows decoding to ``max_tokens``)."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)
    for request in requests:
        request.cancel()


def create_app(engine: Engine, tokenizer, model_name: str, *, fingerprint: str | None = None, api_keys: tuple = (),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, image_sources: ImageSources = ImageSources()) -> FastAPI:
    keys = usable_keys([(key, "api_keys") for key in api_keys])  # now: the app is built at its first request
    api = Api(engine, tokenizer, model_name, fingerprint, image_sources, tenants=bool(keys))
    app = FastAPI(title="dspark serve", docs_url=None, redoc_url=None)
    app.openapi = lambda: openapi(app)
    app.add_middleware(Door, keys=keys, max_body_bytes=max_body_bytes)
    app.add_middleware(Counted, metrics=api.metrics)  # outside the door: refusals are counted too
    model = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "dspark"}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HttpRequest, error: StarletteHTTPException):
        """Unknown routes (404) and methods (405) answered in the API's error shape."""
        allowed = (error.headers or {}).get("allow")
        message = (f"{http.method} is not allowed on {http.url.path}; it takes {allowed}" if error.status_code == 405
                   else f"no route {http.method} {http.url.path} on this server" if error.status_code == 404
                   else str(error.detail))
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(error.status_code)
        return ApiError(message, status=error.status_code, code=code, headers=error.headers).response(http.url.path)

    async def answer(http: HttpRequest, read, whole, streamed):
        """Read the body (``read``: the endpoint's parsed body -> ``(job, extra)``,
        images processed here, off the event loop), admit its requests (a
        full queue is a 429, a server shutting down a 503: decided before any
        response starts), then answer whole or as a stream."""
        try:
            raw = await http.body()

            def parse_and_read():  # off the event loop: a large body parsed here holds no other request up
                body = schema.parsed_body(http.url.path, raw)
                return body, *read(body)

            body, job, *extra = await asyncio.to_thread(parse_and_read)
            requests = api.submit(job, tenant_scope(http.scope[TENANT], body.get("cache_salt")))
        except Exception as error:
            return error_response(error, http.url.path)
        if job.stream:
            return StreamingResponse(streamed(job, requests, *extra), media_type="text/event-stream")
        watch = asyncio.ensure_future(cancel_when_gone(http, requests))
        try:
            return JSONResponse(await whole(job, requests, *extra))
        except Exception as error:
            return error_response(error, http.url.path)
        finally:
            watch.cancel()

    @app.post("/v1/chat/completions", openapi_extra=request_body("/v1/chat/completions"))
    async def chat(http: HttpRequest):
        return await answer(http, lambda body: (api.reader.job(body, "chat"),), api.complete, api.stream)

    @app.post("/v1/completions", openapi_extra=request_body("/v1/completions"))
    async def completions(http: HttpRequest):
        return await answer(http, lambda body: (api.reader.job(body, "text"),), api.complete, api.stream)

    @app.post("/v1/responses", openapi_extra=request_body("/v1/responses"))
    async def create_response(http: HttpRequest):
        def read(body: dict) -> tuple:
            job, messages = api.response_job(body)
            return job, body, messages

        return await answer(http, read, api.respond, api.respond_streaming)

    @app.post("/v1/messages", openapi_extra=request_body("/v1/messages"))
    async def create_message(http: HttpRequest):
        return await answer(http, lambda body: (api.reader.job(anthropic.chat_request(body), "chat"),),
                            lambda job, requests: anthropic.answer(api, job, requests),
                            lambda job, requests: anthropic.answer_streaming(api, job, requests))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{ident:path}")
    async def one_model(ident: str, http: HttpRequest):
        if ident != model_name:
            return ApiError(f"model {ident!r} is not served here; this server serves {model_name!r}", "model",
                            status=404, code="model_not_found").response(http.url.path)
        return model

    @app.get("/health")
    async def health(http: HttpRequest):
        """Liveness for anyone; the engine's state too for a request with a valid key (or any, without keys)."""
        if engine.failure is not None:  # starting again after a failure, or dead
            status = "failed" if engine.dead else "restarting"
            return JSONResponse({"status": status, "error": engine.failure}, status_code=503)
        return {"status": "ok"} if http.scope[TENANT] is None else {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def metrics():
        return Response(api.metrics.exposition(), media_type=METRICS_TYPE)

    @app.on_event("shutdown")
    def stop_engine():
        engine.close()

    return app


class Server(uvicorn.Server):
    """uvicorn in front of an engine: SIGINT/SIGTERM end the requests in
    flight, then it shuts down; so does an engine that cannot start again.
    One line on stderr when it accepts requests (``ready``), one when it
    has stopped."""

    def __init__(self, config: uvicorn.Config, engine: Engine, ready: str = ""):
        super().__init__(config)
        self.engine, self.ready = engine, ready

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.ready:
            print(self.ready, file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None):
        """Shut down, then say so: here, since uvicorn ends the process with
        the signal that stopped it as soon as ``run`` returns."""
        await super().shutdown(sockets)
        served = self.engine.stats().get("served", {})
        print(f"dspark serve: stopped ({served.get('generated_tokens', 0)} tokens generated for "
              f"{self.engine.taken} requests)" + (f"; the engine failed: {self.engine.failure}"
                                                  if self.engine.dead else ""), file=sys.stderr, flush=True)

    def handle_exit(self, sig, frame):
        self.engine.cancel_all()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        return self.engine.dead or await super().on_tick(counter)


def serve(engine: Engine, tokenizer, model_name: str, host: str, port: int, on_stop=lambda: None, **options) -> int:
    """Serve until a signal (returns 0, unless uvicorn ends the process with
    that signal once it shut down) or an engine that cannot start again
    (returns 1); ``on_stop`` runs once the engine has stopped, either way;
    ``options``: ``create_app``'s."""
    app = create_app(engine, tokenizer, model_name, **options)
    app.on_event("shutdown")(on_stop)  # after the app's own, which stops the engine
    address = f"http://{host}:{port}/v1"
    ready = f"dspark serve: ready on {address} (model {model_name})"
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning"), engine, ready).run()
    return 1 if engine.dead else 0
