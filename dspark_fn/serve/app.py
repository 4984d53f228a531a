"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, the Responses API, models, health.

Requests, read by ``validation``, become engine ``Request``s; errors are
OpenAI-style bodies (``{"error": {"message", "type", "param", "code"}}``)
with a 4xx status, and the server keeps serving. Streams are server-sent
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
import time
import uuid

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import stop_tokens as tokenizer_stop_tokens
from ..stats import combined
from . import responses
from .engine import Engine, EngineFailure, Request
from .errors import ApiError, server_error
from .tools import CallReader, openai_call
from .validation import Job, Reader


class Api:
    """Turns HTTP bodies into jobs for the engine and jobs' events into responses."""

    def __init__(self, engine: Engine, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.reader = Reader(engine, tokenizer, model_name)
        self.stop_ids = frozenset(tokenizer_stop_tokens(tokenizer))
        self.conversations = responses.Conversations()

    # ---- running

    def submit(self, job: Job) -> list[Request]:
        seeds = [job.seed + i if job.seed is not None else secrets.randbits(31) for i in range(job.n)]
        return [
            self.engine.submit(Request(prompt=job.prompt, max_tokens=job.max_tokens, sampling=job.sampling, seed=seed,
                                       stop_tokens=self.stop_ids, top_log_probs=job.top_log_probs))
            for seed in seeds
        ]

    async def pieces(self, job: Job, request: Request):
        """``(text, finish_reason or None, scores)`` as the request's tokens
        arrive (``scores``: the log-probabilities of the tokens that arrived
        since the last piece, stop tokens left out; [] when not asked);
        stop strings end it (text cut before them), and a partial stop
        string is held back until it is ruled out."""
        detokenizer, sent, scored = self.tokenizer.detokenizer, 0, []
        hold = max((len(s) for s in job.stop), default=1) - 1
        while True:
            kind, value, scores = await asyncio.to_thread(request.events.get)
            if kind == "error":
                raise EngineFailure(f"the decoding engine failed: {value}")
            if kind == "done":
                detokenizer.finalize()
                yield detokenizer.text[sent:], {"cancelled": "stop"}.get(value, value), scored
                return
            for token, score in zip(value, scores or [None] * len(value)):
                if token not in self.stop_ids:
                    detokenizer.add_token(token)
                    if score is not None:
                        scored.append((token, score))
            text = detokenizer.text
            cut = min((i for i in (text.find(s, max(0, sent - hold)) for s in job.stop) if i >= 0), default=None)
            if cut is not None:
                request.cancel()
                yield text[sent:cut], "stop", scored
                return
            ready = max(sent, len(text) - hold)
            if ready > sent:
                yield text[sent:ready], None, scored
                sent, scored = ready, []

    def usage(self, job: Job, requests: list[Request]) -> dict:
        completion = sum(r.produced for r in requests)
        rounds = [r.acceptance for r in requests]
        emitted, count = sum(a.emitted for a in rounds), sum(a.rounds for a in rounds)
        accepted, drafted = sum(a.accepted for a in rounds), sum(a.drafted for a in rounds)
        return {
            "prompt_tokens": len(job.prompt) * job.n,
            "completion_tokens": completion,
            "total_tokens": len(job.prompt) * job.n + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in requests)},
        }, {
            "tau": emitted / count if count else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "rounds": count,
            "prompt_cache_hit": any(r.cached_tokens for r in requests),
            "sources": combined(rounds).sources(),
        }

    def envelope(self, job: Job, ident: str, created: int, chunk: bool) -> dict:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
        return {"id": ident, "object": kind.get((job.kind, chunk), "text_completion"), "created": created,
                "model": self.model_name}

    def choice(self, job: Job, index: int, text: str, finish: str | None, chunk: bool, scored: list,
               calls: list = ()) -> dict:
        log_probs = self.log_probs(job, scored) if job.top_log_probs is not None else None
        if job.kind == "text":
            return {"index": index, "text": text, "finish_reason": finish, "logprobs": log_probs}
        body = {"role": "assistant", "content": text or (None if calls else text)}
        if calls:
            body["tool_calls"] = list(calls)
        return {"index": index, ("delta" if chunk else "message"): body, "finish_reason": finish, "logprobs": log_probs}

    async def replies(self, job: Job, request: Request):
        """``pieces`` with the tool calls read out: ``(content, finish, scores,
        calls)``; a reply that made calls finishes with "tool_calls"."""
        reader = CallReader(self.tokenizer, job.tools)
        async for piece, finish, scores in self.pieces(job, request):
            content, calls = reader.feed(piece, final=finish is not None)
            if finish == "stop" and reader.calls:
                finish = "tool_calls"
            yield content, finish, scores, calls

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def log_probs(self, job: Job, scored: list) -> dict:
        """OpenAI's ``logprobs`` object for ``scored`` ``[(token, TokenScore)]``:
        chat's ``content`` list, or the completions' parallel lists."""
        top = job.top_log_probs
        if job.kind == "chat":
            def entry(token: int, log_prob: float) -> dict:
                text = self.token_text(token)
                return {"token": text, "logprob": log_prob, "bytes": list(text.encode())}

            return {"content": [entry(token, score.log_prob) | {"top_logprobs": [entry(t, v) for t, v in score.top[:top]]}
                                for token, score in scored]}
        texts = [self.token_text(token) for token, _ in scored]
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [score.log_prob for _, score in scored],
                "top_logprobs": [{self.token_text(t): v for t, v in score.top[:top]} for _, score in scored],
                "text_offset": offsets}

    async def complete(self, job: Job) -> dict:
        requests = self.submit(job)
        created, ident = int(time.time()), f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        choices = []
        try:
            for index, request in enumerate(requests):
                text, finish, scored, calls = "", None, [], []
                async for piece, finish, scores, made in self.replies(job, request):
                    text, scored, calls = text + piece, scored + scores, calls + made
                choice = self.choice(job, index, text, finish, False, scored, [openai_call(c) for c in calls])
                choices.append(choice)
        finally:  # a failed choice, or a client gone: the others free their rows too
            for request in requests:
                request.cancel()
        usage, stats = self.usage(job, requests)
        return self.envelope(job, ident, created, False) | {"choices": choices, "usage": usage, "dspark": stats}

    async def stream(self, job: Job):
        requests = self.submit(job)
        created, ident = int(time.time()), f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        head = self.envelope(job, ident, created, True)
        merged: asyncio.Queue = asyncio.Queue()

        async def follow(index: int, request: Request):
            made = 0  # calls streamed so far: each has its index
            try:
                async for piece, finish, scores, calls in self.replies(job, request):
                    entries = [openai_call(call, made + i) for i, call in enumerate(calls)]
                    made += len(calls)
                    await merged.put((index, piece, finish, scores, entries))
            except Exception as error:  # reported in the stream, as an error chunk
                await merged.put((index, error, "error", [], []))

        tasks = [asyncio.create_task(follow(i, r)) for i, r in enumerate(requests)]
        try:
            if job.kind == "chat":
                for index in range(job.n):
                    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield sse(head | {"choices": [first]})
            finished = 0
            while finished < job.n:
                index, piece, finish, scores, calls = await merged.get()
                if finish == "error":
                    yield sse(server_error(piece).body)
                    return
                finished += finish is not None
                if not (piece or calls or scores or finish):
                    continue
                choice = self.choice(job, index, piece, finish, True, scores, calls)
                if job.kind == "chat" and finish is not None and not piece and not calls:
                    choice["delta"] = {}
                yield sse(head | {"choices": [choice]})
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

    async def reply(self, job: Job, request: Request):
        """The whole reply's ``(text, calls)`` as chat ``tool_calls`` entries, for the Responses API."""
        text, calls = "", []
        async for piece, _, _, made in self.replies(job, request):
            text, calls = text + piece, calls + [openai_call(call) for call in made]
        return text, calls

    async def respond(self, job: Job, body: dict, messages: list) -> dict:
        (request,) = self.submit(job)
        ident = f"resp_{uuid.uuid4().hex}"
        try:
            text, calls = await self.reply(job, request)
        finally:
            request.cancel()
        usage, _ = self.usage(job, [request])
        self.conversations.keep(ident, messages + responses.reply_messages(text, calls))
        output = responses.output_items(f"msg_{uuid.uuid4().hex}", text, calls)
        return responses.response_object(ident, body, self.model_name, output, responses.responses_usage(usage),
                                         "completed")

    async def respond_streaming(self, job: Job, body: dict, messages: list):
        (request,) = self.submit(job)
        ident, message_id, event = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", responses.EventStream()
        start = responses.response_object(ident, body, self.model_name, [], None, "in_progress")
        text, calls = "", []
        try:
            yield event("response.created", response=start)
            async for piece, _, _, made in self.replies(job, request):
                if piece and not text:
                    yield event("response.output_item.added", output_index=0,
                                item=responses.message_item(message_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                if piece:
                    text += piece
                    yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                                delta=piece)
                calls += [openai_call(call) for call in made]
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
        finally:
            request.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def json_body(http: HttpRequest):
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not valid JSON: {error}") from None


def error_response(error: Exception) -> JSONResponse:
    """The OpenAI-style response of a request that failed; anything unforeseen propagates (a 500)."""
    if isinstance(error, ApiError):
        return error.response()
    if isinstance(error, EngineFailure):
        return server_error(error).response()
    if isinstance(error, ValueError):  # raised by the engine or sampling checks
        return ApiError(str(error)).response()
    if isinstance(error, RuntimeError):
        return ApiError(str(error), status=503, kind="server_error").response()
    raise error


def create_app(engine: Engine, tokenizer, model_name: str) -> FastAPI:
    api = Api(engine, tokenizer, model_name)
    app = FastAPI(title="dspark serve", docs_url=None, redoc_url=None)

    async def handle(http: HttpRequest, kind: str):
        try:
            job = api.reader.job(await json_body(http), kind)
            if job.stream:
                return StreamingResponse(api.stream(job), media_type="text/event-stream")
            return JSONResponse(await api.complete(job))
        except Exception as error:
            return error_response(error)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        return await handle(http, "chat")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await handle(http, "text")

    @app.post("/v1/responses")
    async def create_response(http: HttpRequest):
        try:
            body = await json_body(http)
            job, messages = api.response_job(body)
            if job.stream:
                return StreamingResponse(api.respond_streaming(job, body, messages), media_type="text/event-stream")
            return JSONResponse(await api.respond(job, body, messages))
        except Exception as error:
            return error_response(error)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dspark"}]}

    @app.get("/health")
    async def health():
        if engine.failure is not None:  # starting again after a failure, or dead
            status = "failed" if engine.dead else "restarting"
            return JSONResponse({"status": status, "error": engine.failure}, status_code=503)
        return {"status": "ok", **engine.stats()}

    @app.on_event("shutdown")
    def stop_engine():
        engine.close()

    return app


class Server(uvicorn.Server):
    """uvicorn in front of an engine: SIGINT/SIGTERM end the requests in
    flight, then it shuts down; so does an engine that cannot start again."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.cancel_all()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        return self.engine.dead or await super().on_tick(counter)


def serve(engine: Engine, tokenizer, model_name: str, host: str, port: int) -> int:
    """Serve until a signal (returns 0) or an engine that cannot start again (returns 1)."""
    app = create_app(engine, tokenizer, model_name)
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning"), engine).run()
    return 1 if engine.dead else 0
