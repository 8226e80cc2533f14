"""AsyncEngineClient: a frontend worker's connection to the engine (asyncio + ZeroMQ).

One client per frontend worker process. It pushes Submit/Abort, subscribes to its own topic of
the engine's output PUB socket, and dispatches each TokenDelta to the queue of the request it
belongs to; control calls (health, model info, stats, rate limits) go over a DEALER socket.

Liveness, both ways, independent of request work:

* frontend -> engine: a heartbeat every second from a dedicated thread with its own socket, so a
  worker whose event loop is busy (a huge prompt being tokenized) is not declared dead and its
  other streams are not aborted. When the heartbeats stop (the worker was killed), the engine
  aborts its requests.
* engine -> frontend: the engine is lost when the output connection closes (a ZeroMQ monitor
  event: a killed engine is noticed at once, over ipc:// and tcp://; a host that vanished
  without closing it stops answering the connection's ZMTP heartbeats, which libzmq's I/O
  threads exchange whatever the engine's step loop is doing, and the connection is closed after
  ZMTP_HEARTBEAT_TIMEOUT_MS), or, as a backstop for an engine process that is alive but hung,
  when not even an echo of our heartbeats has come for ENGINE_SILENCE_S while requests are
  open. That backstop is long on purpose: one CPU prefill step of 8192 tokens can take tens of
  seconds, and the engine echoes only between steps. Then every open request
  of this worker gets an error delta (503) at once, and `on_lost` is called; new submits are
  refused with EngineUnavailable until the engine is heard again.

    async for delta in client.generate(request_id, prompt_ids, sampling_params):
        ...   # wire.TokenDelta; the last one has finish_reason set
    reply_data = await client.control(wire.StatsQuery())

A hot swap (metrale.swap) reaches the client as wire.ModelChanged messages on its output topic,
handed to `on_model_changed`; Submits carry `load_id`, the model load they were tokenized for.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from metrale import wire
from metrale.sampling import SamplingParams

log = logging.getLogger("metrale.client")

ENGINE_SILENCE_S = 120.0       # no echo for this long while requests are open: the engine hangs
ZMTP_HEARTBEAT_IVL_MS = 1000   # connection-level pings, answered by the engine's libzmq I/O thread
ZMTP_HEARTBEAT_TIMEOUT_MS = 3000
WATCH_INTERVAL_S = 0.25


class EngineUnavailable(RuntimeError):
    """The engine did not answer in time, or is gone: the API answers 503, retriable."""


class ControlError(ValueError):
    """The engine refused a control request: its message, and the reply's data (a refused swap
    carries the HTTP `status` and `code` to answer with)."""

    def __init__(self, message: str, data: dict):
        super().__init__(message)
        self.data = data


class StoreRefused(Exception):
    """The engine's store refused a request (metrale.store.StoreError across the wire)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class _HeartbeatThread(threading.Thread):
    """Sends this frontend's heartbeat every wire.HEARTBEAT_INTERVAL_S on a socket of its own: the
    engine hears it whatever the event loop is doing."""

    def __init__(self, address: str, frontend_id: str):
        super().__init__(name="metrale-heartbeat", daemon=True)
        self.address = address
        self.msg = wire.encode(wire.Heartbeat(frontend_id))
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)     # no backlog of beats for an engine that is gone
        sock.setsockopt(zmq.SNDHWM, 2)
        sock.connect(self.address)
        try:
            while not self.stopped.is_set():
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(self.msg, zmq.NOBLOCK)
                self.stopped.wait(wire.HEARTBEAT_INTERVAL_S)
        finally:
            sock.close(0)


class AsyncEngineClient:
    def __init__(self, addresses: dict, frontend_id: str | None = None,
                 control_timeout_s: float = 5.0, on_lost=None, on_model_changed=None):
        self.addresses = addresses
        self.frontend_id = frontend_id or f"fe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.control_timeout_s = control_timeout_s
        self.on_lost = on_lost           # called (no arguments) when the engine is lost
        self.on_model_changed = on_model_changed   # called with each wire.ModelChanged (a swap)
        self.load_id = 0                 # the model load requests are tokenized for (Submit)
        self.ctx = zmq.asyncio.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(addresses["submit"])
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.frontend_id.encode())
        self.sub.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        self.sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sub.connect(addresses["output"])
        self._control_lock = asyncio.Lock()
        self._dealer = None
        self.queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._heartbeat: _HeartbeatThread | None = None
        self._heard = asyncio.Event()   # set by every message on our topic (heartbeat echoes too)
        self.last_heard = time.monotonic()
        self.lost: str | None = None    # why the engine is considered gone; None while it is up

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the output reader, the liveness watch and the heartbeat thread (call from
        inside the event loop)."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read_outputs()),
                           loop.create_task(self._watch_disconnects()),
                           loop.create_task(self._watch_silence())]
            self._heartbeat = _HeartbeatThread(self.addresses["submit"], self.frontend_id)
            self._heartbeat.start()

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
            self._heartbeat.join(2.0)
            self._heartbeat = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        with contextlib.suppress(zmq.ZMQError):
            self.sub.disable_monitor()
        for s in (self.push, self.sub, self._dealer, self._monitor):
            if s is not None:
                s.close(0)

    async def _read_outputs(self) -> None:
        while True:
            topic, *frames = await self.sub.recv_multipart()
            try:
                out = wire.decode(frames)
            except ValueError:
                continue
            self.last_heard = time.monotonic()
            if self.lost is not None:
                log.info("the engine is back (was: %s)", self.lost)
                self.lost = None
            self._heard.set()
            if type(out) is wire.ModelChanged:
                if self.on_model_changed is not None:
                    self.on_model_changed(out)
                continue
            for delta in out.deltas:
                q = self.queues.get(delta.request_id)
                if q is not None:
                    q.put_nowait(delta)

    # -- liveness ---------------------------------------------------------------------------
    async def _watch_disconnects(self) -> None:
        """The output connection closed: the engine process is gone (or restarting)."""
        while True:
            event = await recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.engine_gone("the connection to the engine closed")

    async def _watch_silence(self) -> None:
        """No echo for ENGINE_SILENCE_S: the engine's loop hangs. A pause of this loop itself is
        not the engine's silence: after one, the clock starts again."""
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = loop.time()
            if now - tick > 4 * WATCH_INTERVAL_S:       # this loop was stalled, not the engine
                self.last_heard = max(self.last_heard, time.monotonic())
            tick = now
            silent = time.monotonic() - self.last_heard
            if self.queues and self.lost is None and silent > ENGINE_SILENCE_S:
                self.engine_gone(f"no word from the engine for {silent:.0f}s")

    def engine_gone(self, why: str) -> None:
        """Fail every open request of this worker at once (503) and tell `on_lost`."""
        first = self.lost is None
        self.lost = why
        failed = wire.TokenDelta("", (), "error", error=why, error_status=503)
        for rid, q in list(self.queues.items()):
            q.put_nowait(failed._replace(request_id=rid))
        if first:
            log.warning("engine lost (%s): failed %d open requests", why, len(self.queues))
            if self.on_lost is not None:
                self.on_lost()

    async def wait_subscribed(self, timeout_s: float) -> bool:
        """Wait for the engine's next echo of our heartbeat on our output topic: once one has
        come, nothing the engine publishes for us is lost to a subscription still in flight.
        Call again after the engine restarted."""
        self.start()
        self._heard.clear()
        try:
            await asyncio.wait_for(self._heard.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams):
        """Submit and yield the request's TokenDeltas until it finishes. Leaving the iterator
        early (client disconnect, stop string matched) aborts the request in the engine. A
        lost engine ends it with an error delta (error_status 503)."""
        self.start()
        if self.lost is not None:
            raise EngineUnavailable(self.lost)
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            msg = wire.encode(wire.Submit(request_id, self.frontend_id, prompt_token_ids,
                                          sampling_params, self.load_id))
            try:
                async with asyncio.timeout(self.control_timeout_s):
                    await self.push.send_multipart(msg)
            except TimeoutError:
                raise EngineUnavailable("the engine did not take the request within "
                                        f"{self.control_timeout_s:.0f}s") from None
            while True:
                delta = await q.get()
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id, "client_gone")

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        with contextlib.suppress(zmq.Again):
            await self.push.send_multipart(wire.encode(wire.Abort(request_id, reason)),
                                           zmq.NOBLOCK)

    # -- control ----------------------------------------------------------------------------
    async def control(self, request, timeout_s: float | None = None) -> dict:
        """One control round trip (`request`: one of wire.CONTROL_REQUESTS) -> the reply's data;
        EngineUnavailable when the engine does not answer within `timeout_s` (default:
        control_timeout_s), ValueError with the engine's message when it refused."""
        reply = await self._round_trip(request, timeout_s)
        if not reply.ok:
            raise ControlError(reply.data.get("error", f"control {wire.kind(request)!r} failed"),
                               reply.data)
        return reply.data

    async def store(self, op: str, owner: str = "", timeout_s: float | None = None,
                    **args) -> dict:
        """A stored-responses / conversations operation (wire.StoreRequest) -> its data, once
        the engine has journalled it; StoreRefused with the status the API answers (404 for
        an unknown id, 400) when the store refused it."""
        reply = await self._round_trip(wire.StoreRequest(op, owner, args), timeout_s)
        if not reply.ok:
            data = reply.data
            raise StoreRefused(int(data.get("status") or 500),
                               str(data.get("error", f"store {op!r} failed")), data.get("param"))
        return reply.data

    async def _round_trip(self, request, timeout_s: float | None) -> wire.ControlReply:
        op = wire.kind(request)
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        async with self._control_lock:
            if self._dealer is None:
                self._dealer = self.ctx.socket(zmq.DEALER)
                self._dealer.setsockopt(zmq.LINGER, 0)
                self._dealer.connect(self.addresses["control"])
            await self._dealer.send_multipart(wire.encode(request))
            if not await self._dealer.poll(int(timeout_s * 1000)):
                # the reply may still come: a fresh socket keeps it from answering the next call
                self._dealer.close(0)
                self._dealer = None
                raise EngineUnavailable(f"the engine did not answer {op!r} within "
                                        f"{timeout_s:g}s")
            return wire.decode(await self._dealer.recv_multipart())
