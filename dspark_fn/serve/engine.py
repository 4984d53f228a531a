"""Continuous batching: requests join a running batch between rounds and leave when done.

One thread owns the model and a ``Decoder``. Between rounds it releases
cancelled requests, sizes the batch to the requests at hand (a power of two
up to ``max_batch``: one client runs a batch of one) and inserts waiting
requests (their prompt prefilled alone, reusing a cached conversation
prefix when one matches); every round advances all running requests at
once. A request is a sequence of the decoder tagged with its number: the
engine never sees rows. Each keeps its own sampling settings and seed.
Requests talk to the thread through queues only, so the web server never
touches MLX.

A request that ends comes back from the decoder as one record, whose cache
(cut to what the client saw; ``Decoder._kept_cache`` says how for
recurrent states) is kept for the conversation's next turn, under its
tokens with each image token paired with its image's content hash: a later
turn about the same image reuses it and never encodes the image again.
With a prompt-cache directory (``prompt_cache.disk``) the kept caches that leave
memory, and all of them when the engine stops, are written there as files,
and an engine started later over the same directory reuses them.

Over several ranks (``mlx.launch``) rank 0 serves HTTP and every rank runs
this same thread on its share of the target. The thread's only inputs are
the requests that arrived, the cancellations and the stop: at the top of
each pass rank 0 takes them as one batch of inputs and sends it to every
rank (``distributed.share``), and every rank applies the same inputs to the
same state, so all take the same decisions and run the same kernels;
``follow`` is the loop of a rank without clients.

A request that asked for its prompt's scores (``score_prompt``) is
prefilled in a cache of its own, every prompt position scored
(``prompt_cache.scoring.score_prompts``), before it takes a row. A prefix is
reused for it only with its positions' scores: each scored prompt is kept
in the prompt cache with its scores, and a later scored prompt sharing a
beginning with it scores only the rest. One that needs nothing past that
prefill (no new token, or only the one the prefill gives) never takes a
row: such requests are answered between rounds, up to ``max_batch`` a
pass, while the batch goes on, and the scored prompts of one pass are
prefilled together, one row each, a beginning several of them share scored
once first (an evaluation harness sends many at once, the choices of a
question after one context; an image prompt still goes alone). Each row
keeps its request's sampling settings and the seed a cache of its own would
give it, so a request scored beside others gets its scores alone (up to
float rounding) and its own seed's draw.

The queue is bounded: past ``max_queue`` requests waiting (arrived, not yet
in a row) ``submit`` refuses with ``QueueFull``, and a request that has
waited ``queue_timeout`` seconds ends with an ``Update("timeout")``, never
a hang (rank 0 decides which, and shares it as it shares cancellations).

The thread is supervised: an exception inside it (in a round, a prefill)
ends each request in the batch with an ``Update("error", message)``,
``failure`` names it until the engine runs again, and the engine starts
again with an empty batch (and an empty prompt cache: nothing built before
the failure is trusted); waiting requests are then served. An engine that
cannot start again is ``dead``: every request ends with the failure, new
ones are refused, and the server is to exit.
"""

import json
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from ..checkpoints import materialised
from ..constraints import Constraint, Grammar
from ..driver import TOP_LOG_PROBS, Decoder, token_scores
from ..kernel import TRACE_COUNTS
from ..prompt_cache.scoring import ScoredRow, score_prompts
from ..sampling import GREEDY, Sampling
from ..stats import Tally
from ..threads import run_parked
from ..types import Ended, ImagePrompt, Params, TokenLogProbs, prompt_key
from .mailbox import Mailbox
from ..prompt_cache.memory import PromptCache
from ..prompt_cache.disk import DEFAULT_BUDGET, DiskTier, locked, private_directory

RETRY_AFTER = 1  # seconds a refused client is asked to wait before trying again


class Update(NamedTuple):
    """What a request hears from the engine: ``kind`` "prompt" (``scores``: a
    ``TokenScore`` per prompt token after the first, when it asked for them;
    before any token), "tokens" (``value``: the round's ids, ``scores``: a
    ``TokenScore`` per token when the request asked for log-probabilities),
    "done" (``value``: "stop", "length" or "cancelled"), "timeout" (``value``:
    the seconds it waited for a row) or "error" (``value``: the failure)."""

    kind: str
    value: object
    scores: list | None = None


@dataclass
class Request:
    """One sequence to generate. The engine puts an ``Update`` with the
    tokens of each round on ``events``, then one that ends it ("done" or
    "error"); ``cancel()`` frees its row."""

    prompt: list  # token ids, or an ImagePrompt
    max_tokens: int
    sampling: Sampling = GREEDY
    seed: int = 0
    stop_tokens: frozenset = frozenset()
    top_log_probs: int | None = None  # score each token, with this many most likely alternatives
    score_prompt: bool = False  # score the prompt's tokens too (an Update "prompt" before the first tokens)
    constraint: Constraint | None = None  # what its output must match
    grammar: Grammar | None = None  # the constraint compiled (else the engine compiles it: ``Engine.grammars``)
    scope: str = ""  # whose prompt-cache entries it may reuse, and whose its own become (``PromptCache``)
    events: Mailbox = field(default_factory=Mailbox)
    acceptance: Tally = field(default_factory=Tally)  # the rounds delivered so far
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache
    produced: int = 0
    number: int = -1  # the engine's count of it, the same on every rank
    dropped: bool = False  # cancelled, as the engine has taken it in (at the same pass on every rank)
    expired: bool = False  # waited past the queue's bound (decided by rank 0, at the same pass on every rank)
    submitted: float = field(default_factory=time.monotonic)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def rowless(self) -> bool:
        """Nothing to generate past the prefill: no new token, or the one a scored prompt's prefill gives."""
        return self.max_tokens == 0 or (self.score_prompt and self.max_tokens == 1)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def settings(self) -> dict:
        """What another rank needs to run the same request."""
        sampling = self.sampling
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, "seed": self.seed,
                "sampling": [sampling.temperature, sampling.top_k, sampling.top_p],
                "stop_tokens": sorted(self.stop_tokens), "top_log_probs": self.top_log_probs,
                "score_prompt": self.score_prompt, "scope": self.scope,
                "constraint": None if self.constraint is None else list(self.constraint)}

    @classmethod
    def from_settings(cls, settings: dict) -> "Request":
        temperature, top_k, top_p = settings["sampling"]
        return cls(prompt=settings["prompt"], max_tokens=settings["max_tokens"],
                   sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p), seed=settings["seed"],
                   stop_tokens=frozenset(settings["stop_tokens"]), top_log_probs=settings["top_log_probs"],
                   score_prompt=settings["score_prompt"], scope=settings["scope"],
                   constraint=None if settings["constraint"] is None else Constraint(*settings["constraint"]))


class EngineFailure(RuntimeError):
    """The decoding engine failed while the request was in its batch: the
    request is lost, the server goes on."""


class QueueFull(RuntimeError):
    """Too many requests wait already: try again after ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is at capacity ({waiting} requests waiting for a row); retry after "
                         f"{retry_after} s")
        self.retry_after = retry_after


class QueueTimeout(RuntimeError):
    """The request waited longer than the queue's bound for a row."""


def resident_bytes() -> int:
    """This process's resident memory now (Linux), or its peak where /proc is absent (macOS)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def memory_use() -> dict:
    return {"resident_bytes": resident_bytes(), "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(), "mlx_peak_bytes": mx.get_peak_memory()}


class ScoredPrompt(NamedTuple):
    """One row of a scoring prefill, as its request is told it: ``scores`` (a
    ``TokenScore`` per prompt token after the first, None where the request
    asked for none), ``first`` (the token the prefill gives) and ``first_score``."""

    scores: list | None
    first: int
    first_score: object


def scoring_batches(requests: list) -> list[list]:
    """The scored prompts of one pass as the prefills that score them: the
    token prompts of each scope in one (a beginning they share is scored
    once, and only a scope's own scored prompts are reused), each image
    prompt alone (an image row runs the image variant of the chunk kernel
    and encodes its images: kept off the text rows' prefill)."""
    scopes = dict.fromkeys(r.scope for r in requests if not isinstance(r.prompt, ImagePrompt))
    texts = [[r for r in requests if r.scope == scope and not isinstance(r.prompt, ImagePrompt)] for scope in scopes]
    return texts + [[r] for r in requests if isinstance(r.prompt, ImagePrompt)]


def scored_answer(request, row: ScoredRow) -> ScoredPrompt:
    """What ``request`` is told of its scored prompt ``row``: its prompt's
    ``len - 1`` scores and its first token's, with as many alternatives as
    it asked for."""
    top = request.top_log_probs
    (scores,) = token_scores(row.scores, [0], [len(request.prompt) - 1], [top])
    (first,) = token_scores(TokenLogProbs(*(a[:, None] for a in row.first_scored)), [0], [1], [top])
    return ScoredPrompt(scores, row.first, None if first is None else first[0])


def running_batch(requests: int, max_batch: int) -> int:
    """Rows to run for ``requests`` sequences: the power of two that holds
    them, at most ``max_batch`` (few sizes, each compiled once)."""
    return min(max_batch, 1 << max(requests - 1, 0).bit_length())


class Engine:
    """The decoding loop, on a thread of its own (``threads.run_parked``:
    it parks when the loop ends). ``submit`` queues a request; ``close``
    cancels what is in flight and ends the loop (writing the prompt cache
    to ``prompt_cache_dir``, where one is given)."""

    def __init__(self, params: Params, max_batch: int = 8, max_context: int = 4096,
                 prompt_cache_bytes: int = 1 << 30, group=None, max_queue: int = 64, queue_timeout: float = 600.0,
                 grammars=None, prompt_cache_dir=None, prompt_cache_dir_bytes: int = DEFAULT_BUDGET,
                 **decoder_options):
        self.params, self.max_context, self.max_batch = params, max_context, max_batch
        self.grammars = grammars  # compiles requests' constraints (``structured.Grammars``), where none came compiled
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.refused = self.timed_out = 0  # requests refused with the queue full; ended for waiting too long
        self.prompt_tokens = self.generated_tokens = 0  # over every request served
        self.served = Tally()  # the rounds of every request served, by proposal source
        self.group = group if group is not None and group.size() > 1 else None
        if prompt_cache_dir is not None and self.group is not None:
            raise ValueError("a prompt-cache directory holds one process's whole caches, and each rank holds its "
                             "share: drop --prompt-cache-dir under mlx.launch")
        self.arrived: deque = deque()  # submitted, not yet taken in by the engine thread
        self.waiting: deque = deque()  # taken in, waiting for a row
        self.taken = 0  # requests taken in so far
        self.running: dict = {}  # request number (its sequence's tag) -> request
        self.wake = threading.Condition()
        self.stopping = False
        self.failure: str | None = None  # the last failure, until the engine runs again
        self.published: dict = {}  # the engine thread's state for other threads (``_publish``)
        self.dead = False  # failed and could not start again
        materialised(params)  # params built by hand may be pending; the engine thread builds all decoding state
        self.directory_lock = None if prompt_cache_dir is None else locked(private_directory(Path(prompt_cache_dir)))
        disk = None if prompt_cache_dir is None else DiskTier(prompt_cache_dir, params, prompt_cache_dir_bytes)
        self.prompt_cache = PromptCache(prompt_cache_bytes, disk=disk)
        self.decoder, started = None, threading.Event()
        if self.group is not None and self.group.rank() != 0:
            self.finished = None  # a rank without clients runs the loop in ``follow``
            self._options = decoder_options
            return
        self.finished = run_parked(lambda: self._run(decoder_options, started))
        started.wait()
        if self.decoder is None:
            raise RuntimeError("the decoding engine failed to start (see the error above)")

    def follow(self) -> None:
        """The engine loop of a rank other than 0, until rank 0 stops."""
        self._run(self._options, threading.Event())

    def submit(self, request: Request) -> Request:
        if self.group is not None and isinstance(request.prompt, ImagePrompt):
            raise ValueError("images are not served across ranks (mlx.launch): the ranks share requests as token "
                             "ids; serve a multimodal release from one process to send it images")
        if len(request.prompt) + request.max_tokens + self.decoder.widest > self.max_context:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens + max_tokens {request.max_tokens} exceed the "
                f"context of {self.max_context} tokens"
            )
        with self.wake:
            if self.stopping:
                raise RuntimeError(f"the decoding engine stopped after a failure: {self.failure}" if self.dead
                                   else "the engine is shutting down")
            if self.queued >= self.max_queue:
                self.refused += 1
                raise QueueFull(self.queued, RETRY_AFTER)
            request.submitted = time.monotonic()
            self.arrived.append(request)
            self.wake.notify()
        return request

    def cancel_all(self) -> None:
        """End every waiting and running request at the next round (shutting down)."""
        with self.wake:
            for request in list(self.arrived) + list(self.waiting) + list(self.running.values()):
                request.cancel()
            self.wake.notify()

    def close(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.finished.wait()
        if self.directory_lock is not None:  # the directory's files are written: another server may take it
            self.directory_lock.close()

    @property
    def queued(self) -> int:
        """Requests waiting for a row (arrived or taken in)."""
        return len(self.waiting) + len(self.arrived)

    def stats(self) -> dict:
        """What ``/health`` shows: the engine's state as its thread last
        published it (``_publish``), the queue's and the memory's as they are now."""
        with self.wake:
            waiting, refused = self.queued, self.refused
        queue = {"waiting": waiting, "max": self.max_queue, "timeout_seconds": self.queue_timeout,
                 "refused": refused, "timed_out": self.published.get("timed_out", 0)}
        return self.published | {"waiting": waiting, "queue": queue, "memory": memory_use()}

    # ---- the decoding thread

    def _publish(self) -> None:
        """The engine's state for other threads, taken on its own thread
        between rounds: a new dict each time, so a reader never sees one change."""
        cache = self.prompt_cache
        self.published = {
            "active": len(self.running), "batch": self.decoder.batch, "timed_out": self.timed_out,
            "prompt_cache": {"entries": len(cache), "bytes": cache.used, "budget_bytes": cache.budget,
                             "hits": cache.hits, "misses": cache.misses,
                             "disk": cache.disk.stats() if cache.disk is not None else None},
            "traces": dict(TRACE_COUNTS),  # kernels compiled so far: a rise explains a slow round
            "served": {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                       "sources": {name: {"rounds": part.rounds, "emitted": part.emitted, "accepted": part.accepted,
                                          "drafted": part.drafted} for name, part in self.served.by_source.items()}},
            "images_encoded": self.params.vision.encoded if self.params.vision is not None else 0,
        }

    def _run(self, decoder_options: dict, started: threading.Event) -> None:
        try:
            self._start_decoder(decoder_options)
        finally:
            started.set()
        try:
            while self._decode():  # it failed: start again with an empty batch
                self._start_decoder(decoder_options)
                self.failure = None
            self.prompt_cache.spill()  # stopped, not failed: the kept conversations outlive the process on disk
        except Exception as error:  # it cannot start again
            self.failure = f"{self.failure}; starting again failed with {type(error).__name__}: {error}"
            self.dead = True
            traceback.print_exc()
        finally:
            with self.wake:  # the loop ends: nothing more is queued for it
                self.stopping = True
                ended = list(self.running.values()) + list(self.waiting) + list(self.arrived)
                self.waiting.clear()
                self.arrived.clear()
            for request in ended:
                request.events.put(Update("error", self.failure) if self.dead else Update("done", "cancelled"))

    def _start_decoder(self, options: dict) -> None:
        """A decoder with an empty batch (and an empty prompt cache: after a
        failure, nothing built before it is trusted); each batch size's cost
        curve now, not in the middle of a request."""
        decoder = Decoder(self.params, 1, **options)
        for batch in sorted({running_batch(n, self.max_batch) for n in range(1, self.max_batch + 1)}):
            decoder.resize(batch)
        decoder.resize(1)
        self.decoder, self.running = decoder, {}
        self.prompt_cache.clear()
        self._publish()

    def _decode(self) -> bool:
        """Decode until the engine stops (False) or fails (True): a failure
        ends each request in the batch with its message, never silently."""
        try:
            while self._wait_for_work():
                self._release_cancelled()
                self._fit_batch()
                self._admit()
                if self.running:
                    self._deliver(self.decoder.step())
                    self._fit_batch()  # requests that ended: the next round, or the idle wait, runs smaller
                self._publish()
            return False
        except Exception as error:
            self.failure = f"{type(error).__name__}: {error}"
            traceback.print_exc()  # for the operator: code and messages, never a prompt
            for request in self.running.values():
                request.events.put(Update("error", self.failure))
            self.running = {}
            return True

    def _wait_for_work(self) -> bool:
        """Take in this pass's inputs (the same on every rank); False once stopping."""
        if self.group is None or self.group.rank() == 0:
            with self.wake:
                while not self.stopping and not self.arrived and not self.waiting and not self.running:
                    self.wake.wait()
                known = list(self.waiting) + list(self.running.values())
                now = time.monotonic()
                inputs = {"arrived": [request.settings() | {"cancelled": request.cancelled} for request in self.arrived],
                          "cancelled": [r.number for r in known if r.cancelled and not r.dropped],
                          "expired": [r.number for r in self.waiting if now - r.submitted > self.queue_timeout],
                          "stop": self.stopping}
                arrived = list(self.arrived)
                self.arrived.clear()
        if self.group is not None:
            from ..distributed import share

            inputs = json.loads(share(json.dumps(inputs).encode() if self.group.rank() == 0 else b"", self.group))
            if self.group.rank() != 0:
                arrived = [Request.from_settings(settings) for settings in inputs["arrived"]]
        self._take_in(arrived, inputs)
        return not self.stopping

    def _take_in(self, arrived: list, inputs: dict) -> None:
        cancelled, expired = set(inputs["cancelled"]), set(inputs["expired"])
        for request, settings in zip(arrived, inputs["arrived"]):
            request.number, self.taken = self.taken, self.taken + 1
            request.dropped = settings["cancelled"]
            self.waiting.append(request)
        for request in list(self.waiting) + list(self.running.values()):
            request.dropped = request.dropped or request.number in cancelled
        for request in [r for r in self.waiting if r.number in expired]:
            self.waiting.remove(request)
            self.timed_out += 1
            request.events.put(Update("timeout", self.queue_timeout))
        self.stopping = self.stopping or inputs["stop"]

    def _release_cancelled(self) -> None:
        """Requests cancelled by now leave before the next round."""
        outbox = []
        try:
            for number in [number for number, request in self.running.items() if request.dropped]:
                outbox.append(self._end(self.decoder.release(number)))
        finally:
            self._send(outbox)

    def _fit_batch(self) -> None:
        """Grow the batch for waiting requests, shrink it when requests have left."""
        wanted = running_batch(len(self.running) + sum(not r.rowless for r in self.waiting), self.max_batch)
        if wanted != self.decoder.batch:
            self.decoder.resize(wanted)

    def _admit(self) -> None:
        """Answer rowless requests (``_answer_rowless``), then give free rows
        to the others in order of arrival; rowless ones past this pass's
        share wait for the next pass, never a row (a row would score the
        prompt alone, then prefill its last token again to give the token
        the scoring prefill already gave)."""
        self._answer_rowless()
        while self.decoder.free and (request := next((r for r in self.waiting if not r.rowless), None)):
            self.waiting.remove(request)
            if request.dropped:
                request.events.put(Update("done", "cancelled"))
                continue
            if not self.running and not request.sampling.greedy:
                # Sampled and alone in the batch: nothing measured of the proposals, so its seeded samples repeat
                # where the choices do (a fixed width, or fixed costs). A greedy answer is the target's whatever
                # the policy decides, so the rates measured so far carry on (relearned per request, every request
                # would pay again for drafting and wide verifies that do not pay).
                self.decoder.forget()
            self.running[request.number] = request  # in the batch from here: a failure ends it too
            self.prompt_tokens += len(request.prompt)
            if request.score_prompt:  # its prompt scored at every position, reusing only scored prefixes
                (scored,) = self._score([request])  # the row goes on from it, all but the last token
                # (prefilled again for the first new one): a recurrent state holds only after every token, so not there
                request.events.put(Update("prompt", None, scored_answer(request, scored).scores))
                prefix = None if scored.cache.recurrent else scored.cache._replace(
                    length=mx.array([len(request.prompt) - 1], mx.int32))
            else:
                images = isinstance(request.prompt, ImagePrompt)
                prefix = self.prompt_cache.lookup(prompt_key(request.prompt),
                                                  request.prompt.resumable if images else None, request.scope)
                request.cached_tokens = int(prefix.length.item()) if prefix is not None else 0
            self._deliver(self.decoder.insert(
                [request.prompt], tags=[request.number], sampling=request.sampling, seeds=[request.seed],
                prefix=prefix, top_log_probs=request.top_log_probs, max_new_tokens=request.max_tokens,
                stop_tokens=request.stop_tokens, keep_cache=self.prompt_cache.budget > 0,
                constraints=self._grammar(request),
            ))

    def _grammar(self, request: Request) -> Grammar | None:
        """The request's constraint compiled (on rank 0 it came compiled; another rank compiles it)."""
        if request.grammar is None and request.constraint is not None:
            if self.grammars is None:
                raise ValueError("a constrained request reached an engine that compiles no constraints: start it "
                                 "with grammars (serve.structured.Grammars)")
            request.grammar = self.grammars.compile(request.constraint)
        return request.grammar

    def _answer_rowless(self) -> None:
        """Answer waiting requests that need no row (``Request.rowless``), at
        most ``max_batch`` a pass so that rounds go on between them: a scored
        prompt's scores, the token its prefill gives, its cache kept. The
        pass's scored prompts are prefilled together (``scoring_batches``)."""
        scoring = []
        for request in [r for r in self.waiting if r.rowless][: self.max_batch]:
            if request.dropped:
                self.waiting.remove(request)
                request.events.put(Update("done", "cancelled"))
            elif not request.score_prompt:  # nothing to compute: the prompt (echoed) is the answer
                self.waiting.remove(request)
                request.events.put(Update("done", "length"))
            else:
                scoring.append(request)
        for requests in scoring_batches(scoring):
            self._answer_scored(requests)

    def _answer_scored(self, requests: list) -> None:
        """Score ``requests``' prompts together (``_score``), then tell each
        request its answer. They are in no batch, so the engine's own failure
        handling would not reach them: a failure ends each with its message
        here, then goes on to the engine's (requests of a later prefill stay
        waiting, served once it runs again)."""
        for request in requests:
            self.waiting.remove(request)
        try:
            answers = [scored_answer(request, row) for request, row in zip(requests, self._score(requests))]
        except Exception as error:
            for request in requests:
                request.events.put(Update("error", f"{type(error).__name__}: {error}"))
            raise
        outbox = []
        for request, answer in zip(requests, answers):
            self.prompt_tokens += len(request.prompt)
            outbox.append((request, Update("prompt", None, answer.scores)))
            if request.max_tokens:
                request.produced, self.generated_tokens = 1, self.generated_tokens + 1
                outbox.append((request, Update("tokens", [answer.first], [answer.first_score])))
            stopped = request.max_tokens and answer.first in request.stop_tokens
            outbox.append((request, Update("done", "stop" if stopped else "length")))
        self._send(outbox)

    def _score(self, requests: list) -> list[ScoredRow]:
        """Prefill ``requests``' prompts together, one row each, in a cache of
        their own, scoring every position; the prompt cache's scored prompts
        of their scope (one for all: ``scoring_batches``) give the beginnings
        they share, and each prompt scored (a beginning several share
        included) is kept there with its scores. Each row takes
        its request's sampling settings and the seed a cache of its own would
        give it (rows draw from their seed and own length only: ``rng``), so
        a sampled first token is the same draw whatever batch scores it."""
        scope = requests[0].scope
        return score_prompts(
            self.params, [request.prompt for request in requests], top=TOP_LOG_PROBS,
            sampling=[request.sampling for request in requests], seeds=[request.seed for request in requests],
            known=lambda prompt: self.prompt_cache.scored_prefix(prompt, scope),
            keep=lambda prompt, cache, scores: self.prompt_cache.store(prompt_key(prompt), cache, scores, scope))

    def _deliver(self, step) -> None:
        """Hand each request its new tokens (cut by the decoder at its stop
        token and budget) and their scores; end the requests that ended."""
        outbox = []
        try:
            for event in step.events():
                request = self.running[event.tag]
                request.acceptance.count(event)
                self.served.count(event)
                request.produced += len(event.emitted)
                self.generated_tokens += len(event.emitted)
                if event.emitted:
                    outbox.append((request, Update("tokens", event.emitted, event.log_probs)))
            outbox += [self._end(ended) for ended in step.ended]
        finally:  # what was delivered before a failure still reaches its request
            self._send(outbox)

    def _end(self, ended: Ended) -> tuple:
        """Keep the ended request's cache for its conversation's next turn;
        ``(the request, its last update)``. It leaves the engine last: a
        failure on the way still ends it."""
        if ended.cache is not None:
            self.prompt_cache.store(ended.context, ended.cache, scope=self.running[ended.tag].scope)
        return self.running.pop(ended.tag), Update("done", ended.finish)

    def _send(self, outbox: list) -> None:
        """Publish the engine's state, then hand out ``(request, update)``s: a
        client told its request ended finds ``stats`` counting it so."""
        self._publish()
        for request, update in outbox:
            request.events.put(update)
