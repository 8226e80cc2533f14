"""AsyncEngineClient: a frontend worker's connection to the engine (asyncio + ZeroMQ).

One client per frontend worker process. It pushes Submit/Abort, subscribes to its own topic of
the engine's output PUB socket, and dispatches each TokenDelta to the queue of the request it
belongs to; control calls (health, model info, stats, rate limits) go over a DEALER socket.
A heartbeat every second tells the engine this frontend is alive: when it stops (the worker was
killed), the engine aborts its requests.

    async for delta in client.generate(request_id, prompt_ids, params_dict):
        ...   # wire.TokenDelta; the last one has finish_reason set
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import zmq
import zmq.asyncio

from metrale import wire

HEARTBEAT_INTERVAL_S = 1.0
LIVENESS_CHECK_S = 5.0


class EngineUnavailable(RuntimeError):
    """The engine did not answer in time: the API answers 503, retriable."""


class AsyncEngineClient:
    def __init__(self, addresses: dict, frontend_id: str | None = None,
                 control_timeout_s: float = 5.0):
        self.addresses = addresses
        self.frontend_id = frontend_id or f"fe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.control_timeout_s = control_timeout_s
        self.ctx = zmq.asyncio.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(addresses["submit"])
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.frontend_id.encode())
        self.sub.connect(addresses["output"])
        self._control_lock = asyncio.Lock()
        self._dealer = None
        self.queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._heard = asyncio.Event()   # set by every message on our topic (heartbeat echoes too)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the output reader and the heartbeat (call from inside the event loop)."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read_outputs()), loop.create_task(self._beat())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        for s in (self.push, self.sub, self._dealer):
            if s is not None:
                s.close(0)

    async def _beat(self) -> None:
        msg = wire.encode(wire.Control("heartbeat", {"frontend_id": self.frontend_id}))
        while True:
            await self.push.send_multipart(msg)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _read_outputs(self) -> None:
        while True:
            topic, *frames = await self.sub.recv_multipart()
            try:
                out = wire.decode(frames)
            except ValueError:
                continue
            self._heard.set()
            for delta in out.deltas:
                q = self.queues.get(delta.request_id)
                if q is not None:
                    q.put_nowait(delta)

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
    async def generate(self, request_id: str, prompt_token_ids, sampling_params: dict):
        """Submit and yield the request's TokenDeltas until it finishes. Leaving the iterator
        early (client disconnect, stop string matched) aborts the request in the engine."""
        self.start()
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            await self.push.send_multipart(wire.encode(wire.Submit(
                request_id, self.frontend_id, tuple(prompt_token_ids), sampling_params)))
            while True:
                delta = await self._next(q)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id, "client_gone")

    async def _next(self, q: asyncio.Queue):
        """The next delta; while none comes, make sure the engine is still there (a dead
        engine must give the client a 503, never a hang)."""
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that lands as q.get() completes, and a cancelled (client gone)
                # request then ran on to max_tokens instead of being aborted
                async with asyncio.timeout(LIVENESS_CHECK_S):
                    return await q.get()
            except TimeoutError:
                await self.control("health")

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        await self.push.send_multipart(wire.encode(wire.Abort(request_id, reason)))

    # -- control ----------------------------------------------------------------------------
    async def control(self, op: str, **args) -> dict:
        """One control round trip; EngineUnavailable when the engine does not answer."""
        async with self._control_lock:
            if self._dealer is None:
                self._dealer = self.ctx.socket(zmq.DEALER)
                self._dealer.setsockopt(zmq.LINGER, 0)
                self._dealer.connect(self.addresses["control"])
            await self._dealer.send_multipart(wire.encode(wire.Control(op, args)))
            if not await self._dealer.poll(int(self.control_timeout_s * 1000)):
                # the reply may still come: a fresh socket keeps it from answering the next call
                self._dealer.close(0)
                self._dealer = None
                raise EngineUnavailable(f"the engine did not answer {op!r} within "
                                        f"{self.control_timeout_s:.0f}s")
            reply = wire.decode(await self._dealer.recv_multipart())
        if not reply.ok:
            raise ValueError(reply.data.get("error", f"control {op!r} failed"))
        return reply.data
