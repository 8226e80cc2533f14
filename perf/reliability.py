"""Reliability of `met serve` under faults, on the CPU with a tiny random model (a few minutes on
2 cores). Writes perf/results/reliability_<date>_<commit>.json.

    python perf/reliability.py [--out perf/results] [--storm-streams 200] [--slowloris 100]

Phases, each with innocent streams running beside the fault (they must all finish normally):
  bad_input   a corpus of malformed / hostile requests: every answer a 4xx in JSON, never a 5xx
  slowloris   N connections dribbling their request heads: cut by the head deadline (408)
  storms      3 rounds of S streams each dropped by its client after its first event; RSS of the
              server's processes after each round, and the engine back to 0 active requests
  engine_kill kill -9 of the engine under 16 streams: each client told (an error event or a 503
              in the API's shape) within 1 s; the engine restarted and serving again; every
              admitted request has a terminal event in the journal (RequestAborted with cause
              engine_restart for those in flight)

Targets: 0 unexpected 5xx (the 503s of the engine_kill phase are the expected answer), 0 innocent
requests failed, 0 journal records lost, every client told within 1 s.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.serving import Server, cmdline, make_tiny_chat_model  # noqa: E402

MODEL = "tiny-llama"
HEAD_TIMEOUT_S = 3       # METRALE_BODY_TIMEOUT_S of the server under test


# ---- helpers --------------------------------------------------------------------------------

async def stream(http: httpx.AsyncClient, url: str, body: dict, drop_after: int | None = None):
    """A streamed completion: {status, events, done, error, ended}; `drop_after` events and the
    client hangs up."""
    out = {"status": None, "events": 0, "done": False, "error": None, "finish": None}
    try:
        async with http.stream("POST", url + "/v1/completions",
                               json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:300]
            else:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        out["events"] += 1
                        if "error" in event:
                            out["error"] = event["error"]
                        elif event["choices"] and event["choices"][0].get("finish_reason"):
                            out["finish"] = event["choices"][0]["finish_reason"]
                        if drop_after is not None and out["events"] >= drop_after:
                            break
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["ended"] = time.monotonic()
    return out


def innocent_ok(res: dict) -> bool:
    return res["status"] == 200 and res["done"] and res["error"] is None and \
        res["finish"] == "length"


async def with_innocents(url: str, fault, n: int = 4, max_tokens: int = 200) -> tuple:
    """Run `fault()` while n innocent streams run; (fault result, innocent failures)."""
    async with httpx.AsyncClient(timeout=300) as http:
        innocents = [asyncio.create_task(stream(http, url, {
            "model": MODEL, "prompt": f"innocent {i}", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0})) for i in range(n)]
        await asyncio.sleep(0.3)
        result = await fault()
        done = await asyncio.gather(*innocents)
    return result, sum(not innocent_ok(r) for r in done)


def rss_kib(root_pid: int) -> dict:
    """VmRSS of `met serve` and every descendant, by command."""
    out = {}
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rss = next((int(ln.split()[1]) for ln in status.splitlines()
                    if ln.startswith("VmRSS:")), 0)
        name = cmdline(pid)
        kind = "engine" if "engine_process" in name else "frontend" if "frontends" in name \
            else "serve"
        out.setdefault(kind, 0)
        out[kind] += rss
    return out


def descendants(pid: int) -> list[int]:
    try:
        kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [d for k in kids for d in (k, *descendants(k))]


def active(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("metrale_requests_active "):
            return float(line.split()[1])
    return -1.0


def wait_idle(url: str, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if active(url) == 0:
            return time.monotonic()
        time.sleep(0.2)
    return -1.0


# ---- phases ---------------------------------------------------------------------------------

def bad_inputs(port: int) -> list[tuple[str, bytes]]:
    """(name, raw HTTP request) pairs."""
    def post(path, body: bytes, extra=b""):
        return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" +
                extra + b"Connection: close\r\n\r\n" + body)
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        ("invalid json", post("/v1/completions", b"{not json")),
        ("empty body", post("/v1/completions", b"")),
        ("array body", post("/v1/chat/completions", b"[1,2]")),
        ("nan", post("/v1/completions", b'{"prompt":"x","temperature":NaN}')),
        ("huge int", post("/v1/completions", b'{"prompt":"x","max_tokens":' + b"9" * 40 + b"}")),
        ("deep nesting", post("/v1/completions", deep)),
        ("lone surrogate", post("/v1/completions", b'{"prompt":"\\ud800"}')),
        ("bad utf8", post("/v1/completions", b'{"prompt":"\xff\xfe"}')),
        ("negative max_tokens", post("/v1/completions", b'{"prompt":"x","max_tokens":-1}')),
        ("n too large", post("/v1/completions", b'{"prompt":"x","n":100000}')),
        ("token out of range", post("/v1/completions", b'{"prompt":[999999]}')),
        ("wrong model", post("/v1/completions", b'{"model":"nope","prompt":"x"}')),
        ("wrong types", post("/v1/chat/completions", b'{"messages":"hi"}')),
        ("unknown role", post("/v1/chat/completions",
                              b'{"messages":[{"role":"wizard","content":"x"}]}')),
        ("anthropic no max_tokens", post("/v1/messages",
                                         b'{"messages":[{"role":"user","content":"x"}]}')),
        ("huge prompt", post("/v1/completions",
                             b'{"prompt":"' + b"word " * (8 * 2**20 // 5 - 20) + b'"}')),
        ("bad content-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Length: zz\r\n\r\n"),
        ("http/2.0 line", b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n"),
        ("garbage line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
        ("huge header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-a: " + b"a" * 100_000 +
                        b"\r\n\r\n"),
        ("unknown route", b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        ("wrong method", b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        ("body too large", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                           b"999999999999\r\n\r\n"),
    ]


def send_raw(port: int, raw: bytes) -> tuple[int, bool]:
    """(status, whether the body is JSON) of one raw request."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            s.sendall(raw)
        except OSError:
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        status = int(head.split()[1])
    except (IndexError, ValueError):
        return 0, False
    try:
        json.loads(body or b"null")
        is_json = body.strip().startswith(b"{")
    except ValueError:
        is_json = False
    return status, is_json


async def phase_bad_input(srv: Server) -> dict:
    corpus = bad_inputs(srv.port)

    async def fault():
        loop = asyncio.get_running_loop()
        return {name: await loop.run_in_executor(None, send_raw, srv.port, raw)
                for name, raw in corpus}

    answers, innocent_failed = await with_innocents(srv.url, fault)
    return {"requests": len(corpus), "innocent_failed": innocent_failed,
            "num_5xx": sum(s >= 500 for s, _ in answers.values()),
            "not_4xx_json": sorted(n for n, (s, j) in answers.items()
                                   if not (400 <= s < 500 and j)),
            "statuses": {n: s for n, (s, _) in answers.items()}}


async def phase_slowloris(srv: Server, n: int) -> dict:
    async def one() -> int:
        """One connection dribbling a head, a byte every 0.5 s; the status it was cut with."""
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(int(HEAD_TIMEOUT_S * 4) + 8):
                try:
                    data = await asyncio.wait_for(r.read(65536), 0.5)
                except asyncio.TimeoutError:
                    w.write(b"X")
                    continue
                return int(data.split()[1]) if data.startswith(b"HTTP/") else 0
            return -1                                   # never cut
        except (OSError, ValueError, IndexError):
            return 0
        finally:
            w.close()

    async def fault():
        t0 = time.monotonic()
        statuses = await asyncio.gather(*(one() for _ in range(n)))
        return list(statuses), time.monotonic() - t0

    (statuses, seconds), innocent_failed = await with_innocents(srv.url, fault,
                                                                max_tokens=400)
    return {"connections": n, "cut_with_408": statuses.count(408),
            "num_5xx": sum(s >= 500 for s in statuses), "innocent_failed": innocent_failed,
            "seconds": round(seconds, 1)}


async def phase_storms(srv: Server, rounds: int, streams: int) -> dict:
    out = []
    for k in range(rounds):
        async def fault():
            limits = httpx.Limits(max_connections=streams + 8)
            async with httpx.AsyncClient(timeout=300, limits=limits) as http:
                return await asyncio.gather(*(stream(http, srv.url, {
                    "model": MODEL, "prompt": f"storm {k} {i}", "max_tokens": 400,
                    "ignore_eos": True}, drop_after=1) for i in range(streams)))

        results, innocent_failed = await with_innocents(srv.url, fault)
        dropped_at = time.monotonic()
        idle_at = wait_idle(srv.url)
        out.append({"round": k + 1, "streams": streams, "innocent_failed": innocent_failed,
                    "num_5xx": sum((r["status"] or 0) >= 500 for r in results),
                    "seconds_to_idle": round(idle_at - dropped_at, 2) if idle_at > 0 else None,
                    "rss_kib": rss_kib(srv.proc.pid)})
    return {"rounds": out}


def journal_events(events_dir: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "metrale.cli", "events", "--event-log",
                          str(events_dir), "--no-follow", "--from-seq", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


async def phase_engine_kill(srv: Server, events_dir: Path) -> dict:
    engine = next(p for p in descendants(srv.proc.pid) if "metrale.engine_process" in cmdline(p))
    async with httpx.AsyncClient(timeout=300) as http:
        tasks = [asyncio.create_task(stream(http, srv.url, {
            "model": MODEL, "prompt": f"victim {i}", "max_tokens": 3000,
            "ignore_eos": True})) for i in range(16)]
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    told = [r["ended"] - killed_at for r in results]
    streamed_error = sum(r["status"] == 200 and r["error"] is not None for r in results)
    refused_503 = sum(r["status"] == 503 and "model_not_loaded" in (r["error"] or "")
                      for r in results)
    unexpected = [r for r in results if not (r["status"] == 200 and r["error"] is not None)
                  and not (r["status"] == 503 and "model_not_loaded" in (r["error"] or ""))]
    t0 = time.monotonic()
    srv.wait_healthy(180)
    back_after = time.monotonic() - t0
    again = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "again", "max_tokens": 3, "ignore_eos": True})
    events = journal_events(events_dir)
    terminal = {e["request_id"] for e in events
                if e["type"] in ("RequestFinished", "RequestAborted")}
    admitted = [e["request_id"] for e in events if e["type"] == "RequestAdmitted"]
    return {"streams": 16, "streamed_error_event": streamed_error, "refused_503": refused_503,
            "unexpected_answers": len(unexpected), "max_seconds_to_tell": round(max(told), 3),
            "all_told_within_1s": max(told) < 1.0,
            "engine_back_after_s": round(back_after, 2),
            "served_after_restart": again.status_code == 200,
            "journal_admitted": len(admitted),
            "journal_records_lost": sum(rid not in terminal for rid in admitted),
            "journal_engine_restart_aborts": sum(e.get("cause") == "engine_restart"
                                                 for e in events)}


# ---- main -----------------------------------------------------------------------------------

def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or "unknown"


async def run_all(srv: Server, events_dir: Path, args) -> dict:
    phases = {"bad_input": await phase_bad_input(srv),
              "slowloris": await phase_slowloris(srv, args.slowloris),
              "storms": await phase_storms(srv, 3, args.storm_streams)}
    phases["engine_kill"] = await phase_engine_kill(srv, events_dir)
    return phases


def summary(phases: dict) -> dict:
    storms = phases["storms"]["rounds"]
    kill = phases["engine_kill"]
    return {
        "unexpected_5xx": phases["bad_input"]["num_5xx"] + phases["slowloris"]["num_5xx"] +
        sum(r["num_5xx"] for r in storms) + kill["unexpected_answers"],
        "innocent_failed": phases["bad_input"]["innocent_failed"] +
        phases["slowloris"]["innocent_failed"] + sum(r["innocent_failed"] for r in storms),
        "journal_records_lost": kill["journal_records_lost"],
        "every_client_told_within_1s": kill["all_told_within_1s"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "perf" / "results"))
    p.add_argument("--storm-streams", type=int, default=200)
    p.add_argument("--slowloris", type=int, default=100)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="reliability-"))
    model = make_tiny_chat_model(tmp / MODEL)
    events_dir = tmp / "events"
    srv = Server(["serve", str(model), "--frontends", "2", "--max-batch-size", "64",
                  "--max-num-seqs", "512", "--max-seq-len", "4096",
                  "--event-log", str(events_dir)], tmp / "serve.log",
                 env={"METRALE_BODY_TIMEOUT_S": str(HEAD_TIMEOUT_S), "METRALE_LOG_LEVEL": "warning"})
    t0 = time.monotonic()
    try:
        srv.wait_healthy(180)
        srv.wait_workers_ready(2)
        phases = asyncio.run(run_all(srv, events_dir, args))
    finally:
        srv.stop()
    result = {"benchmark": "reliability", "commit": git_commit(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": "cpu", "model": "tiny random llama (tests.serving.make_tiny_chat_model)",
              "cores": os.cpu_count(), "seconds": round(time.monotonic() - t0, 1),
              "summary": None, "phases": phases}
    result["summary"] = summary(phases)
    out = Path(args.out) / (f"reliability_{datetime.date.today():%Y%m%d}_"
                            f"{result['commit']}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
