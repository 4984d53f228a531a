"""The server as a boundary, the long campaign: ``dspark serve`` in a process
of its own (the tiny multimodal gemma4 pair of ``tests/multimodal.py``,
behind a key, image files and URLs allowed, ``--max-batch 4``) takes
thousands of generated requests from 4 client threads at once, so its engine
decodes hostile and valid requests in the same batches.

The requests are ``tests/fuzzing.py``'s strategies, drawn by hypothesis
``@given`` loops that record each bad answer instead of failing on it (so
nothing shrinks and the campaign runs to its end):

- ``body``: valid bodies of each endpoint with fields replaced by hostile
  values, deleted or mangled (``bodies(endpoint)``), one endpoint a thread;
- ``raw``: bytes that are not JSON or that a lenient parser takes
  (``raw_bodies``), to any endpoint: a 4xx expected;
- ``key``: a valid body with a wrong or empty key: a 401 expected;
- ``sweep``: every declared field at each of ``SWEPT``'s values, once
  (``sweep(endpoint)``);
- ``wire``: a valid body framed otherwise (``framings``): sent in chunks
  (``Transfer-Encoding: chunked``), with a ``Content-Length`` short of it,
  under drawn headers (content types, encodings, long or odd values), or
  with the connection closed halfway through the body or before the answer
  is read (streamed and whole): every answer judged as the others, and a
  server that keeps a closed connection's row shows it in the periodic
  checks.

Each answer is judged by ``check_answer`` (never a 5xx, every 4xx in the
endpoint's API shape, every 200 the API's whole reply, every stream's
events each in the API's shape, none an error, the last the one that ends
it); one with no answer within 60 s is a hang. Every ``CHECK_EVERY`` requests a greedy request (temperature 0) must
answer what it answered before the campaign, ``/health`` must answer 200, and
the server's RSS is read from ``/proc/PID/status``. The campaign stops early
if the server process exits. It exits 1, naming why, on any failed answer,
hang, failed check, exception in the server's log or exit of the server;
hypothesis draws new bodies each run.

    python bench/fuzz.py            # REQUESTS=10000 CLIENTS=4 CHECK_EVERY=500 RAW=0.1 KEYS=0.1 WIRE=0.1 PROMPT_CACHE_MB=64

Environment: REQUESTS (fuzzed requests in all, sweeps included; the periodic
checks come on top), CLIENTS (client threads; endpoints are dealt to them in
turn), CHECK_EVERY, RAW, KEYS and WIRE (the shares of raw bodies, wrong keys and framings),
PROMPT_CACHE_MB (the server's ``--prompt-cache-mb``: its memory grows until
the prompt cache is full, then stays), JSON (a path: the summary is written there too). The summary is printed as
JSON.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import dspark_fn  # noqa: E402,F401  before mlx: OpenBLAS then serves MLX (dspark_fn/blas.py)
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import fuzzing  # noqa: E402
from fuzzing import VALID, bodies, check_answer, raw_bodies, sweep  # noqa: E402
from multimodal import synthetic_image, write_pair  # noqa: E402
from serve_bench import free_port  # noqa: E402

REQUESTS = int(os.environ.get("REQUESTS", 10000))
CLIENTS = int(os.environ.get("CLIENTS", 4))
CHECK_EVERY = int(os.environ.get("CHECK_EVERY", 500))
RAW = float(os.environ.get("RAW", 0.1))
KEYS = float(os.environ.get("KEYS", 0.1))
WIRE = float(os.environ.get("WIRE", 0.1))
PROMPT_CACHE_MB = int(os.environ.get("PROMPT_CACHE_MB", 64))  # the bound the prompt cache's memory fills up to
KEY = "fuzz-key"
ENDPOINTS = sorted(VALID)
WAIT = 60  # seconds any one answer may take: past it, a hang
ROUNDS = 5  # each thread's quotas in this many turns of body, raw, key and sweep requests
EXAMPLES = 3  # example requests kept per failure kind
GREEDY = {"messages": [{"role": "user", "content": "what is here?"}], "max_tokens": 8, "temperature": 0}
wrong_keys = st.one_of(st.just(""), st.just(" "), st.text(max_size=20).filter(
    lambda key: key.strip() != KEY and key.isprintable() and key.isascii()))


header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300)
drawn_headers = st.dictionaries(
    st.sampled_from(["content-type", "content-encoding", "accept", "accept-encoding", "user-agent", "expect",
                     "x-forwarded-for", "x-request-id", "anthropic-version", "openai-organization"]),
    st.one_of(header_values, st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1",
                                              "multipart/form-data; boundary=x", "gzip", "100-continue", ""])),
    max_size=4)
framings = st.tuples(st.sampled_from(["chunked", "short", "headers", "cut", "leave"]), drawn_headers,
                     st.floats(0, 1), st.booleans())


def framed(port: int, endpoint: str, body: dict, framing: tuple) -> tuple | None:
    """``(status, headers, whole body)`` of ``body`` sent as ``framing`` says
    (``(how, headers, where to cut, streamed)``), or None where the client
    closes the connection without reading an answer."""
    how, headers, cut, streamed = framing
    raw = json.dumps(body | ({"stream": True} if streamed else {})).encode()
    at = int(cut * len(raw))
    lines = [f"POST {endpoint} HTTP/1.1", f"host: 127.0.0.1:{port}", f"authorization: Bearer {KEY}",
             "connection: close"] + [f"{name}: {value}" for name, value in headers.items() if how == "headers"]
    if how != "headers" or "content-type" not in headers:
        lines.append("content-type: application/json")
    if how == "chunked":
        pieces = [piece for piece in (raw[:at], raw[at:]) if piece]
        lines.append("transfer-encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    else:
        lines.append(f"content-length: {at if how == 'short' else len(raw)}")
        payload = raw[:at] if how in ("short", "cut") else raw
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
        if how in ("cut", "leave"):  # gone halfway through the body, or before the answer
            return None
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """The process's resident memory (or ``VmHWM``, its peak) in MiB, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def send(port: int, path: str, raw: bytes, headers: dict | None = None, method: str = "POST") -> tuple:
    return fuzzing.send(f"http://127.0.0.1:{port}", path, raw, KEY, headers, method, WAIT)


def error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:80].decode("utf-8", "replace")


def server_exceptions(log: str) -> dict:
    """The exceptions the server's log shows, by the frame that raised them: ``{"file:line: Error: ...": count}``."""
    found, frame = Counter(), None
    for line in log.splitlines():
        if line.startswith("  File "):
            frame = line.strip()
        elif frame and line and not line[0].isspace() and ("Error" in line.split(":")[0]
                                                              or "Exception" in line.split(":")[0]):
            place = frame.removeprefix("File ").replace('"', "").replace(", line ", ":")
            found[f"{place}: {line}"[:240]] += 1
            frame = None
    return dict(found.most_common())


def shown(request) -> str:
    text = request.decode("utf-8", "replace") if isinstance(request, bytes) else json.dumps(request)
    return text if len(text) <= 1500 else text[:1500] + f"... ({len(text)} characters)"


class Server:
    """``dspark serve`` of ``root/target`` + ``root/draft`` in its own process."""

    def __init__(self, root: Path, images: Path):
        self.port, self.log = free_port(), root / "server.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dspark_fn.cli", "serve", "--model", str(root / "target"), "--draft",
             str(root / "draft"), "--port", str(self.port), "--api-key", KEY, "--max-context", "512", "--dtype",
             "float32", "--allow-image-files", str(images), "--allow-image-urls", "--max-batch", "4",
             "--prompt-cache-mb", str(PROMPT_CACHE_MB)],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            env=dict(os.environ, DSPARK_FN_CACHE=str(root / "costs")))
        for _ in range(1200):
            try:
                if send(self.port, "/health", b"", method="GET")[0] == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("the server did not start: " + self.log.read_text()[-3000:])

    def stop(self) -> int | None:
        """Stops the server (SIGTERM, then SIGKILL after 60 s): its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


class Campaign:
    """The counts, shared by the client threads."""

    def __init__(self, server: Server, greedy: str):
        self.server, self.greedy = server, greedy
        self.lock = threading.Lock()
        self.sent = 0
        self.by_kind = defaultdict(Counter)  # kind -> endpoint -> requests
        self.statuses = Counter()  # "2xx", "400", ..., "5xx", "no answer"
        self.kind_statuses = defaultdict(Counter)  # kind -> status class -> requests
        self.failures = {}  # reason -> {"count", "examples"}
        self.messages = Counter()  # (status, first 80 characters) of 4xx error messages
        self.hangs, self.connection_errors = [], Counter()
        self.slowest = 0.0
        self.checks, self.health_failures, self.greedy_mismatches = 0, [], []
        self.rss = [(0, rss_mb(server.process.pid))]
        self.exited = threading.Event()

    def fail(self, reason: str, endpoint: str, request, headers: dict | None = None) -> None:
        entry = self.failures.setdefault(reason, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append({"endpoint": endpoint, "request": shown(request)} | (
                {"headers": headers} if headers else {}))

    def request(self, kind: str, endpoint: str, request, headers: dict | None = None, framing: tuple | None = None):
        """Sends one fuzzed request (framed as ``framing`` says, if given) and
        records its answer; runs the periodic check when its turn comes."""
        if self.exited.is_set():
            return
        raw = request if isinstance(request, bytes) else json.dumps(request).encode()
        started = time.monotonic()
        try:
            if framing is None:
                status, answer_headers, answer = send(self.server.port, endpoint, raw, headers)
            else:
                answered = framed(self.server.port, endpoint, request, framing)
                status, answer_headers, answer = answered or (0, {}, b"")
                headers = {"framing": json.dumps(framing)}
            outcome = None
        except TimeoutError:
            outcome = "hang"
        except (OSError, http.client.HTTPException) as error:
            outcome = f"{type(error).__name__}: {error}"[:120]
        took = time.monotonic() - started
        with self.lock:
            self.sent += 1
            self.by_kind[kind][endpoint] += 1
            self.slowest = max(self.slowest, took)
            if outcome == "hang" or (outcome is None and took > WAIT):
                group = "no answer" if outcome else f"{status // 100}xx"
                self.statuses[group] += 1
                self.kind_statuses[kind][group] += 1
                self.hangs.append({"kind": kind, "endpoint": endpoint, "seconds": round(took, 1),
                                   "request": shown(request)})
            elif outcome is not None:
                self.statuses["no answer"] += 1
                self.kind_statuses[kind]["no answer"] += 1
                self.connection_errors[outcome] += 1
                self.fail(f"no answer: {outcome}", endpoint, request, headers)
                if self.server.process.poll() is not None:
                    self.exited.set()
            elif status == 0:  # the client left without an answer: the periodic checks judge what it left behind
                self.statuses["left"] += 1
                self.kind_statuses[kind]["left"] += 1
            else:
                self.record(kind, endpoint, request, headers, status, answer_headers, answer)
            due = self.sent % CHECK_EVERY == 0
        if due:
            self.check()

    def record(self, kind, endpoint, request, headers, status, answer_headers, answer) -> None:
        group = f"{status // 100}xx"
        self.statuses[group if status < 400 or status >= 500 else str(status)] += 1
        self.kind_statuses[kind][group] += 1
        if 400 <= status < 500:
            self.messages[(status, error_message(answer)[:80])] += 1
        reason = check_answer(endpoint, status, answer_headers, answer)
        if status >= 500:
            reason = f"status {status}: {error_message(answer)[:80]}"
        elif reason is None and kind == "key" and status != 401:
            reason = f"a wrong key answered {status}"
        elif reason is None and kind == "raw" and not 400 <= status < 500:
            reason = f"a raw body answered {status}"
        if reason is not None:
            self.fail(reason[:120], endpoint, request, headers)

    def check(self) -> None:
        """The greedy answer, /health and the server's RSS, between fuzzed requests."""
        pid = self.server.process.pid
        try:
            health = send(self.server.port, "/health", b"", method="GET")[0]
            status, _, raw = send(self.server.port, "/v1/chat/completions", json.dumps(GREEDY).encode())
            text = json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
            health, status, text = None, None, f"{type(error).__name__}: {error}"
        with self.lock:
            self.checks += 1
            self.rss.append((self.sent, rss_mb(pid)))
            if health != 200:
                self.health_failures.append({"after": self.sent, "status": health})
            if text != self.greedy:
                self.greedy_mismatches.append({"after": self.sent, "status": status, "answer": text})
            if self.server.process.poll() is not None:
                self.exited.set()
        print(f"# {self.sent} requests, {time.strftime('%H:%M:%S')}: health {health}, greedy "
              f"{'same' if text == self.greedy else repr(text)}, RSS {self.rss[-1][1]} MiB, "
              f"statuses {dict(self.statuses)}, failure kinds {len(self.failures)}, hangs {len(self.hangs)}",
              flush=True)


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))


def drawn(campaign: Campaign, quota: int, run, sent: list) -> None:
    """Runs ``run(examples)`` (a ``@given`` loop) until ``quota`` requests went out
    (``sent[0]``, this thread's count: hypothesis may stop short of ``max_examples``),
    or the server is gone."""
    done, idle = 0, 0
    while done < quota and idle < 3 and not campaign.exited.is_set():
        before = sent[0]
        run(quota - done)
        count = sent[0] - before
        done, idle = done + count, idle + (count == 0)


def client(campaign: Campaign, endpoints: list, quotas: dict) -> None:
    """One client thread: its endpoints' bodies and sweeps, and its share of raw bodies and wrong keys,
    in ``ROUNDS`` turns."""
    def body_loop(endpoint):
        def run(examples):
            @fuzz_settings(examples)
            @given(bodies(endpoint))
            def fuzzed(body):
                counted(lambda: campaign.request("body", endpoint, body))
            fuzzed()
        return run

    def raw_run(examples):
        @fuzz_settings(examples)
        @given(st.sampled_from(ENDPOINTS), raw_bodies)
        def fuzzed(endpoint, raw):
            counted(lambda: campaign.request("raw", endpoint, raw))
        fuzzed()

    def key_run(examples):
        @fuzz_settings(examples)
        @given(st.sampled_from(ENDPOINTS), wrong_keys, st.sampled_from(["authorization", "x-api-key"]))
        def fuzzed(endpoint, key, header):
            value = f"Bearer {key}" if header == "authorization" else key
            counted(lambda: campaign.request("key", endpoint, VALID[endpoint], {"authorization": "", header: value}))
        fuzzed()

    def wire_run(examples):
        @fuzz_settings(examples)
        @given(st.sampled_from(ENDPOINTS), framings)
        def fuzzed(endpoint, framing):
            counted(lambda: campaign.request("wire", endpoint, VALID[endpoint], framing=framing))
        fuzzed()

    sent = [0]

    def counted(send_one):
        if not campaign.exited.is_set():
            send_one()
            sent[0] += 1

    swept = {endpoint: list(sweep(endpoint)) for endpoint in endpoints}
    for turn in range(ROUNDS):
        def share(total):
            return total * (turn + 1) // ROUNDS - total * turn // ROUNDS
        for endpoint in endpoints:
            drawn(campaign, share(quotas[("body", endpoint)]), body_loop(endpoint), sent)
        drawn(campaign, share(quotas["raw"]), raw_run, sent)
        drawn(campaign, share(quotas["key"]), key_run, sent)
        drawn(campaign, share(quotas["wire"]), wire_run, sent)
        for endpoint in endpoints:
            bodies_now = swept[endpoint][len(swept[endpoint]) * turn // ROUNDS:
                                         len(swept[endpoint]) * (turn + 1) // ROUNDS]
            for body in bodies_now:
                counted(lambda: campaign.request("sweep", endpoint, body))


def plan() -> list[tuple[list, dict]]:
    """Each client's endpoints and quotas: every thread the same number of requests, sweeps included."""
    dealt = [ENDPOINTS[i::CLIENTS] for i in range(CLIENTS)]
    share = REQUESTS // CLIENTS
    plans = []
    for i, endpoints in enumerate(dealt):
        total = share + (REQUESTS - share * CLIENTS if i == 0 else 0)
        raw, key, wire = int(total * RAW), int(total * KEYS), int(total * WIRE)
        swept = sum(len(list(sweep(endpoint))) for endpoint in endpoints)
        left = total - raw - key - wire - swept
        if endpoints and left < 0:
            raise SystemExit(f"REQUESTS={REQUESTS} is too few for the sweeps ({swept} requests in thread {i})")
        quotas = {"raw": raw + (left if not endpoints else 0), "key": key, "wire": wire}
        for j, endpoint in enumerate(endpoints):
            quotas[("body", endpoint)] = left * (j + 1) // len(endpoints) - left * j // len(endpoints)
        plans.append((endpoints, quotas))
    return plans


def summary(campaign: Campaign, wall: float, exit_code, end_rss, peak_rss, final_greedy) -> dict:
    samples = [mb for _, mb in campaign.rss if mb is not None]
    by_kind = {kind: dict(sorted(counts.items())) | {"all": sum(counts.values())}
               for kind, counts in sorted(campaign.by_kind.items())}
    by_endpoint = Counter()
    for counts in campaign.by_kind.values():
        by_endpoint.update(counts)
    return {
        "requests": campaign.sent,
        "clients": CLIENTS,
        "requests_by_kind_and_endpoint": by_kind,
        "requests_by_endpoint": dict(sorted(by_endpoint.items())),
        "statuses": dict(sorted(campaign.statuses.items())),
        "statuses_by_kind": {kind: dict(sorted(c.items())) for kind, c in sorted(campaign.kind_statuses.items())},
        "distinct_4xx_messages": len(campaign.messages),
        "common_4xx_messages": [{"status": s, "message": m, "count": n}
                                for (s, m), n in campaign.messages.most_common(12)],
        "failure_kinds": len(campaign.failures),
        "failures": [{"reason": reason} | entry for reason, entry in
                     sorted(campaign.failures.items(), key=lambda item: -item[1]["count"])],
        "hangs": len(campaign.hangs),
        "hang_examples": campaign.hangs[:EXAMPLES * 3],
        "slowest_answer_s": round(campaign.slowest, 2),
        "checks": campaign.checks,
        "health_not_200": campaign.health_failures,
        "greedy_answer": campaign.greedy,
        "greedy_unchanged": not campaign.greedy_mismatches and final_greedy == campaign.greedy,
        "greedy_mismatches": campaign.greedy_mismatches[:10],
        "greedy_after_campaign": final_greedy,
        "rss_mib": {"start": round(samples[0], 1) if samples else None, "max": round(max(samples), 1) if samples
                    else None, "end": round(end_rss, 1) if end_rss else None,
                    "peak_vmhwm": round(peak_rss, 1) if peak_rss else None},
        "rss_samples_mib": [(n, round(mb, 1)) for n, mb in campaign.rss if mb is not None],
        "server_exited_during_campaign": campaign.exited.is_set(),
        "server_exit_code_at_stop": exit_code,
        "wall_s": round(wall, 1),
    }


def main() -> None:
    warnings.filterwarnings("ignore")  # hypothesis's notes on nested @given loops and deprecated health checks
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    write_pair(root, "gemma4")
    images = root / "images"
    images.mkdir()
    synthetic_image(48, 64, seed=1).save(images / "picture.png")
    server = Server(root, images)
    print(f"# server pid {server.process.pid} on port {server.port}, log {server.log}; {REQUESTS} requests from "
          f"{CLIENTS} threads", flush=True)
    exit_code, final_greedy = None, None
    try:
        status, _, raw = send(server.port, "/v1/chat/completions", json.dumps(GREEDY).encode())
        if status != 200:
            raise RuntimeError(f"the first greedy request answered {status}: {raw[:300]!r}")
        campaign = Campaign(server, json.loads(raw)["choices"][0]["message"]["content"])
        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(campaign, endpoints, quotas), name=f"client-{i}")
                   for i, (endpoints, quotas) in enumerate(plan())]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - started
        if server.process.poll() is None:
            campaign.check()
            try:
                status, _, raw = send(server.port, "/v1/chat/completions", json.dumps(GREEDY).encode())
                final_greedy = json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else status
            except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
                final_greedy = f"{type(error).__name__}: {error}"
        end_rss, peak_rss = rss_mb(server.process.pid), rss_mb(server.process.pid, "VmHWM")
    finally:
        exit_code = server.stop()
    result = summary(campaign, wall, exit_code, end_rss, peak_rss, final_greedy)
    result["server_exceptions"] = server_exceptions(server.log.read_text())
    if campaign.exited.is_set():
        result["server_log_tail"] = server.log.read_text()[-4000:]
    print(json.dumps(result, indent=1))
    if os.environ.get("JSON"):
        Path(os.environ["JSON"]).write_text(json.dumps(result, indent=1))
    problems = failed(result)
    if problems:
        print(f"# the campaign failed: {'; '.join(problems)}", file=sys.stderr)
        sys.exit(1)


def failed(result: dict) -> list[str]:
    """What makes a campaign fail: a 5xx or an answer out of shape (streams
    checked event by event), a hang, a health check not 200, the greedy
    answer changed, an exception in the server's log, the server gone."""
    checks = {"answers out of shape or 5xx": result["failure_kinds"], "hangs": result["hangs"],
              "health checks not 200": len(result["health_not_200"]),
              "greedy answer changed": not result["greedy_unchanged"],
              "exceptions in the server's log": len(result["server_exceptions"]),
              "server exited": result["server_exited_during_campaign"]}
    return [f"{name}: {value}" for name, value in checks.items() if value]


if __name__ == "__main__":
    main()
