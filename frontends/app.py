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
import logging
import os
import re
import time
import uuid

import falcon
import falcon.asgi

from frontends import anthropic, library, limits, responses
from frontends.openapi import OpenAPI
from frontends.routes import add_routes
from frontends.worker import FrontendSettings, Worker, write_error
from metrale import levers
from metrale.api.errors import APIError

log = logging.getLogger("metrale.frontend")
access_log = logging.getLogger("metrale.access")

__all__ = ["FrontendSettings", "create_app", "default_settings"]


# ---- middleware and error handlers ----------------------------------------------------------

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


async def _on_api_error(req, resp, e: APIError, params, **kwargs):
    write_error(req, resp, e)


async def _on_http_error(req, resp, e: falcon.HTTPError, params, **kwargs):
    status = e.status_code
    if status == 404:
        message = f"no route {req.method} {req.path}; see GET /v1/models and the API reference"
    elif status == 405:
        allowed = ", ".join((e.headers or {}).get("Allow", "").split(","))
        message = f"method {req.method} is not allowed on {req.path} (allowed: {allowed})"
    else:
        message = e.description or e.title or str(status)
    write_error(req, resp, APIError(status, message, headers=dict(e.headers or {})))


async def _on_unexpected(req, resp, e: Exception, params, **kwargs):
    log.exception("internal error on %s %s", req.method, req.path)
    write_error(req, resp, APIError(500, f"internal error ({type(e).__name__}); see the "
                                          "server log"))


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
    worker = Worker(settings)
    app = falcon.asgi.App(middleware=[AuthMiddleware(worker)])
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler(Exception, _on_unexpected)
    app.add_error_handler(falcon.HTTPError, _on_http_error)
    app.add_error_handler(APIError, _on_api_error)
    add_routes(app, worker)
    anthropic.add_routes(app, worker)
    library.add_routes(app, worker)
    responses.add_routes(app, worker)
    app.add_route("/openapi.json", OpenAPI(worker))
    return AccessLog(limits.InputLimits(DisconnectWatch(app), settings.max_body_bytes,
                                        settings.max_header_bytes, settings.body_timeout_s,
                                        gate=worker.gate))


def default_settings(engine: dict, **kw) -> FrontendSettings:
    return FrontendSettings(engine=engine, max_body_bytes=levers.get("METRALE_MAX_BODY_BYTES"),
                            **kw)
