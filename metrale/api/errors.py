"""API errors, and the statuses they map to, in the shape of the API that was called.

    OpenAI routes:      {"error": {"message": "...", "type": "invalid_request_error",
                                   "param": "n", "code": null}}
    Anthropic routes:   {"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "..."}}

Handlers raise `APIError` (or one of the constructors below); the frontend turns it into a
response with `APIError.status` and `APIError.headers`, rendered by `APIError.json_for(path)`:
the Anthropic shape on `/v1/messages*`, the OpenAI shape everywhere else. Messages say what was
wrong and what to do about it.
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

# HTTP status -> Anthropic error type (docs.anthropic.com "Errors"); /v1/messages answers an
# unavailable engine as 529 overloaded_error (metrale.api.anthropic_schema.error_status)
_ANTHROPIC_TYPES = {**_TYPES, 413: "request_too_large", 500: "api_error",
                    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}

ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """Whether errors on this route take the Anthropic shape (/v1/messages and below)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


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

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500
                                    else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def json_for(self, path: str) -> bytes:
        """The body in the shape of the API that `path` belongs to."""
        return orjson.dumps(self.anthropic_body() if is_anthropic_path(path) else self.body())


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
