"""`met serve` under faults, with real processes on a tiny random model: the engine killed under
load (every client told within 1 s, the engine restarted, the journal complete), a huge prompt
beside live streams, request timeouts reported as such, HTTP/2.0 request lines, n beyond
--max-num-seqs, stale ipc folders, and a working directory that holds a `metrale/` folder."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import requests

from tests.serving import REPO, Server, cmdline, free_port, make_tiny_chat_model, metric

MET = str(Path(sys.executable).with_name("met"))
TIMEOUT_S = 4          # --request-timeout of the server under test
MAX_NUM_SEQS = 24


class MetServer(Server):
    """`met serve ...` (the console script, as an operator runs it) from `cwd`."""

    def __init__(self, args, log_path, cwd: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.args = list(args) + ["--port", str(self.port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([MET, *self.args], cwd=cwd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)


def _dead_pid_and_start() -> tuple[int, str]:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    start = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    p.wait()
    return p.pid, start


@pytest.fixture(scope="module")
def planted_ipc_dirs():
    """ipc folders as a kill -9 of `met serve` leaves them, one of a live owner, one of no one."""
    dead = Path(tempfile.mkdtemp(prefix="metrale-"))
    pid, start = _dead_pid_and_start()
    (dead / "owner.pid").write_text(f"{pid} {start}\n")
    (dead / "submit").write_text("")
    live = Path(tempfile.mkdtemp(prefix="metrale-"))
    me = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    (live / "owner.pid").write_text(f"{os.getpid()} {me}\n")
    unowned = Path(tempfile.mkdtemp(prefix="metrale-"))
    yield {"dead": dead, "live": live, "unowned": unowned}
    for d in (dead, live, unowned):
        subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, planted_ipc_dirs):
    """One frontend worker (so every request shares its event loop), started by `met serve`
    from a folder that holds a `metrale/` package of its own."""
    tmp = tmp_path_factory.mktemp("faults")
    model = make_tiny_chat_model(tmp / "tiny-llama")
    cwd = tmp / "work"
    (cwd / "metrale").mkdir(parents=True)
    (cwd / "metrale" / "__init__.py").write_text("raise ImportError('the wrong metrale')\n")
    (cwd / "frontends").mkdir()
    (cwd / "frontends" / "__init__.py").write_text("raise ImportError('the wrong frontends')\n")
    srv = MetServer(["serve", str(model), "--frontends", "1", "--max-batch-size", "8",
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--max-seq-len", "4096",
                     "--request-timeout", str(TIMEOUT_S), "--event-log", str(tmp / "events")],
                    tmp / "serve.log", cwd)
    srv.events_dir = tmp / "events"
    with srv.serving(workers=1) as s:
        yield s


def _stream(url: str, body: dict, timeout: float = 120) -> dict:
    """POST a streamed completion; what came back, with the time its last byte came."""
    out = {"status": None, "events": [], "done": False, "json": None}
    with httpx.Client(timeout=timeout) as http:
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                out["json"], out["headers"] = r.json(), dict(r.headers)
            else:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        out["events"].append(json.loads(line[6:]))
    out["ended"] = time.monotonic()
    return out


# ---- boot ----------------------------------------------------------------------------------

def test_serves_from_a_folder_holding_a_metrale_package(server):
    """The decoy metrale/ and frontends/ in the working directory raise on import: the engine
    and the frontends still booted (their children do not import from the working directory)."""
    r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert "the wrong" not in server.tail(20000)


def test_stale_ipc_folder_of_a_dead_owner_is_removed(server, planted_ipc_dirs):
    assert not planted_ipc_dirs["dead"].exists()
    assert planted_ipc_dirs["live"].exists() and planted_ipc_dirs["unowned"].exists()
    mine = [p for p in Path(tempfile.gettempdir()).glob("metrale-*")
            if (p / "owner.pid").is_file() and
            (p / "owner.pid").read_text().split()[0] == str(server.proc.pid)]
    assert len(mine) == 1, "met serve's own ipc folder carries its owner.pid"


def test_serving_line_comes_once_it_answers(server):
    deadline = time.monotonic() + 10       # the supervisor says it after its own /health probe
    while True:
        lines = [ln for ln in server.tail(200000).splitlines() if "metrale.serve: serving" in ln]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(lines) == 1 and "http://127.0.0.1:" in lines[0], lines


def test_access_log_line_for_every_request_4xx_included(server):
    r = requests.get(server.url + "/v1/nope", headers={"x-request-id": "probe-404-abc"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "probe-404-abc"
    time.sleep(0.5)
    lines = [ln for ln in server.tail(200000).splitlines() if "probe-404-abc" in ln]
    assert len(lines) == 1 and "GET /v1/nope 404" in lines[0] and "ms" in lines[0], lines


# ---- bad input -----------------------------------------------------------------------------

def test_http_2_request_line_gets_json_400(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_above_max_num_seqs_is_a_400_not_a_429(server, route):
    body = {"max_tokens": 2, "n": MAX_NUM_SEQS + 1}
    body.update({"prompt": "x"} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "x"}]})
    r = requests.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n" and "--max-num-seqs" in r.json()["error"]["message"]


def test_huge_prompt_beside_live_streams(server):
    """An ~8 MB prompt on the worker that holds 4 live streams: refused with a 400 at once,
    and the streams finish normally (its tokenizing never stalls the worker's heartbeats)."""
    huge = "word " * (8 * 2**20 // 5 - 10)
    with ThreadPoolExecutor(5) as pool:
        streams = [pool.submit(_stream, server.url, {
            "prompt": f"neighbour {i}", "max_tokens": 300, "ignore_eos": True,
            "temperature": 0}) for i in range(4)]
        time.sleep(0.5)
        t0 = time.monotonic()
        r = requests.post(server.url + "/v1/completions", timeout=120,
                          json={"prompt": huge, "max_tokens": 1})
        refused_in = time.monotonic() - t0
        chat = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": huge}], "max_tokens": 1})
        results = [f.result() for f in streams]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert refused_in < 5, refused_in
    for res in results:
        assert res["status"] == 200 and res["done"], res
        assert res["events"][-1]["choices"][0]["finish_reason"] == "length", res["events"][-1]


def test_request_timeout_is_reported_as_timeout_and_counted(server):
    before = metric(server.url, "metrale_request_timeouts_total")
    res = _stream(server.url, {"prompt": "slow", "max_tokens": 4000, "ignore_eos": True})
    assert res["status"] == 200 and res["done"]
    assert res["events"][-1]["choices"][0]["finish_reason"] == "timeout"
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "slow"}], "max_tokens": 4000,
        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "timeout"
    assert metric(server.url, "metrale_request_timeouts_total") == before + 2


def test_request_timeout_on_the_messages_api_is_a_timeout_error(server):
    """Anthropic's convention: a timeout_error (504, or the stream's `error` event after the
    blocks so far), never stop_reason max_tokens."""
    name = requests.get(server.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": name, "max_tokens": 4000, "temperature": 0,   # greedy: loops, no end of turn
            "messages": [{"role": "user", "content": "slow"}]}
    r = requests.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout_error"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            datas = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    assert datas[0]["type"] == "message_start"
    assert datas[-1] == {"type": "error", "error": {"type": "timeout_error",
                                                   "message": datas[-1]["error"]["message"]}}
    assert not any(d["type"] == "message_delta" for d in datas)


# ---- the engine killed under load (last: it restarts the engine) ----------------------------

def _events(log_dir) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "metrale.cli", "events", "--event-log",
                          str(log_dir), "--no-follow", "--from-seq", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_engine_kill_under_16_streams(server):
    """Every open stream gets an error event, every waiting request a 503 in the API's shape,
    within 1 s; `met serve` restarts the engine, which serves again; the journal shows every
    request in flight at the crash as aborted (cause engine_restart)."""
    engine = next(p for p in server.children() if "metrale.engine_process" in cmdline(p))
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_stream, server.url, {
            "prompt": f"victim {i}", "max_tokens": 3000, "ignore_eos": True})
            for i in range(16)]
        time.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        results = [f.result() for f in futures]
        during = requests.post(server.url + "/v1/completions", timeout=30,
                               json={"prompt": "x", "max_tokens": 2})
    streamed = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    assert streamed, "some streams were running when the engine died"
    for r in streamed:
        assert r["events"] and "error" in r["events"][-1], r["events"][-1:]
        assert r["events"][-1]["error"]["code"] == "model_not_loaded"
        assert r["ended"] - killed_at < 1.0, r["ended"] - killed_at
    for r in refused:
        assert r["status"] == 503 and r["json"]["error"]["code"] == "model_not_loaded", r
        assert r["headers"]["retry-after"]
        assert r["ended"] - killed_at < 1.0, r["ended"] - killed_at
    assert during.status_code == 503, during.text
    assert during.json()["error"]["code"] == "model_not_loaded"
    assert during.headers["Retry-After"]

    server.wait_healthy(120)
    assert server.proc.poll() is None, "met serve kept running"
    r = requests.post(server.url + "/v1/completions", json={"prompt": "again", "max_tokens": 3,
                                                            "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "restarting it in" in server.tail(200000)

    events = _events(server.events_dir)
    terminal = {e["request_id"]: e for e in events
                if e["type"] in ("RequestFinished", "RequestAborted")}
    admitted = [e["request_id"] for e in events if e["type"] == "RequestAdmitted"]
    assert admitted and all(rid in terminal for rid in admitted), "no record lost"
    restart_aborts = [e for e in events if e.get("cause") == "engine_restart"]
    assert len(restart_aborts) >= len(streamed)
