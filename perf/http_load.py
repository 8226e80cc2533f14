"""Streaming HTTP load for perf/ladder.py --http: C concurrent streamed completions spread over
several client processes, on raw asyncio sockets (no HTTP library in the hot loop).

Why not one httpx process: at ~15,000 streamed tokens/s one Python process spends most of a core
in httpx's SSE plumbing, and the ladder then measures the client, not the server. Each process
here holds C/P connections, parses the chunked SSE framing itself and decodes each event's JSON
with orjson when present. All processes share CLOCK_MONOTONIC (time.perf_counter on Linux), so
per-request timestamps from different processes are comparable; they start together on an Event.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

try:
    import orjson as _json
    _loads = _json.loads
except ImportError:   # the ladder still runs, a little heavier on the client
    import json as _json
    _loads = _json.loads


async def _connect(host: str, port: int, path: str, body: bytes):
    """An open connection and the request to send on it: (reader, writer, request bytes)."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n")
    return reader, writer, head.encode() + body


async def _run(reader, writer, request: bytes):
    """(t0, first text token time, last text token time, completion tokens, response head
    time) of one request; times are time.perf_counter() (CLOCK_MONOTONIC, shared by processes)."""
    t0 = time.perf_counter()
    writer.write(request)
    await writer.drain()
    status = await reader.readline()
    head_at = time.perf_counter()
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip().lower()
    if b" 200 " not in status:
        rest = await reader.read(4096)
        raise RuntimeError(f"HTTP {status.decode().strip()}: {rest[:500]!r}")
    chunked = headers.get("transfer-encoding") == "chunked"
    buf = b""
    first = last = None
    usage = 0
    done = False
    while not done:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            buf += data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
        now = time.perf_counter()
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                done = True
                break
            chunk = _loads(payload)
            choices = chunk.get("choices")
            if choices and choices[0].get("text"):
                first = first or now
                last = now
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    writer.close()
    return t0, first, last, usage, head_at


async def _worker_main(host, port, path, bodies, start, results):
    conns = [await _connect(host, port, path, b) for b in bodies]
    results.put(("ready", None))
    while not start.is_set():          # a process-shared Event; poll without blocking the loop
        await asyncio.sleep(0.0005)
    out = await asyncio.gather(*(_run(r, w, req) for r, w, req in conns), return_exceptions=True)
    results.put(("done", out))


def _worker(host, port, path, bodies, start, results):
    try:
        asyncio.run(_worker_main(host, port, path, bodies, start, results))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", repr(e)))


def run_load(host: str, port: int, path: str, bodies: list[bytes], procs: int = 4,
             timeout_s: float = 900) -> list[tuple]:
    """Send every body as one streamed request, all at once; per request (t0, first, last,
    completion_tokens). Raises on any failed request."""
    ctx = mp.get_context("spawn")
    procs = max(1, min(procs, len(bodies)))
    start, results = ctx.Event(), ctx.Queue()
    shares = [bodies[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_worker, args=(host, port, path, s, start, results), daemon=True)
               for s in shares]
    for w in workers:
        w.start()
    out: list = []
    try:
        ready = 0
        while ready < procs:
            kind, val = results.get(timeout=120)
            if kind == "error":
                raise RuntimeError(f"client process failed: {val}")
            ready += kind == "ready"
        start.set()
        for _ in range(procs):
            kind, val = results.get(timeout=timeout_s)
            if kind == "error":
                raise RuntimeError(f"client process failed: {val}")
            errors = [r for r in val if isinstance(r, BaseException)]
            if errors:
                raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]!r}")
            out += val
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
    return out
