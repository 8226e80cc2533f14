"""The engine loop publishes a step's tokens during the next step (EngineServer._step): what a
frontend hears must still be every token once, in order, and nothing after a request's end,
whether it ends by length, by an abort mid-stream, or while other requests keep running.

The real loop (EngineServer.run) in a thread, a tiny random llama on the CPU backend, the
frontend played by a PUSH and a SUB socket."""
import threading
import time

import pytest
import zmq

from metrale import wire
from tests.serving import wait_subscribed
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.engine_server import EngineAddresses, EngineServer
from metrale.events import Journal, read_events
from metrale.models.loader import load_checkpoint
from metrale.sampling import SamplingParams
from tiny_models import make_tiny


@pytest.fixture()
def engine(tmp_path):
    core = EngineCore(load_checkpoint(make_tiny("llama", tmp_path / "m")),
                      EngineConfig(max_seq_len=256, max_batch_size=4, request_timeout=0))
    server = EngineServer(core, wire.ModelInfo("tiny"), EngineAddresses.ipc(str(tmp_path)),
                          Journal(tmp_path / "journal"))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"fe")
    sub.connect(server.addresses.output)
    push = ctx.socket(zmq.PUSH)
    push.connect(server.addresses.submit)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    wait_subscribed(push, sub, "fe")
    try:
        yield push, sub
    finally:
        server.running = False
        loop.join(10)
        sub.close(0)
        push.close(0)
        server.close()


def submit(push, rid, prompt, max_tokens):
    push.send_multipart(wire.encode(wire.Submit(rid, "fe", tuple(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))))


def collect(sub, streams: dict, until, timeout_s=60.0, on_delta=None):
    """Deltas into streams[rid] until `until(streams)` holds."""
    deadline = time.monotonic() + timeout_s
    while not until(streams):
        assert time.monotonic() < deadline, f"timed out; got {streams}"
        if not sub.poll(100):
            continue
        for d in wire.decode(sub.recv_multipart()[1:]).deltas:
            streams.setdefault(d.request_id, []).append(d)
            if on_delta:
                on_delta(d)


def ended(streams, rids):
    return all(any(d.finish_reason for d in streams.get(r, ())) for r in rids)


def check_stream(deltas):
    """Every token once (the final delta's count), one end, and it is the last delta."""
    ends = [i for i, d in enumerate(deltas) if d.finish_reason]
    assert ends == [len(deltas) - 1], [(d.token_ids, d.finish_reason) for d in deltas]
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == deltas[-1].num_output_tokens
    return tokens, deltas[-1].finish_reason


def test_every_token_once_then_the_end(engine):
    push, sub = engine
    lengths = {"a": 7, "b": 19, "c": 1, "d": 12}
    for i, (rid, n) in enumerate(lengths.items()):
        submit(push, rid, [3 + i, 5, 8, 13, 21], n)
    streams = {}
    collect(sub, streams, lambda s: ended(s, lengths))
    for rid, n in lengths.items():
        tokens, reason = check_stream(streams[rid])
        assert (len(tokens), reason) == (n, "length")


def test_abort_mid_stream_ends_it_and_others_go_on(engine):
    push, sub = engine
    submit(push, "long", [2, 4, 6], 200)
    submit(push, "other", [1, 3, 5], 40)
    aborted = []

    def abort_after_some(d):
        got = sum(len(x.token_ids) for x in streams.get("long", ()))
        if d.request_id == "long" and got >= 5 and not aborted:
            push.send_multipart(wire.encode(wire.Abort("long")))
            aborted.append(got)

    streams = {}
    collect(sub, streams, lambda s: ended(s, ("long", "other")), on_delta=abort_after_some)
    tokens, reason = check_stream(streams["long"])
    assert reason == "abort" and aborted[0] <= len(tokens) < 200
    tokens, reason = check_stream(streams["other"])
    assert (len(tokens), reason) == (40, "length")


def test_a_requests_tokens_are_journalled_before_its_end(engine, tmp_path):
    push, sub = engine
    lengths = {"a": 1, "b": 6, "c": 11}
    for i, (rid, n) in enumerate(lengths.items()):
        submit(push, rid, [7 + i, 9, 11], n)
    collect(sub, {}, lambda s: ended(s, lengths))
    events = list(read_events(tmp_path / "journal"))   # flushed before the deltas went out
    for rid, n in lengths.items():
        [end] = [i for i, e in enumerate(events)
                 if e["type"] == "RequestFinished" and e["request_id"] == rid]
        emitted = [i for i, e in enumerate(events)
                   if e["type"] == "TokensEmitted" and rid in e["counts"]]
        assert emitted and max(emitted) < end, (rid, emitted, end)
        assert sum(events[i]["counts"][rid] for i in emitted) == n
