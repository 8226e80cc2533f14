"""A frontend's view of the engine's liveness (metrale.client.AsyncEngineClient) against a
stand-in engine: real ZeroMQ sockets bound where an engine binds them, speaking metrale.wire.

* A busy engine is not a dead one: an engine whose loop is inside one long step (a CPU prefill of
  8192 tokens takes tens of seconds on two cores) echoes no heartbeat for that long, yet its
  connection is alive; the open request must not be failed.
* A vanished engine is noticed: a stopped process (SIGSTOP: its libzmq I/O threads stop too,
  as on a host that went away without closing the connection) stops answering the connection's
  ZMTP heartbeats, and every open request fails with a 503 delta within a few seconds.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import zmq

from metrale import wire
from metrale.client import AsyncEngineClient
from metrale.sampling import SamplingParams

BUSY_S = 7.0     # longer than the 5 s echo silence that used to count as a dead engine


def _addresses(tmp_path) -> dict:
    return {name: f"ipc://{tmp_path}/{name}" for name in ("submit", "output", "control", "events")}


class _StandInEngine(threading.Thread):
    """Echoes heartbeats on the frontend's topic, then, once a Submit came, goes quiet for
    BUSY_S (its loop 'inside a step'; the sockets stay open) and finishes that request."""

    def __init__(self, addresses: dict):
        super().__init__(daemon=True)
        ctx = zmq.Context.instance()
        self.pull, self.pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        self.pull.bind(addresses["submit"])
        self.pub.bind(addresses["output"])
        self.stop = threading.Event()

    def _send(self, frontend_id: str, deltas) -> None:
        self.pub.send_multipart([frontend_id.encode(),
                                 *wire.encode(wire.StepOutput(frontend_id, tuple(deltas)))])

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.pull.poll(50):
                continue
            msg = wire.decode(self.pull.recv_multipart())
            if isinstance(msg, wire.Heartbeat):
                self._send(msg.frontend_id, [])
            elif isinstance(msg, wire.Submit):
                time.sleep(BUSY_S)                                  # one long step
                self._send(msg.frontend_id, [wire.TokenDelta(msg.request_id, (7,), "stop", 1, 1)])
        self.pull.close(0)
        self.pub.close(0)


async def _collect(client: AsyncEngineClient, rid: str) -> list:
    return [d async for d in client.generate(rid, [1, 2, 3], SamplingParams(max_tokens=1))]


def test_a_long_engine_step_does_not_fail_the_open_request(tmp_path):
    addresses = _addresses(tmp_path)
    engine = _StandInEngine(addresses)
    engine.start()

    async def main():
        client = AsyncEngineClient(addresses)
        try:
            assert await client.wait_subscribed(10)
            t0 = time.monotonic()
            deltas = await asyncio.wait_for(_collect(client, "r1"), BUSY_S + 20)
            return deltas, time.monotonic() - t0, client.lost
        finally:
            await client.close()

    try:
        deltas, seconds, lost = asyncio.run(main())
    finally:
        engine.stop.set()
        engine.join(5)
    assert seconds >= BUSY_S - 0.5
    assert [(d.token_ids, d.finish_reason, d.error) for d in deltas] == [((7,), "stop", None)]
    assert lost is None


_STOPPABLE_ENGINE = textwrap.dedent("""
    import sys, zmq
    from metrale import wire
    submit, output = sys.argv[1], sys.argv[2]
    ctx = zmq.Context.instance()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    pull.bind(submit); pub.bind(output)
    print("bound", flush=True)
    while True:
        msg = wire.decode(pull.recv_multipart())
        if isinstance(msg, wire.Heartbeat):
            fid = msg.frontend_id
            pub.send_multipart([fid.encode(), *wire.encode(wire.StepOutput(fid, ()))])
""")


def test_a_vanished_engine_fails_the_open_request_within_seconds(tmp_path):
    addresses = _addresses(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _STOPPABLE_ENGINE, addresses["submit"],
                             addresses["output"]], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "bound"

    async def main():
        client = AsyncEngineClient(addresses)
        try:
            assert await client.wait_subscribed(10)
            task = asyncio.ensure_future(_collect(client, "r2"))
            await asyncio.sleep(0.5)
            os.kill(proc.pid, signal.SIGSTOP)           # no FIN, no pongs: a host gone quiet
            t0 = time.monotonic()
            deltas = await asyncio.wait_for(task, 30)
            return deltas, time.monotonic() - t0
        finally:
            await client.close()

    try:
        deltas, seconds = asyncio.run(main())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert [(d.finish_reason, d.error_status) for d in deltas] == [("error", 503)]
    assert seconds < 8, seconds


def test_a_starting_worker_lets_requests_wait_for_its_first_model_info(monkeypatch):
    """The workers of a server become ready one at a time: a request reaching one that has not
    received its first model_info yet waits for it (Worker.ready_soon) instead of a 503; once a
    worker has been ready, an engine restart answers 503 at once; a worker that never gets one
    answers 503 after FIRST_READY_WAIT_S."""
    from frontends import worker as w
    from metrale.api.errors import APIError

    async def seconds_to_503(worker) -> float:
        """ready_soon() on a worker whose loader never finishes: it must answer 503."""
        worker._loader = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        t0 = time.monotonic()
        try:
            await worker.ready_soon()
            raise AssertionError("expected a 503")
        except APIError as e:
            assert e.status == 503
        finally:
            worker._loader.cancel()
        return time.monotonic() - t0

    async def scenario():
        wk = w.Worker(w.FrontendSettings(engine={}))
        info = {"name": "m"}

        async def loader():
            await asyncio.sleep(0.3)
            wk.ready_info, wk._ever_ready = info, True

        wk._loader = asyncio.get_running_loop().create_task(loader())
        t0 = time.monotonic()
        assert await wk.ready_soon() is info
        assert 0.25 < time.monotonic() - t0 < 5
        wk.ready_info = None                    # the engine restarts: no waiting now
        assert await seconds_to_503(wk) < 0.1
        monkeypatch.setattr(w, "FIRST_READY_WAIT_S", 0.2)
        assert 0.15 < await seconds_to_503(w.Worker(w.FrontendSettings(engine={}))) < 2

    asyncio.run(scenario())
