"""Limits on what a client may send, enforced before any handler runs.

Every refusal is a 4xx in the shape of the API that was called (metrale.api.errors), never a 5xx,
never a dead worker. Three layers, outermost first:

1. `GuardedH11Protocol` (uvicorn's h11 protocol, selected in frontends/gunicorn_conf.py):
   - the request head (request line + headers) must arrive within METRALE_BODY_TIMEOUT_S of the
     connection opening or of the previous response; a client that dribbles its headers
     (slowloris) gets 408 and the connection is closed. (uvicorn itself only times out idle
     keep-alive connections, and any byte resets that timer.) An idle keep-alive connection is
     still closed by uvicorn after gunicorn's `keepalive` seconds.
   - a head larger than METRALE_MAX_HEADER_BYTES while incomplete (h11's
     max_incomplete_event_size) gets 431; any other HTTP/1.1 syntax error (bad Content-Length,
     bad request line, invalid header bytes) gets 400. Both close the connection.
2. `InputLimits` (ASGI middleware around the Falcon app), in this order:
   - 400 for a request line that names another HTTP version than 1.0 / 1.1 (`HTTP/2.0` over
     plain HTTP/1 framing; real HTTP/2 needs a proxy in front);
   - 431 when the parsed headers total more than METRALE_MAX_HEADER_BYTES (h11 checks only heads
     that arrive in pieces, so this is the exact check);
   - 401 from the auth gate (frontends.worker.Worker.gate) before a byte of the body is read;
   - 413 when Content-Length exceeds METRALE_MAX_BODY_BYTES (before reading a byte), or when a
     chunked body grows past it;
   - 408 when the body has not fully arrived within METRALE_BODY_TIMEOUT_S of the head (one
     deadline for the whole body, applied to every `receive`);
   The body is read here, in full, and replayed to the app: handlers never wait on a slow client.
3. `parse_json` (called by frontends.worker.read_json for every JSON body): 400 for invalid JSON,
   invalid UTF-8 or lone surrogates, NaN / Infinity / numbers that overflow a double (orjson
   refuses them), integers outside 64 bits, nesting deeper than MAX_JSON_DEPTH (a 100k-deep
   `[[[[...` stops at orjson's own depth limit of 1024, without recursion in Python), any string
   longer than MAX_STRING_CHARS, and more than METRALE_MAX_MESSAGES entries in `messages`.

Not covered here: the number of connections a client may hold open (use a reverse proxy or a
firewall for per-IP connection caps); TLS (terminate it in a proxy).
"""
from __future__ import annotations

import asyncio
import http
import os

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

from metrale import levers
from metrale.api import errors
from metrale.api.errors import APIError

MAX_JSON_DEPTH = 64
MAX_STRING_CHARS = 8 * 2**20
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


# ---- JSON bodies ----------------------------------------------------------------------------

def parse_json(raw: bytes, max_messages: int):
    """`raw` as JSON, checked against the limits above; APIError(400) naming what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):
            raise _too_deep() from None
        raise errors.invalid(f"the request body is not valid JSON ({e}); send UTF-8 JSON "
                             "(NaN and Infinity are not JSON)") from None
    check_tree(body)
    if isinstance(body, dict):
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > max_messages:
            raise errors.invalid(f"'messages' holds {len(messages)} messages; at most "
                                 f"{max_messages} are accepted (METRALE_MAX_MESSAGES)",
                                 "messages")
    return body


def check_tree(value) -> None:
    """Depth, string lengths and integer range of a parsed JSON value, walked with an explicit
    stack (no recursion, so no depth can blow the Python stack)."""
    stack = [([value], 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if type(node) is dict:
            for key in node:
                if len(key) > MAX_STRING_CHARS:
                    raise _too_long()
            node = node.values()
        for v in node:
            t = type(v)
            if t is dict or t is list:
                stack.append((v, depth + 1))
            elif t is str:
                if len(v) > MAX_STRING_CHARS:
                    raise _too_long()
            elif t is int and not INT64_MIN <= v <= INT64_MAX:
                raise errors.invalid(f"the integer {v} does not fit in 64 bits; integers must "
                                     f"be between {INT64_MIN} and {INT64_MAX}")


def _too_deep() -> APIError:
    return errors.invalid(f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} "
                          "levels; flatten it")


def _too_long() -> APIError:
    return errors.invalid(f"a string in the request body is longer than {MAX_STRING_CHARS} "
                          "characters")


# ---- the ASGI layer -------------------------------------------------------------------------

class _ClientGone(Exception):
    pass


class InputLimits:
    """ASGI middleware: header size (431), body size (413) and body deadline (408); reads the
    whole body and replays it to `app`, so the app never waits on a slow client."""

    def __init__(self, app, max_body_bytes: int, max_header_bytes: int, body_timeout_s: float,
                 gate=None):
        self.app = app
        self.gate = gate            # gate(scope) raises APIError (401) or returns
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            _check_http_version(scope)
            self._check_headers(scope)
            if self.gate is not None:
                self.gate(scope)
            body = await self._read_body(scope, receive)
        except APIError as e:
            return await send_error(send, e, scope.get("path", ""))
        except _ClientGone:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()      # after the body: only http.disconnect comes

        return await self.app(scope, replay, send)

    def _check_headers(self, scope) -> None:
        size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > self.max_header_bytes:
            raise APIError(431, f"the request headers total {size} bytes; at most "
                           f"{self.max_header_bytes} are accepted (METRALE_MAX_HEADER_BYTES)",
                           code="request_header_fields_too_large")

    async def _read_body(self, scope, receive) -> bytes:
        limit = self.max_body_bytes
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:  # h11 checked it
                raise too_large(limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise APIError(408, "the request body did not arrive within "
                               f"{self.body_timeout_s:g}s (METRALE_BODY_TIMEOUT_S)",
                               code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _check_http_version(scope) -> None:
    version = scope.get("http_version", "1.1")
    if version not in ("1.0", "1.1"):
        raise errors.invalid(f"HTTP/{version} is not served here; send HTTP/1.1 (put an HTTP/2 "
                             "proxy in front for HTTP/2 clients)")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes "
                    "(METRALE_MAX_BODY_BYTES)", code="request_too_large")


async def send_error(send, e: APIError, path: str) -> None:
    """An error response straight from the ASGI layer; the connection is closed after it (the
    client may still be sending a body nobody will read)."""
    body = e.json_for(path)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               (b"x-metrale-worker", str(os.getpid()).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- the HTTP protocol ----------------------------------------------------------------------

class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head, and its protocol errors
    (oversized or malformed heads) answered in our JSON error shape instead of plain text."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:      # the head is in
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()                     # the next request's head

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(_head_timeout_s(), self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        pending = self.conn.trailing_data[0]
        if pending:     # a head was started and never finished: tell the client why
            timeout = _head_timeout_s()
            self._write_error(pending, APIError(
                408, f"the request headers did not arrive within {timeout:g}s "
                "(METRALE_BODY_TIMEOUT_S)", code="request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the head: 431 when it outgrew the limit, 400 otherwise."""
        self._cancel_head_timer()
        pending = self.conn.trailing_data[0]
        limit = _max_header_bytes()
        if len(pending) > limit:
            e = APIError(431, f"the request head is larger than {limit} bytes "
                         "(METRALE_MAX_HEADER_BYTES)", code="request_header_fields_too_large")
        else:
            e = errors.invalid("the request is not valid HTTP/1.1 (request line, headers or "
                               "Content-Length)")
        self._write_error(pending, e)
        self.transport.close()

    def _write_error(self, pending: bytes, e: APIError) -> None:
        parts = pending.split(b" ", 2)
        path = parts[1].split(b"?")[0].decode("latin-1") if len(parts) > 2 else ""
        body = e.json_for(path)
        head = (f"HTTP/1.1 {e.status} {http.HTTPStatus(e.status).phrase}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\nx-metrale-worker: {os.getpid()}\r\n\r\n")
        self.transport.write(head.encode() + body)


def _head_timeout_s() -> float:
    return levers.get("METRALE_BODY_TIMEOUT_S")


def _max_header_bytes() -> int:
    return levers.get("METRALE_MAX_HEADER_BYTES")
