"""The server's door: API keys and request sizes, checked before any route reads a body.

Every route but ``/health`` asks for a key when the server has keys:
``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY``
(Anthropic clients), compared in constant time (the digests of the key
given and of each key held, every key compared). A request let in carries
its tenant (``TENANT``: a digest of its key, "" on a server without keys),
which scopes what the server keeps for it (``tenant_scope``); ``/health``
with no valid key tells liveness only. A body larger than the
bound is refused with a 413 before it is parsed: at once when its
``Content-Length`` says so, else as soon as the bytes read pass the bound.
Errors have the shape of the API the path belongs to.
"""

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path

from .errors import ApiError

OPEN_PATHS = ("/health",)
KEY_VARIABLE = "DSPARK_API_KEY"
TENANT = "dspark.tenant"  # the ASGI scope's entry naming a request's tenant (None: a keyed server, no valid key)


def read_keys(keys: list, key_file: str | None) -> tuple:
    """The keys given (``--api-key``, repeatable), those of ``key_file`` (one a
    line; blank lines and lines starting with # skipped) and of the
    ``DSPARK_API_KEY`` environment variable. A key asked for and empty (an
    unset shell variable, a file with no keys) is a ``ValueError``: taken as
    given, it would let in requests that carry no key."""
    found = [(key, "--api-key") for key in keys or []]
    if key_file:
        lines = [line.strip() for line in Path(key_file).read_text().splitlines()]
        in_file = [line for line in lines if line and not line.startswith("#")]
        if not in_file:
            raise ValueError(f"the key file {key_file} holds no keys: put one key a line in it")
        found += [(key, key_file) for key in in_file]
    if KEY_VARIABLE in os.environ:
        found.append((os.environ[KEY_VARIABLE], KEY_VARIABLE))
    return usable_keys(found)


def usable_keys(found: list) -> tuple:
    """The keys of ``(key, where it came from)`` pairs, each checked: not blank, no surrounding space."""
    for key, source in found:
        if not key.strip():
            raise ValueError(f"an empty API key was given ({source}): give a real key, or no key at all")
        if key != key.strip():
            raise ValueError(f"an API key from {source} starts or ends with spaces, which no request can send: "
                             f"remove them")
    return tuple(key for key, _ in found)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name other than localhost counts as not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_matches(given: str, keys: tuple) -> bool:
    """Constant time whatever ``given`` is: every held key is compared."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(_digest(given), _digest(key))
    return matched


def tenant_scope(tenant: str, salt: str | None) -> str:
    """The prompt-cache scope of a request: its tenant's, and within it its
    ``cache_salt``'s (vLLM's field). A digest: no key reaches the cache."""
    if not tenant and salt is None:
        return ""
    return hashlib.sha256(f"{tenant}\0{salt if salt is not None else ''}".encode()).hexdigest()[:32]


def given_key(headers: dict) -> str:
    """The key a request carries (``headers``: lower-case names, as ASGI gives them)."""
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


class Door:
    """ASGI middleware: keys and body sizes before the app sees a request."""

    def __init__(self, app, keys: tuple = (), max_body_bytes: int = 16 << 20):
        self.app, self.keys, self.max_body_bytes = app, tuple(keys), max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        key = given_key(headers)
        valid = not self.keys or key_matches(key, self.keys)
        scope[TENANT] = (_digest(key).hex() if self.keys else "") if valid else None
        if not valid and path not in OPEN_PATHS:
            error = ApiError("a valid API key is needed: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                             status=401, code="invalid_api_key")
            return await error.response(path)(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self.too_large(path)(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the whole body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self.too_large(path)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # later reads wait for the client to leave, as the server's own receive does
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def too_large(self, path: str):
        megabytes = self.max_body_bytes / (1 << 20)
        return ApiError(f"the request body is larger than this server takes ({megabytes:g} MiB); raise "
                        f"--max-body-mb or send less", status=413, code="request_too_large").response(path)
