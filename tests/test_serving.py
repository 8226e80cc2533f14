"""`met serve` as a whole, on a tiny random model: concurrency, disconnects, worker crashes,
engine refusals, engine death and restart, the journal and `met events`, remote frontends."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import requests

from metrale.events import FinishedRequests
from tests.serving import REPO, Server, children_of, cmdline, free_port, make_tiny_chat_model, metric


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """2 frontend workers, room for 64 concurrent sequences."""
    logs = tmp_path_factory.mktemp("serve")
    with Server(["serve", str(tiny_model), "--frontends", "2", "--max-batch-size", "64",
                 "--max-num-seqs", "96", "--max-seq-len", "4096",
                 "--event-log", str(logs / "events")], logs / "serve.log").serving(workers=2) as srv:
        yield srv


def _client(srv, cls=openai.OpenAI):
    return cls(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _wait_active_zero(srv, timeout=20.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active = metric(srv.url, "metrale_requests_active")
        if active == 0:
            return active
        time.sleep(0.2)
    return active


def test_64_concurrent_streams_have_right_usage_and_no_cross_talk(server):
    client = _client(server, openai.AsyncOpenAI)

    async def one(i: int):
        max_tokens = 3 + i % 11
        prompt = f"request {i}:"
        stream = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0.7,
            seed=i, logprobs=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        ids, texts, tokens, finish, usage = set(), [], 0, None, None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts.append(c.text)
                tokens += len(c.logprobs.tokens) if c.logprobs else 0
                finish = c.finish_reason or finish
        return i, max_tokens, len(prompt.encode()), ids, "".join(texts), tokens, finish, usage

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, max_tokens, prompt_len, ids, text, tokens, finish, usage in results:
        assert len(ids) == 1, f"stream {i} mixed responses {ids}"
        assert finish == "length"
        assert tokens == max_tokens, f"stream {i} got {tokens} tokens, asked {max_tokens}"
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == prompt_len        # byte-level: one token per byte
        assert usage.total_tokens == prompt_len + max_tokens
    assert _wait_active_zero(server) == 0


def test_disconnected_streams_free_their_slots(server):
    before = server.tail(10**7).count('"finish_reason":"abort"')

    readers = []
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        for i in range(16):
            r = streams.enter_context(http.stream("POST", server.url + "/v1/completions", json={
                "prompt": f"long {i}", "max_tokens": 4000, "stream": True, "ignore_eos": True}))
            assert r.status_code == 200
            readers.append(r.iter_lines())     # kept: dropping the iterator closes the stream
            assert next(readers[-1]).startswith("data: {")
        assert metric(server.url, "metrale_requests_active") == 16
    # leaving the blocks closed the 16 connections mid-stream
    assert _wait_active_zero(server) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = server.tail(10**7).count('"finish_reason":"abort"') - before
        if aborted >= 16:
            break
        time.sleep(0.2)
    assert aborted >= 16, "the engine did not abort the dropped streams"


def test_stop_string_aborts_the_request_and_is_excluded(server):
    client = _client(server)
    full = client.completions.create(model="tiny-llama", prompt="stop test", max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[10:13]
    assert len(stop) == 3
    cut = client.completions.create(model="tiny-llama", prompt="stop test", max_tokens=40,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens < 40
    streamed = client.completions.create(model="tiny-llama", prompt="stop test", max_tokens=40,
                                         temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_kill_9_of_a_worker_is_replaced_and_other_streams_finish(server):
    arbiter = next(p for p in server.children() if "frontends.server" in cmdline(p))
    workers = set(children_of(arbiter))
    assert len(workers) == 2

    def stream(i):
        try:
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", server.url + "/v1/completions", json={
                        "prompt": f"kill {i}", "max_tokens": 1000, "stream": True,
                        "ignore_eos": True, "temperature": 0}) as r:
                    worker = int(r.headers["x-metrale-worker"])
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                    return worker, lines[-1] == "data: [DONE]"
        except httpx.HTTPError:
            return None, False

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        time.sleep(1.0)
        victim = sorted(workers)[0]
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    survivors = [ok for worker, ok in results if worker is not None and worker != victim]
    assert survivors and all(survivors), results
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = set(children_of(arbiter))
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.3)
    assert len(now) == 2 and victim not in now, f"gunicorn did not replace {victim}: {now}"
    server.wait_workers_ready(2)
    # the killed worker's requests were aborted once its heartbeats stopped
    assert _wait_active_zero(server, timeout=30) == 0


# ---- one engine on tcp: refusals, events, remote frontends, death and restart ---------------

def _events(log_dir, *extra) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "metrale.cli", "events", "--event-log",
                          str(log_dir), "--no-follow", *extra], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_engine_on_tcp_refusals_events_restart_and_replay(tiny_model, tmp_path):
    events_dir = tmp_path / "events"
    engine_port = free_port(span=4)
    serve_args = ["serve", str(tiny_model), "--frontends", "1", "--max-batch-size", "1",
                  "--max-num-seqs", "1", "--max-seq-len", "4096", "--event-log", str(events_dir),
                  "--engine-bind", f"tcp://127.0.0.1:{engine_port}"]
    srv = Server(serve_args, tmp_path / "serve1.log")
    remote = Server(["frontend", "--engine", f"tcp://127.0.0.1:{engine_port}", "--frontends",
                     "1"], tmp_path / "frontend.log")
    tail = None
    try:
        srv.wait_healthy()
        remote.wait_healthy()
        tail = subprocess.Popen([sys.executable, "-m", "metrale.cli", "events", "--from-seq",
                                 "1", "--event-log", str(events_dir)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        client = _client(remote)
        out = client.completions.create(model="tiny-llama", prompt="remote", max_tokens=5,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        # the queue holds one sequence: a second one while it runs is refused with 429
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", srv.url + "/v1/completions", json={
                    "prompt": "hold", "max_tokens": 4000, "stream": True,
                    "ignore_eos": True}) as held:
                lines = held.iter_lines()    # kept: dropping it closes the stream
                assert next(lines).startswith("data: {")
                r = requests.post(remote.url + "/v1/completions", json={
                    "prompt": "refused", "max_tokens": 2}, timeout=60)
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"]
        assert r.json()["error"]["code"] == "queue_full"
        assert _wait_active_zero(srv) == 0
        first = _events(events_dir, "--from-seq", "1")
        before = FinishedRequests.from_journal(events_dir).records   # read-only, no lock
        seqs = [e["seq"] for e in first]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        types = {e["type"] for e in first}
        assert {"ModelLoaded", "RequestAdmitted", "TokensEmitted", "RequestFinished",
                "RequestAborted", "RequestRejected"} <= types
        # the live tail printed the same events, once each, in order
        lines = []
        while len(lines) < len(first):
            lines.append(json.loads(tail.stdout.readline()))
        assert [e["seq"] for e in lines] == seqs

        # the engine dies: the remote frontend answers 503 at once (it noticed the dead engine
        # once, not one 5 s health check after another), `met serve` restarts the engine and
        # the remote frontend reconnects on its own
        engine = next(p for p in srv.children() if "metrale.engine_process" in cmdline(p))
        os.kill(engine, signal.SIGKILL)
        t0 = time.monotonic()
        r = requests.post(remote.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
        assert r.headers["Retry-After"]
        assert time.monotonic() - t0 < 2
        remote.wait_healthy(60)
        assert srv.proc.poll() is None
        back = client.completions.create(model="tiny-llama", prompt="back", max_tokens=2,
                                         extra_body={"ignore_eos": True})
        assert back.usage.completion_tokens == 2

        # restart on the same journal: old events replay with the same seqs, new ones follow
        assert srv.stop() == 0
        srv = Server(serve_args, tmp_path / "serve2.log", port=srv.port)
        srv.wait_healthy()
        remote.wait_healthy(60)     # the remote frontend reconnected on its own
        out = client.completions.create(model="tiny-llama", prompt="again", max_tokens=3,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        after = _events(events_dir, "--from-seq", "1")
        assert after[:len(first)] == first
        assert after[len(first)]["seq"] == first[-1]["seq"] + 1
        assert after[len(first)]["type"] == "ModelLoaded"
        replayed = FinishedRequests()
        for e in after[:len(first)]:
            replayed.apply(e)
        assert replayed.records == before and len(before) >= 2
        assert srv.stop() == 0
    finally:
        if tail is not None:
            tail.kill()
            tail.wait()
        srv.stop()
        remote.stop()
