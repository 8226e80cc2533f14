"""EngineServer: the engine process's socket loop, one per GPU rank (the process entry that
builds it is metrale.engine_process).

    drain sockets -> schedule -> run -> commit -> publish

It owns the EngineCore, the event journal, the Prometheus registry and the rate-limit buckets
(shared by every frontend, which are stateless). Frontends reach it over ZeroMQ (metrale.wire):

    PULL    submit   Submit / Abort / Heartbeat from any number of frontends
    PUB     output   StepOutput per step, topic = frontend id
    ROUTER  control  HealthCheck, ModelInfoQuery, StatsQuery (Prometheus text), RateLimitCheck,
                     LoadModel (a hot swap, metrale.swap), LibraryQuery
                     StoreRequest (stored responses and conversations: metrale.store)
    PUB     events   every journal event, topic = event type

Each socket's messages are dispatched by type through a table (`_on_submitted`, `_on_control`).
A frontend that stops sending heartbeats (killed, crashed) is gone after wire.PEER_TIMEOUT_S and
its requests are aborted within one step, so no slot is held for a client nobody is listening
to. No message can end the loop: one
that fails (a bug, an unserialisable reply) is answered with an error, logged, and the loop
serves on.

With a journal, the engine holds its folder (metrale.events.Journal locks it) and writes its
socket addresses there (`engine.json`, for `met events`) once its sockets are bound. Events go
out on the events socket once they are on disk (`_commit_events`), so a seq a subscriber saw is
never reused after a crash.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import zmq

from metrale import levers
from metrale import store as stored
from metrale import wire
from metrale.engine_core import EngineCore
from metrale.events import ADDRESSES_FILE, Journal
from metrale.metrics import EngineMetrics
from metrale.ratelimit import RateLimiter
from metrale.recovery import abort_unfinished
from metrale.request import Request
from metrale.scheduler import QueueFull
from metrale.swap import Swap, SwapRefused, library, spec_record

log = logging.getLogger("metrale.engine")
requests_log = logging.getLogger("metrale.requests")


@dataclass(frozen=True)
class EngineAddresses:
    submit: str
    output: str
    control: str
    events: str

    @classmethod
    def ipc(cls, directory: str | None = None) -> "EngineAddresses":
        d = Path(directory or tempfile.mkdtemp(prefix="metrale-"))
        return cls(*(f"ipc://{d}/{n}" for n in ("submit", "output", "control", "events")))

    @classmethod
    def tcp(cls, host: str, port: int) -> "EngineAddresses":
        return cls(*(f"tcp://{host}:{port + i}" for i in range(4)))

    def to_dict(self) -> dict:
        return {"submit": self.submit, "output": self.output, "control": self.control,
                "events": self.events}


@dataclass
class _Live:
    """Engine-side bookkeeping of a request in flight."""
    frontend_id: str
    arrival: float
    first_token_at: float | None = None


class EngineServer:
    def __init__(self, core: EngineCore, model_info: wire.ModelInfo, addresses: EngineAddresses,
                 journal: Journal | None):
        self.core: EngineCore | None = core     # None while a swap loads, or after it failed
        self.model_info = model_info
        self.spec = None                        # the EngineSpec served (set by build_server)
        self.swap = Swap(self)
        self.addresses = addresses
        self.journal = journal
        self._uncommitted: list[dict] = []      # journalled, not yet flushed and published
        self.metrics = EngineMetrics(model_info.name)
        self.ratelimit = RateLimiter.from_levers()
        self.live: dict[str, _Live] = {}
        self.frontends: dict[str, float] = {}
        self.running = True
        self._log_steps = log.isEnabledFor(logging.DEBUG)   # each step's size and time
        # the last step's outputs, published during the next step (see _step)
        self._unpublished: list[wire.TokenDelta] | None = None
        self._on_submitted = {wire.Submit: self._submit, wire.Abort: self._on_abort,
                              wire.Heartbeat: self._heartbeat}
        self._on_control = {wire.HealthCheck: self._health, wire.ModelInfoQuery: self._model_info,
                            wire.StatsQuery: self._stats, wire.RateLimitCheck: self._rate_limit,
                            wire.LoadModel: self._load_model, wire.LibraryQuery: self._library,
                            wire.StoreRequest: self._store_request}
        # stored responses and conversations: a view of the journal (metrale.store)
        self.store, loaded = stored.load(journal.dir if journal else None,
                                         core.config.store_max_items, core.config.store_ttl)
        self._snapshot_seq = loaded["snapshot_seq"]     # recovery reads the journal after it
        self._snapshot: stored.SnapshotWriter | None = None
        self._snapshot_every = levers.get("METRALE_STORE_SNAPSHOT_EVERY")
        self._last_sweep = 0.0
        self._bind()

    # -- sockets ----------------------------------------------------------------------------
    def _bind(self) -> None:
        ctx = zmq.Context.instance()
        self.pull = ctx.socket(zmq.PULL)
        self.out = ctx.socket(zmq.PUB)
        self.control = ctx.socket(zmq.ROUTER)
        self.events = ctx.socket(zmq.PUB)
        for sock, addr in ((self.pull, self.addresses.submit), (self.out, self.addresses.output),
                           (self.control, self.addresses.control),
                           (self.events, self.addresses.events)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        if self.journal:
            self._advertise()

    def _advertise(self) -> None:
        """engine.json in the journal folder: this engine's addresses, for `met events`."""
        path = self.journal.dir / ADDRESSES_FILE
        tmp = path.with_name(f".{ADDRESSES_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({**self.addresses.to_dict(), "pid": os.getpid()}))
        tmp.replace(path)

    def close(self) -> None:
        if self._snapshot is not None:
            self._snapshot.abandon()
        if self.core is not None:
            self.core.close()
        for s in (self.pull, self.out, self.control, self.events):
            s.close(0)
        if self.journal:
            (self.journal.dir / ADDRESSES_FILE).unlink(missing_ok=True)   # ours: we hold the lock
            self.journal.close()

    # -- events -----------------------------------------------------------------------------
    def emit(self, event_type: str, **fields) -> dict:
        """Journal the event (buffered); it is published by the next `_commit_events`."""
        if self.journal:
            event = self.journal.append(event_type, flush=False, **fields)
        else:
            event = {"seq": 0, "type": event_type, "ts": time.time(), **fields}
        self._uncommitted.append(event)
        return event

    def _commit_events(self) -> None:
        """Flush the journal, then publish what is now on disk."""
        if self.journal:
            self.journal.flush()
        events, self._uncommitted = self._uncommitted, []
        for event in events:
            self.events.send_multipart([event["type"].encode(), orjson.dumps(event)])

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        if self.journal:
            abort_unfinished(self.journal, self.emit,    # what a killed predecessor left open
                             self._snapshot_seq + 1, self.store.open_requests)
            if self.store.fail_running(self._store_commit, why="the engine restarted while "
                                       "this background response was being made; retry it"):
                self.journal.sync()
        self.emit("ModelLoaded", model=self.model_info.name, model_type=self.model_info.model_type,
                  recipe=self.model_info.recipe, load_id=self.model_info.load_id,
                  spec=spec_record(self.spec) if self.spec is not None else None)
        while self.running:
            busy = self._busy()
            ready = dict(self.poller.poll(0 if busy else 50))
            if self.pull in ready:
                self._drain_submits()
            if self.control in ready:
                self._drain_control()
            self._reap_frontends()
            if self._busy():
                self._step()
            if not self._busy():
                self._flush()            # no next step to overlap with
            self._store_upkeep()
            self._commit_events()
            self.swap.tick()             # a swap that has drained loads here (metrale.swap)
        self._flush()
        if self.core is not None:
            self.emit("ModelReleased", model=self.model_info.name)
        self._commit_events()

    def _busy(self) -> bool:
        return self.core is not None and self.core.has_unfinished()

    def _step(self) -> None:
        """One engine step. Its outputs are published during the next step, once that step's
        GPU work is queued (EngineCore.step's on_launch), or right after it when nothing more
        runs: serialising and sending them then overlaps the device instead of lengthening
        every step (measured on the H200 with SmolLM2 at C=8: the loop around core.step took
        0.15 ms of a 1.2 ms token interval). A client hears of a token one step launch later.

        A step that raises is a bug, but it must not take every other client down with the
        process: the requests in flight fail with a 500 and the engine goes on serving."""
        try:
            outputs = self.core.step(on_launch=self._flush)
            if self._log_steps:
                st = self.core.last_step
                if st is not None:
                    log.debug("step: %d seqs, %d tokens, %.3f ms", st.num_seqs, st.num_tokens,
                              1e3 * st.seconds)
        except Exception:
            log.exception("engine step failed; failing the %d requests in flight", len(self.live))
            self._fail_in_flight("the engine failed while running this request's batch "
                                 "(an internal error, logged by the engine); retry")
            return
        self._flush()                    # when the step had no launch to overlap
        self._unpublished = outputs

    def _flush(self) -> None:
        """Publish the last step's outputs, if not yet done."""
        outputs = self._unpublished
        if outputs is not None:
            self._unpublished = None
            self._publish(outputs)

    def _fail_in_flight(self, message: str) -> None:
        self._flush()                    # what the last good step made goes out first
        for rid, live in list(self.live.items()):
            try:
                self.core.abort_request(rid)
            except Exception:
                log.exception("could not release request %s", rid)
            del self.live[rid]
            self.metrics.finished()
            self.emit("RequestAborted", request_id=rid, reason="error", cause="engine_error")
            self._send(live.frontend_id, [wire.TokenDelta(rid, (), "error", error=message,
                                                          error_status=500)])

    def _drain_submits(self) -> None:
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames)
            except ValueError as e:
                log.warning("dropped a malformed message: %s", e)
                continue
            handler = self._on_submitted.get(type(msg))
            if handler is None:
                log.warning("dropped a %s on the submit socket", type(msg).__name__)
                continue
            try:
                handler(msg)
            except Exception:
                log.exception("a %s message failed; the engine serves on", type(msg).__name__)
                self._fail_submitted(msg)

    def _heartbeat(self, msg: wire.Heartbeat) -> None:
        self.frontends[msg.frontend_id] = time.monotonic()
        # echo on the frontend's topic: its SUB socket is proven connected once one arrives
        # (ZeroMQ drops what a PUB sends before a subscription reaches it)
        self._send(msg.frontend_id, [])

    def _on_abort(self, msg: wire.Abort) -> None:
        self._abort(msg.request_id, msg.reason)

    def _fail_submitted(self, msg) -> None:
        """A Submit whose handling raised is refused with a 500 (and released if it got in)."""
        if not isinstance(msg, wire.Submit):
            return
        try:
            if self.live.pop(msg.request_id, None) is not None:
                self.core.abort_request(msg.request_id)
            self._refuse(msg, 500, "the engine failed to take this request in (an internal "
                                   "error, logged by the engine); retry")
        except Exception:
            log.exception("could not refuse request %s", msg.request_id)

    def _submit(self, msg: wire.Submit) -> None:
        self.frontends[msg.frontend_id] = time.monotonic()
        if not self.swap.accepting():
            return self._refuse(msg, 503, self.swap.why_not())
        if msg.load_id and msg.load_id != self.model_info.load_id:
            # tokenized for a model since swapped out: that frontend fetches model_info again
            self._notify(msg.frontend_id, wire.ModelChanged(
                "serving", self.model_info.name, self.model_info.load_id))
            return self._refuse(msg, 503, f"the served model changed to {self.model_info.name}"
                                          " since this request was tokenized; retry")
        try:
            # the parameters (400), the queue limit (429), the context length and the deadline:
            # EngineCore.add_request and Scheduler.add_request
            self.core.add_request(Request(msg.request_id, msg.prompt_token_ids,
                                          msg.sampling_params))
        except QueueFull as e:
            return self._refuse(msg, 429, str(e))
        except ValueError as e:
            return self._refuse(msg, 400, str(e))
        self.live[msg.request_id] = _Live(msg.frontend_id, time.monotonic())
        self.metrics.admitted(len(msg.prompt_token_ids))
        self.emit("RequestAdmitted", request_id=msg.request_id, frontend_id=msg.frontend_id,
                  num_prompt_tokens=len(msg.prompt_token_ids))

    def _refuse(self, msg: wire.Submit, status: int, text: str) -> None:
        self.emit("RequestRejected", request_id=msg.request_id, status=status, message=text)
        delta = wire.TokenDelta(msg.request_id, (), "error", error=text, error_status=status)
        self._send(msg.frontend_id, [delta])

    def _abort(self, request_id: str, reason: str) -> None:
        if self.core is None:
            return
        self._flush()                    # its tokens so far go out before its end
        out = self.core.abort_request(request_id)
        if out is not None:
            self._publish([out], reason=reason)

    def _reap_frontends(self) -> None:
        now = time.monotonic()
        dead = {f for f, seen in self.frontends.items() if now - seen > wire.PEER_TIMEOUT_S}
        if not dead:
            return
        for f in dead:
            del self.frontends[f]
        gone = [rid for rid, live in self.live.items() if live.frontend_id in dead]
        for rid in gone:
            self._abort(rid, "frontend_gone")
        if gone and self.store.fail_running(self._store_commit, gone, "the frontend making "
                                            "this background response went away; retry it"):
            if self.journal:
                self.journal.sync()

    # -- publishing -------------------------------------------------------------------------
    def _publish(self, outputs: list[wire.TokenDelta], reason: str | None = None) -> None:
        """A step's outputs (EngineCore's TokenDeltas, sent as they are) to their frontends; in
        the journal the step's TokensEmitted comes before the RequestFinished of any request it
        ended."""
        by_frontend: dict[str, list[wire.TokenDelta]] = {}
        now = time.monotonic()
        counts = {}
        ended = []
        for out in outputs:
            live = self.live.get(out.request_id)
            if live is None:
                continue
            if out.token_ids:
                counts[out.request_id] = len(out.token_ids)
                if live.first_token_at is None:
                    live.first_token_at = now
                    self.metrics.first_token(now - live.arrival)
            by_frontend.setdefault(live.frontend_id, []).append(out)
            if out.finished:
                ended.append((out, live))
        if counts:
            self.metrics.generated(sum(counts.values()))    # one counter update per step
            self.emit("TokensEmitted", counts=counts)
        for out, live in ended:
            self._finished(out, live, now, reason)
        for frontend_id, deltas in by_frontend.items():
            self._send(frontend_id, deltas)

    def _send(self, frontend_id: str, deltas: list[wire.TokenDelta]) -> None:
        self._commit_events()   # what a frontend hears of is on disk first (one flush per step)
        frames = wire.encode(wire.StepOutput(frontend_id, tuple(deltas)))
        self.out.send_multipart([frontend_id.encode(), *frames])

    def _finished(self, out: wire.TokenDelta, live: _Live, now: float, reason: str | None) -> None:
        del self.live[out.request_id]
        ttft = None if live.first_token_at is None else live.first_token_at - live.arrival
        elapsed = now - live.arrival
        self.metrics.finished(out.finish_reason)
        record = dict(request_id=out.request_id, reason=out.finish_reason,
                      num_prompt_tokens=out.num_prompt_tokens,
                      num_output_tokens=out.num_output_tokens,
                      num_cached_tokens=out.num_cached_tokens, ttft=ttft, elapsed=elapsed)
        if out.finish_reason == "abort":
            self.emit("RequestAborted", **record, cause=reason or "abort")
        else:
            self.emit("RequestFinished", **record)
        line = {
            "model": self.model_info.name, "request_id": out.request_id,
            # when the engine took the request in, as a Unix time (µs): with the client's own
            # send time it separates the frontend's share of a TTFT from the engine's
            "arrival": round(time.time() - (now - live.arrival), 6),
            "prompt_tokens": out.num_prompt_tokens, "generated_tokens": out.num_output_tokens,
            "cached_tokens": out.num_cached_tokens,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
            "elapsed_ms": round(elapsed * 1000, 2), "finish_reason": out.finish_reason,
        }
        if out.num_verifies:    # speculative decoding: what its verifies kept
            line.update(spec_verifies=out.num_verifies, spec_draft_tokens=out.num_draft_tokens,
                        spec_accepted_tokens=out.num_accepted_tokens,
                        spec_mean_accepted_length=round(
                            (out.num_accepted_tokens + out.num_verifies) / out.num_verifies, 3))
        requests_log.info(orjson.dumps(line).decode())

    # -- control ----------------------------------------------------------------------------
    def _drain_control(self) -> None:
        while True:
            try:
                ident, *frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.control.send_multipart([ident, *self._control_reply(frames)])

    def _control_reply(self, frames: list[bytes]) -> list[bytes]:
        """The encoded reply to one control request: an error reply when it is malformed or
        answering it fails in any way (logged with the traceback)."""
        try:
            msg = wire.decode(frames)
            handler = self._on_control.get(type(msg))
            if handler is None:
                raise ValueError(f"not a control request: {type(msg).__name__}")
            return wire.encode(handler(msg))
        except (ValueError, KeyError) as e:
            return wire.encode(wire.ControlReply(False, {"error": str(e)}))
        except Exception as e:
            log.exception("control request failed; the engine serves on")
            return wire.encode(wire.ControlReply(False, {
                "error": f"the engine failed to answer ({type(e).__name__}; logged by the engine)"}))

    def _health(self, msg: wire.HealthCheck) -> wire.ControlReply:
        """status "ok", or the swap's state ("draining", "loading", "empty") with why."""
        if self.swap.accepting():
            return wire.ControlReply(True, {"status": "ok", "model": self.model_info.name,
                                            "load_id": self.model_info.load_id})
        return wire.ControlReply(True, {"status": self.swap.state, "detail": self.swap.why_not()})

    def _model_info(self, msg: wire.ModelInfoQuery) -> wire.ControlReply:
        if self.core is None:
            return wire.ControlReply(False, {"error": self.swap.why_not(), "status": 503,
                                             "code": "model_not_loaded"})
        return wire.ControlReply(True, self.model_info.to_dict())

    def _load_model(self, msg: wire.LoadModel) -> wire.ControlReply:
        try:
            return wire.ControlReply(True, self.swap.request(msg))
        except SwapRefused as e:
            return wire.ControlReply(False, {"error": str(e), "status": e.status,
                                             "code": e.code})

    def _library(self, msg: wire.LibraryQuery) -> wire.ControlReply:
        return wire.ControlReply(True, library(self))

    def _stats(self, msg: wire.StatsQuery) -> wire.ControlReply:
        if self.core is not None:
            self.metrics.set_gauges(self.core)
        self.metrics.set_store(self.store.counts())
        return wire.ControlReply(True, {"prometheus": self.metrics.render(),
                                        "running": len(self.live),
                                        "rate_limit_keys": self.ratelimit.num_keys})

    def _rate_limit(self, msg: wire.RateLimitCheck) -> wire.ControlReply:
        return wire.ControlReply(True, self.ratelimit.check(msg.key, int(msg.tokens)))

    # -- the store (metrale.store) ----------------------------------------------------------
    def _store_commit(self, event_type: str, fields: dict) -> dict:
        event = self.emit(event_type, **fields)
        self.store.apply(event)
        return event

    def _store_request(self, msg: wire.StoreRequest) -> wire.ControlReply:
        """Answered only once what it changed is fsynced: an acknowledged write survives a
        kill -9 (and a power loss). A cancel also aborts the response's engine requests."""
        before = self.journal.next_seq if self.journal else 0
        try:
            data, ok = self.store.execute(msg.op, msg.owner, msg.args, self._store_commit), True
        except stored.StoreError as e:
            data, ok = e.to_dict(), False
        if self.journal and self.journal.next_seq != before:
            self.journal.sync()
        self._commit_events()
        for request_id in data.pop("abort", ()) if ok else ():
            self._abort(request_id, "cancelled")
        return wire.ControlReply(ok, data)

    def _store_upkeep(self) -> None:
        """Retention (every TTL_SWEEP_S) and the snapshot, a chunk per loop iteration."""
        now = time.monotonic()
        if now - self._last_sweep >= stored.TTL_SWEEP_S:
            self._last_sweep = now
            if self.store.expire(self._store_commit) and self.journal:
                self.journal.sync()
        if self.journal is None:
            return
        if self._snapshot is None and self.store.events_since_snapshot >= self._snapshot_every:
            self.journal.flush()
            self._snapshot = stored.SnapshotWriter(self.store, self.journal.dir,
                                                   self.journal.next_seq - 1, list(self.live))
        if self._snapshot is not None and self._snapshot.step():
            self._snapshot = None


    # -- what metrale.swap drives ---------------------------------------------------------------
    def notify_frontends(self, msg: wire.ModelChanged) -> None:
        for frontend_id in list(self.frontends):
            self._notify(frontend_id, msg)

    def _notify(self, frontend_id: str, msg: wire.ModelChanged) -> None:
        self.out.send_multipart([frontend_id.encode(), *wire.encode(msg)])

    def abort_request(self, request_id: str, reason: str) -> None:
        self._abort(request_id, reason)

    def commit_events(self) -> None:
        self._commit_events()

    def drain_submits(self) -> None:
        self._drain_submits()

    def drain_control(self) -> None:
        self._drain_control()


def default_journal_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "metrale", "events")
