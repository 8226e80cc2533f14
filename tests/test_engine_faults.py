"""A step that raises (fault injected into the runner) fails only the requests in flight, with
a 500-class error delta, and the engine keeps serving new requests."""
import zmq

from tiny_models import make_tiny
from metrale import wire
from tests.serving import wait_subscribed
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.engine_server import EngineAddresses, EngineServer
from metrale.models.loader import load_checkpoint
from metrale.sampling import SamplingParams


def test_failed_step_fails_requests_in_flight_and_engine_serves_on(tmp_path):
    core = EngineCore(load_checkpoint(make_tiny("llama", tmp_path / "m")),
                      EngineConfig(max_seq_len=128, max_batch_size=4))
    server = EngineServer(core, wire.ModelInfo("tiny"), EngineAddresses.ipc(str(tmp_path)), None)
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

    def failing_once(out, on_launch=None, masks=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real_execute(out, on_launch, masks)

    core.runner.execute = failing_once
    try:
        for rid in ("a", "b"):
            server._submit(wire.Submit(rid, "fe", (1, 2, 3),
                                       SamplingParams(max_tokens=3, temperature=0)))
        server._step()                       # raises inside: both requests fail
        assert not core.has_unfinished() and not server.live
        server._submit(wire.Submit("c", "fe", (4, 5), SamplingParams(max_tokens=2, temperature=0,
                                                                     ignore_eos=True)))
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


def test_no_control_request_or_submit_ends_the_loop(tmp_path):
    """A control op that raises, a reply that cannot be serialised and a Submit whose handling
    raises are each answered with an error; the loop then still answers health and serves."""
    import threading

    core = EngineCore(load_checkpoint(make_tiny("llama", tmp_path / "m")),
                      EngineConfig(max_seq_len=128, max_batch_size=4))
    server = EngineServer(core, wire.ModelInfo("tiny"), EngineAddresses.ipc(str(tmp_path)), None)
    ctx = zmq.Context.instance()
    dealer, push, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    dealer.connect(server.addresses.control)
    push.connect(server.addresses.submit)
    sub.setsockopt(zmq.SUBSCRIBE, b"fe")
    sub.connect(server.addresses.output)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()

    def control(op, **args):
        request = {"health": wire.HealthCheck, "rate_limit": wire.RateLimitCheck}[op](**args)
        dealer.send_multipart(wire.encode(request))
        assert dealer.poll(10_000), f"no answer to {op}: the engine loop is gone"
        return wire.decode(dealer.recv_multipart())

    def deltas_until_end(rid):
        got = []
        while not any(d.finish_reason for d in got):
            assert sub.poll(10_000), f"nothing more for {rid}: {got}"
            got += [d for d in wire.decode(sub.recv_multipart()[1:]).deltas
                    if d.request_id == rid]
        return got

    def raising(*a, **k):
        raise RuntimeError("injected fault")

    try:
        wait_subscribed(push, sub, "fe")
        server.ratelimit.check = raising
        reply = control("rate_limit", key="k", tokens=1)
        assert not reply.ok and "RuntimeError" in reply.data["error"]
        server.ratelimit.check = lambda key, tokens: {"limit_tokens": 10**30}   # not JSON-able
        assert not control("rate_limit", key="k", tokens=1).ok
        assert control("health").data["status"] == "ok"

        real_add = core.add_request
        core.add_request = raising
        push.send_multipart(wire.encode(wire.Submit("bad", "fe", (1, 2),
                                                    SamplingParams(max_tokens=2))))
        [refused] = deltas_until_end("bad")
        assert refused.error_status == 500 and refused.finish_reason == "error"
        core.add_request = real_add
        push.send_multipart(wire.encode(wire.Submit("good", "fe", (1, 2), SamplingParams(
            max_tokens=3, temperature=0, ignore_eos=True))))
        assert sum(len(d.token_ids) for d in deltas_until_end("good")) == 3
        assert control("health").ok
    finally:
        server.running = False
        loop.join(10)
        for s in (dealer, push, sub):
            s.close(0)
        server.close()
