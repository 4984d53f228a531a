"""``GET /metrics``: the server in Prometheus' text format (``prometheus-client``).

Requests by endpoint and status are counted at the door (``Counted``, an
ASGI middleware: every answer, refusals included); time to first token and
the latency between tokens are observed as each reply's tokens arrive
(``Metrics.arrived``). Everything else is read, when scraped, from the
snapshot the engine's thread publishes (``Engine.stats``): prompt and
generated tokens, rounds, proposed and accepted tokens and tau per proposal
source, queue depth, busy and batch rows, requests refused and timed out,
kernels compiled, and the prompt cache's bytes, entries, hits and misses
(a cache filling up tells itself apart from a leak there). Metric names follow vLLM's and TGI's where they have one.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
             "/metrics")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def endpoint_label(path: str) -> str:
    """A path as a label: the routes by name, anything else as "other" (labels stay few whatever clients send)."""
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ENDPOINTS else "other"


class EngineCollector:
    """The engine's published counters and gauges, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        served, queue = stats.get("served", {}), stats.get("queue", {})
        yield counter("dspark_prompt_tokens", "Prompt tokens of the requests served", served.get("prompt_tokens", 0))
        yield counter("dspark_generation_tokens", "Tokens generated", served.get("generated_tokens", 0))
        yield gauge("dspark_queue_depth", "Requests waiting for a row", stats.get("waiting", 0))
        yield gauge("dspark_busy_rows", "Rows of the batch decoding a request", stats.get("active", 0))
        yield gauge("dspark_batch_rows", "Rows of the running batch", stats.get("batch", 0))
        yield counter("dspark_requests_refused", "Requests refused with the queue full", queue.get("refused", 0))
        yield counter("dspark_requests_timed_out", "Requests that waited past the queue's bound",
                      queue.get("timed_out", 0))
        yield counter("dspark_kernels_compiled", "Kernels traced and compiled", sum(stats.get("traces", {}).values()))
        cache = stats.get("prompt_cache") or {}
        yield gauge("dspark_prompt_cache_bytes", "Bytes of the prompt cache's entries in memory", cache.get("bytes", 0))
        yield gauge("dspark_prompt_cache_entries", "Entries of the prompt cache in memory", cache.get("entries", 0))
        yield counter("dspark_prompt_cache_hits", "Prompts that reused a cached prefix", cache.get("hits", 0))
        yield counter("dspark_prompt_cache_misses", "Prompts that found no cached prefix", cache.get("misses", 0))
        by_source = {
            "rounds": CounterMetricFamily("dspark_rounds", "Decoding rounds", labels=["source"]),
            "drafted": CounterMetricFamily("dspark_proposed_tokens", "Proposed tokens verified", labels=["source"]),
            "accepted": CounterMetricFamily("dspark_accepted_tokens", "Proposed tokens accepted", labels=["source"]),
            "emitted": CounterMetricFamily("dspark_emitted_tokens", "Tokens a round committed", labels=["source"]),
        }
        tau = GaugeMetricFamily("dspark_tau", "Tokens committed per round", labels=["source"])
        acceptance = GaugeMetricFamily("dspark_acceptance_rate", "Accepted share of the proposed tokens",
                                       labels=["source"])
        for source, part in sorted(served.get("sources", {}).items()):
            for key, family in by_source.items():
                family.add_metric([source], part[key])
            tau.add_metric([source], part["emitted"] / part["rounds"] if part["rounds"] else 0.0)
            acceptance.add_metric([source], part["accepted"] / part["drafted"] if part["drafted"] else 0.0)
        yield from by_source.values()
        yield tau
        yield acceptance


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class Metrics:
    """The server's metrics, in a registry of their own (two apps in one process count apart)."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter("dspark_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.first_token = Histogram("dspark_time_to_first_token_seconds", "From a request's admission to its "
                                     "first token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("dspark_inter_token_latency_seconds", "Between a reply's tokens (a round's "
                                     "tokens share its time)", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(engine))

    def arrived(self, submitted: float, last: float | None, tokens: int) -> float:
        """Observe ``tokens`` that arrived now for a request admitted at
        ``submitted`` whose tokens last came at ``last`` (None: these are its
        first: their round is its time to first token); returns now, the
        next call's ``last``. The tokens of one round share its time."""
        now = time.monotonic()
        if last is None:
            self.first_token.observe(now - submitted)
        else:
            for _ in range(tokens):
                self.inter_token.observe((now - last) / tokens)
        return now

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Counted:
    """ASGI middleware: each answer counted by endpoint and status as it starts."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label = endpoint_label(scope["path"])

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
