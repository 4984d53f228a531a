"""Error bodies with their status, in the shape of the API a request spoke:
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` or Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (routes under
``/v1/messages``)."""

import sys
import traceback
import uuid

from fastapi.responses import JSONResponse

from .engine import RETRY_AFTER, EngineFailure, QueueTimeout

ANTHROPIC_PATHS = "/v1/messages"

# Anthropic names its errors by status; a status it has no name for is an api_error
ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers or {}

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    @property
    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_KINDS.get(self.status, "api_error"),
                                           "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error answered to a request for ``path`` (its API's shape)."""
        body = self.anthropic_body if path.startswith(ANTHROPIC_PATHS) else self.body
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def server_error(error: Exception) -> ApiError:
    """A request that failed after it was accepted: a 504 when it waited for
    a row past the queue's bound; a 500 naming the engine's failure (its own
    report); anything else is a fault in the reply's own code, logged with
    its traceback under a reference the client is given in place of its text."""
    if isinstance(error, QueueTimeout):
        return ApiError(str(error), status=504, code="queue_timeout", kind="timeout_error",
                        headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(error, EngineFailure):
        return ApiError(str(error), status=500, code="engine_failure", kind="server_error")
    if isinstance(error, ApiError):
        return error
    reference = uuid.uuid4().hex[:12]
    trace = "".join(traceback.format_exception(error))
    print(f"dspark serve: error {reference} while answering a request:\n{trace}", file=sys.stderr, flush=True)
    return ApiError(f"the server failed while answering (error {reference} in its log)", status=500,
                    kind="server_error")
