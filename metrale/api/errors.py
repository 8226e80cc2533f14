"""API errors in the OpenAI shape, and the statuses they map to.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

Handlers raise `APIError` (or one of the constructors below); the frontend turns it into a
response with `APIError.status` and `APIError.headers`. Messages say what was wrong and what to
do about it.
"""
from __future__ import annotations

import orjson

# HTTP status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request itself is wrong."""
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r} "
                    "(GET /v1/models lists it)", param="model", code="model_not_found")


def engine_unavailable(detail: str) -> APIError:
    """503, retriable: the engine is loading, restarting or gone."""
    return APIError(503, f"the engine is not available ({detail}); retry shortly",
                    code="model_not_loaded", headers={"Retry-After": "1"})


def from_engine(status: int, message: str) -> APIError:
    """A refusal the engine sent back in a TokenDelta (error, error_status)."""
    status = status or 500
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    code = {429: "queue_full", 503: "model_not_loaded"}.get(status)
    return APIError(status, message, code=code, headers=headers)
