"""The frontend worker: a Falcon ASGI app in front of one engine.

ASGI (not WSGI) because one worker must hold hundreds of open SSE streams at once: each stream is
a coroutine waiting on the engine, not a thread.

The worker is stateless. At startup (the ASGI lifespan) it opens one AsyncEngineClient and asks
the engine for `model_info` (retrying while the engine loads); from it it builds the Tokenizer
and the chat template, so a frontend on another host needs no model files. Until then every
model route answers 503 `model_not_loaded` (retriable), and /health too.

    create_app(FrontendSettings(engine={"submit": ..., ...})) -> ASGI callable

Auth (`--require-auth`): every route but /health needs a key (/openapi.json included), and
/metrics too unless `--metrics-public`. A key is accepted as `Authorization: Bearer KEY` or as `x-api-key: KEY`
on every route, OpenAI and Anthropic alike (the OpenAI SDK sends the first, the Anthropic SDK the
second; Claude Code sends either); when both are sent, the Bearer one is the one checked. The
key is compared, in constant time, with every loaded key (SHA-256 digests, so not even its
length leaks); a refusal is a 401 that does not say which keys exist.

Rate limits (METRALE_RATE_LIMIT_*) are kept by the engine, shared by every worker; the key is a
digest of the API key when auth is on, else the client address (uvicorn trusts X-Forwarded-For
from the addresses in gunicorn's forwarded_allow_ips, 127.0.0.1 by default: a local reverse
proxy's clients get a bucket each). Responses carry x-ratelimit-{limit,remaining,reset}-
{requests,tokens}; a 429 carries Retry-After.

Input limits (HTTP version, header and body size, body and header deadlines, JSON depth, string
and integer sizes, message count) are frontends.limits.

Engine loss (killed, restarting): the engine client notices it at once (metrale.client), fails
every open request of the worker with a 503, and `Worker.engine_lost` makes every model route
answer 503 `model_not_loaded` with Retry-After until the engine answers again.

Every request gets one access log line (logger `metrale.access`, INFO): method, path, status,
milliseconds, and the request id (the client's `x-request-id`, else a fresh one, echoed back in
the `x-request-id` response header).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass, field

import falcon
import falcon.asgi
import tokenizers

from frontends import limits
from metrale import levers, wire
from metrale.api import errors
from metrale.api.errors import APIError
from metrale.chat import ChatTemplate
from metrale.client import AsyncEngineClient, EngineUnavailable
from metrale.tokenizer import Tokenizer

log = logging.getLogger("metrale.frontend")
access_log = logging.getLogger("metrale.access")

MODEL_INFO_RETRY_S = 0.5
MODEL_INFO_TIMEOUT_S = 1.0     # per model_info attempt while the engine loads or restarts
PROBE_TIMEOUT_S = 2.0


@dataclass
class FrontendSettings:
    engine: dict                                  # EngineAddresses.to_dict()
    auth_tokens: list[str] = field(default_factory=list)
    require_auth: bool = False
    metrics_public: bool = False
    max_body_bytes: int = 32 * 2**20
    body_timeout_s: float = 30.0
    control_timeout_s: float = 5.0
    max_header_bytes: int = field(
        default_factory=lambda: levers.get("METRALE_MAX_HEADER_BYTES"))
    max_messages: int = field(default_factory=lambda: levers.get("METRALE_MAX_MESSAGES"))

    def __post_init__(self):
        if any(not t.strip() for t in self.auth_tokens):
            raise ValueError("an API key is empty: every --auth-token and every line of "
                             "--auth-tokens-file must hold a key")
        if self.require_auth and not self.auth_tokens:
            raise ValueError("--require-auth needs at least one key: pass --auth-token KEY or "
                             "--auth-tokens-file PATH")

    @classmethod
    def from_dict(cls, d: dict) -> "FrontendSettings":
        return cls(**d)


class Worker:
    """Per-process state: the engine client and the model's tokenizer and template."""

    def __init__(self, settings: FrontendSettings):
        self.settings = settings
        self.client: AsyncEngineClient | None = None
        self.info: dict | None = None
        self.ready_info: dict | None = None
        self.tokenizer: Tokenizer | None = None
        self.template: ChatTemplate | None = None
        self.max_prompt_bytes = 0        # more UTF-8 than this cannot fit the context (_use)
        self._loader: asyncio.Task | None = None
        self._key_digests = [_digest(t) for t in settings.auth_tokens]

    async def startup(self) -> None:
        self.client = AsyncEngineClient(self.settings.engine,
                                        control_timeout_s=self.settings.control_timeout_s,
                                        on_lost=self.engine_lost)
        self.client.start()
        self._loader = asyncio.get_running_loop().create_task(self._load_model_info())

    async def shutdown(self) -> None:
        if self._loader:
            self._loader.cancel()
        if self.client:
            await self.client.close()

    async def _load_model_info(self) -> None:
        while True:
            try:
                info = wire.ModelInfo.from_dict(await self.client.control(
                    "model_info", timeout_s=MODEL_INFO_TIMEOUT_S)).to_dict()
            except EngineUnavailable:
                await asyncio.sleep(MODEL_INFO_RETRY_S)
                continue
            except ValueError as e:     # an error reply, or a model_info that does not validate
                log.error("the engine's model_info is unusable (%s); asking again", e)
                await asyncio.sleep(MODEL_INFO_RETRY_S)
                continue
            self._use(info)
            while not await self._probe():
                pass
            self.ready_info = info
            log.info("frontend ready for %s", info.get("name"))
            return

    async def _probe(self) -> bool:
        """Proves the engine's output reaches this worker: no client request is sent before the
        output subscription is connected (see AsyncEngineClient.wait_subscribed)."""
        return await self.client.wait_subscribed(PROBE_TIMEOUT_S)

    def _use(self, info: dict) -> None:
        backend = tokenizers.Tokenizer.from_str(info["tokenizer_json"])
        tok = Tokenizer(backend, info.get("tokenizer_config"), info.get("generation_config"))
        template = None
        if info.get("chat_template"):
            template = ChatTemplate(info["chat_template"], special_tokens=tok.special_tokens_map,
                                    origin=f"the chat template of {info.get('name')}")
        self.tokenizer, self.template, self.info = tok, template, info
        self.max_prompt_bytes = max_prompt_bytes(backend, info["max_seq_len"])

    def engine_lost(self) -> None:
        """The engine stopped answering: serve 503 until it is back and a probe went through
        (after a restart the output subscription must be proven again)."""
        if self._loader is None or self._loader.done():
            self.ready_info = None
            self._loader = asyncio.get_running_loop().create_task(self._load_model_info())

    def ready(self) -> dict:
        """The model info; 503 while the engine has not answered yet."""
        if self.ready_info is None:
            raise errors.engine_unavailable("the model is still loading")
        return self.ready_info

    # -- auth and rate limits -------------------------------------------------------------------
    def api_key(self, req) -> str | None:
        return _presented_key(req.get_header("Authorization"), req.get_header("x-api-key"))

    def is_open(self, path: str) -> bool:
        """Routes served without a key: /health, and /metrics with --metrics-public."""
        path = path.rstrip("/") or "/"
        return path in OPEN_PATHS or (path == "/metrics" and self.settings.metrics_public)

    def gate(self, scope) -> None:
        """The auth check at the ASGI layer (frontends.limits.InputLimits), before the body is
        read: a client without a key cannot make a worker buffer a body."""
        if not self.settings.require_auth or self.is_open(scope.get("path", "")):
            return
        headers = dict(scope["headers"])        # a repeated header: the last one counts
        auth, x_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        self.check_key(_presented_key(auth and auth.decode("latin-1"),
                                      x_key and x_key.decode("latin-1")))

    def check_auth(self, req) -> None:
        if self.settings.require_auth:
            self.check_key(self.api_key(req))

    def check_key(self, key: str | None) -> None:
        presented = _digest(key or "")
        ok = False
        for digest in self._key_digests:   # every key, no early exit: timing says nothing
            ok |= hmac.compare_digest(presented, digest)
        if not ok or not key:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>'", code="invalid_api_key")

    def rate_limit_key(self, req) -> str:
        """Whose bucket a request is charged to: the API key (as a digest: the engine never
        holds secrets) when auth is on, else the client address."""
        if self.settings.require_auth:
            return "key:" + _digest(self.api_key(req) or "").hex()[:32]
        return f"addr:{req.remote_addr or ''}"

    async def rate_limit(self, req, resp, num_tokens: int) -> None:
        if not self.info.get("rate_limit_enabled"):
            return
        answer = await self.client.control("rate_limit", key=self.rate_limit_key(req),
                                           tokens=num_tokens)
        headers = {}
        for name in ("requests", "tokens"):
            if f"limit_{name}" in answer:
                headers[f"x-ratelimit-limit-{name}"] = str(answer[f"limit_{name}"])
                headers[f"x-ratelimit-remaining-{name}"] = str(answer[f"remaining_{name}"])
                if f"reset_{name}" in answer:
                    headers[f"x-ratelimit-reset-{name}"] = duration(answer[f"reset_{name}"])
        if not answer.get("allowed", True):
            wait = answer.get("retry_after", 1.0)
            headers["Retry-After"] = str(max(1, math.ceil(wait)) if math.isfinite(wait) else 60)
            limit = answer.get("limit_tokens")
            if limit is not None and num_tokens > limit:
                message = (f"this request needs {num_tokens} tokens (prompt + max_tokens) but "
                           f"the token budget of this key is {limit}; lower max_tokens")
            else:
                message = ("rate limit exceeded for this key; retry after "
                           f"{headers['Retry-After']}s")
            raise APIError(429, message, code="rate_limit_exceeded", headers=headers)
        resp.set_headers(headers)


def max_prompt_bytes(backend: tokenizers.Tokenizer, max_seq_len: int) -> int:
    """The most UTF-8 bytes a prompt of max_seq_len tokens can hold: the longest token's bytes
    (as its vocabulary string, which is never shorter than the text it decodes to), x2 for
    normalizers that shorten text."""
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in backend.get_vocab()),
                  default=16)
    return 2 * max(16, longest) * max_seq_len


def _presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """`Authorization: Bearer KEY` if sent, else `x-api-key: KEY`."""
    auth = authorization or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return x_api_key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def duration(seconds: float) -> str:
    """OpenAI's spelling of x-ratelimit-reset-*: 20ms, 1.5s, 6m0s."""
    if not math.isfinite(seconds) or seconds < 0:
        seconds = 0.0
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms / 1000, 60)
    secs = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{secs}" if minutes else secs


# ---- middleware and error handlers ----------------------------------------------------------

OPEN_PATHS = ("/health",)


class AuthMiddleware:
    def __init__(self, worker: Worker):
        self.worker = worker

    async def process_startup(self, scope, event):
        await self.worker.startup()

    async def process_shutdown(self, scope, event):
        await self.worker.shutdown()

    async def process_request(self, req, resp):
        resp.set_header("x-metrale-worker", str(os.getpid()))
        if not self.worker.is_open(req.path):
            self.worker.check_auth(req)


def _write_error(req, resp, e: APIError) -> None:
    resp.status = e.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = e.json_for(req.path)      # the Anthropic shape on /v1/messages*
    resp.set_headers(e.headers)
    resp.stream = None


async def _on_api_error(req, resp, e: APIError, params, **kwargs):
    _write_error(req, resp, e)


async def _on_http_error(req, resp, e: falcon.HTTPError, params, **kwargs):
    status = e.status_code
    if status == 404:
        message = f"no route {req.method} {req.path}; see GET /v1/models and the API reference"
    elif status == 405:
        allowed = ", ".join((e.headers or {}).get("Allow", "").split(","))
        message = f"method {req.method} is not allowed on {req.path} (allowed: {allowed})"
    else:
        message = e.description or e.title or str(status)
    _write_error(req, resp, APIError(status, message, headers=dict(e.headers or {})))


async def _on_unexpected(req, resp, e: Exception, params, **kwargs):
    log.exception("internal error on %s %s", req.method, req.path)
    _write_error(req, resp, APIError(500, f"internal error ({type(e).__name__}); see the "
                                          "server log"))


# ---- body reading ---------------------------------------------------------------------------

async def read_json(req, settings: FrontendSettings):
    """The request body as JSON, checked by frontends.limits.parse_json (400 naming what is
    wrong). Size (413) and deadline (408) were enforced by limits.InputLimits, which has read
    the body already; they are checked again here for an app run without it."""
    limit = settings.max_body_bytes
    if req.content_length is not None and req.content_length > limit:
        raise limits.too_large(limit)
    try:
        raw = await asyncio.wait_for(_read_limited(req.stream, limit), settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, "the request body did not arrive within "
                       f"{settings.body_timeout_s:g}s (METRALE_BODY_TIMEOUT_S)",
                       code="request_timeout") from None
    if not raw.strip():
        raise errors.invalid("the request body is empty; send a JSON object")
    return limits.parse_json(raw, settings.max_messages)


async def _read_limited(stream, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise limits.too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# ---- disconnect detection -------------------------------------------------------------------

class DisconnectWatch:
    """ASGI wrapper that tells handlers when the client has gone.

    Neither Falcon's `resp.stream` nor uvicorn report a disconnect to a streaming response
    (after it, `send` is a no-op), so once the body has been read this wrapper keeps listening
    for `http.disconnect` and sets `scope["metrale.disconnected"]` (an asyncio.Event)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone = scope["metrale.disconnected"] = asyncio.Event()
        body_done = False
        watcher = None

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def wrapped_receive():
            nonlocal body_done, watcher
            if body_done:
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_done = True
                watcher = asyncio.get_running_loop().create_task(watch())
            return message

        try:
            await self.app(scope, wrapped_receive, send)
        finally:
            if watcher is not None:
                watcher.cancel()


# ---- access log -----------------------------------------------------------------------------

class AccessLog:
    """ASGI wrapper: one log line per request, whatever answered it (a handler, a limit, the
    auth gate): method, path, status, milliseconds, request id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        request_id = _request_id(scope)
        status = 0

        async def send_logged(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()),
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            access_log.info("%s %s %d %.1fms %s", scope.get("method"), scope.get("path"),
                            status, 1000 * (time.monotonic() - t0), request_id)


_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def _request_id(scope) -> str:
    """The client's x-request-id when it is a plain token (it goes into a log line), else new."""
    for k, v in scope["headers"]:
        if k == b"x-request-id" and _REQUEST_ID.fullmatch(v):
            return v.decode("ascii")
    return uuid.uuid4().hex


# ---- the app --------------------------------------------------------------------------------

def create_app(settings: FrontendSettings):
    from frontends.openapi import OpenAPI
    from frontends.routes import add_routes

    worker = Worker(settings)
    app = falcon.asgi.App(middleware=[AuthMiddleware(worker)])
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler(Exception, _on_unexpected)
    app.add_error_handler(falcon.HTTPError, _on_http_error)
    app.add_error_handler(APIError, _on_api_error)
    add_routes(app, worker)
    app.add_route("/openapi.json", OpenAPI(worker))
    return AccessLog(limits.InputLimits(DisconnectWatch(app), settings.max_body_bytes,
                                        settings.max_header_bytes, settings.body_timeout_s,
                                        gate=worker.gate))


def default_settings(engine: dict, **kw) -> FrontendSettings:
    return FrontendSettings(engine=engine, max_body_bytes=levers.get("METRALE_MAX_BODY_BYTES"),
                            **kw)
