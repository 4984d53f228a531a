"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` with their status."""

from fastapi.responses import JSONResponse

from .engine import EngineFailure


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


def server_error(error: Exception) -> ApiError:
    """A request that failed after it was accepted: a 500."""
    code = "engine_failure" if isinstance(error, EngineFailure) else None
    return ApiError(str(error), status=500, code=code, kind="server_error")
