"""A step that raises (fault injected into the runner) fails only the requests in flight, with
a 500-class error delta, and the engine keeps serving new requests."""
import zmq

from tiny_models import make_tiny
from metrale import wire
from metrale.config import EngineConfig
from metrale.core import EngineCore
from metrale.engine import EngineAddresses, EngineServer
from metrale.models.loader import load_checkpoint


def test_failed_step_fails_requests_in_flight_and_engine_serves_on(tmp_path):
    core = EngineCore(load_checkpoint(make_tiny("llama", tmp_path / "m")),
                      EngineConfig(max_seq_len=128, max_batch_size=4))
    server = EngineServer(core, {"name": "tiny"}, EngineAddresses.ipc(str(tmp_path)), None)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"fe")
    sub.connect(server.addresses.output)
    while True:          # the subscription is live once an echo comes back (ZeroMQ drops before)
        server._send("fe", [])
        if sub.poll(100):
            sub.recv_multipart()
            break
    real_execute = core.runner.execute
    calls = []

    def failing_once(out, on_launch=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real_execute(out, on_launch)

    core.runner.execute = failing_once
    try:
        for rid in ("a", "b"):
            server._submit(wire.Submit(rid, "fe", (1, 2, 3), {"max_tokens": 3, "temperature": 0}))
        server._step()                       # raises inside: both requests fail
        assert not core.has_unfinished() and not server.live
        server._submit(wire.Submit("c", "fe", (4, 5), {"max_tokens": 2, "temperature": 0,
                                                        "ignore_eos": True}))
        while core.has_unfinished():
            server._step()
        server._flush()                      # as the loop does once nothing is left to run
        deltas = []
        while sub.poll(1000):
            deltas += wire.decode(sub.recv_multipart()[1:]).deltas
        failed = {d.request_id: d for d in deltas if d.error}
        assert set(failed) == {"a", "b"} and all(d.error_status == 500 for d in failed.values())
        assert sum(len(d.token_ids) for d in deltas if d.request_id == "c") == 2
    finally:
        sub.close(0)
        server.close()
