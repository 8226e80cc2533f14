"""`met serve`: one engine process and one gunicorn arbiter of N frontend workers, supervised.

    met serve ──spawn──▶ python -m metrale.engine_process SPEC     (loads the model, binds ipc/tcp)
              ──spawn──▶ python -m frontends.server SPEC        (gunicorn: N uvicorn workers, one port)

The frontends start at once and answer /health with 503 until the engine has loaded; "serving
on URL" is logged once /health answers 200. SIGINT or SIGTERM stops both (frontends first, so no
new request reaches a stopping engine). If the frontend arbiter dies, the engine is stopped and
`met serve` exits non-zero.

If the engine dies (kill -9, a crash), the frontends stay up: they fail every open request at
once (an error event in each open stream, a 503 to each waiting request, see metrale.client) and
answer 503 `model_not_loaded` + Retry-After until the engine is back. The supervisor restarts it
after a backoff (RESTART_BACKOFF_S, doubling, at most RESTART_BACKOFF_MAX_S), logged; more than
`max_restarts` restarts within `restart_window_s` seconds and it gives up: the frontends are
stopped and `met serve` exits with the engine's status. The restarted engine journals the
requests in flight at the crash as aborted (metrale.recovery).

Children are spawned with `python -P` and this process's package root first on PYTHONPATH: a
`metrale/` folder in the working directory is never imported in place of the installed one.

The ipc folder (`/tmp/metrale-*`) holds the socket files and `owner.pid` (pid and start time of
the `met serve` that made it); a folder whose owner is dead (a kill -9 of `met serve`) is removed
by the next `met serve` (make_ipc_dir).

The engine holds its event journal folder (a lock: two engines never share one) and writes its
socket addresses to `<event log>/engine.json` once it holds it, so that `met events` finds a
running single-box engine without being told where it is. A folder already held by a live
engine is refused here, before anything starts.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from metrale.engine_process import EngineSpec
from metrale.events import holder_pid

log = logging.getLogger("metrale.serve")

STOP_TIMEOUT_S = 15.0
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 8.0
IPC_PREFIX = "metrale-"
OWNER_FILE = "owner.pid"
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)   # holds metrale/ and frontends/


class RestartPolicy:
    """At most `max_restarts` engine restarts within `window_s`; backoff doubling from
    RESTART_BACKOFF_S to RESTART_BACKOFF_MAX_S (reset by a window without restarts)."""

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.times: list[float] = []

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart, or None: give up."""
        self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.max_restarts:
            return None
        delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** len(self.times))
        self.times.append(now)
        return delay


class Supervisor:
    def __init__(self, engine_spec: EngineSpec, frontend_spec: dict | None,
                 restart: RestartPolicy | None = None):
        self.engine_spec = engine_spec
        self.frontend_spec = frontend_spec
        self.restart = restart or RestartPolicy()
        self.engine: subprocess.Popen | None = None
        self.frontends: subprocess.Popen | None = None
        self.stopping = False
        self._announced = frontend_spec is None   # "serving on URL" logged

    def _spawn(self, module: str, spec: str) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH"))
                                            if p)
        return subprocess.Popen([sys.executable, "-P", "-m", module, spec], env=env)

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        self.engine = self._spawn("metrale.engine_process", self.engine_spec.to_json())
        if self.frontend_spec is not None:
            self.frontends = self._spawn("frontends.server", json.dumps(self.frontend_spec))
        try:
            return self._watch()
        finally:
            self._stop_all()

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _watch(self) -> int:
        while not self.stopping:
            rc = self.engine.poll()
            if rc is not None and not self.stopping and not self._restart_engine(rc):
                return rc or 1
            if self.frontends is not None and self.frontends.poll() is not None:
                log.error("the frontend server exited (status %s): stopping the engine",
                          self.frontends.returncode)
                return self.frontends.returncode or 1
            self._announce()
            time.sleep(0.2)
        log.info("shutting down")
        return 0

    def _restart_engine(self, rc: int) -> bool:
        """Restart a dead engine after the policy's backoff; False when the policy gives up."""
        delay = self.restart.next_delay(time.monotonic())
        if delay is None:
            log.error("the engine process exited (status %s) and was restarted %d times in "
                      "%.0fs: giving up, stopping the frontends", rc, self.restart.max_restarts,
                      self.restart.window_s)
            return False
        log.error("the engine process exited (status %s): restarting it in %.1fs "
                  "(frontends answer 503 until it is back)", rc, delay)
        deadline = time.monotonic() + delay
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.stopping:    # resume: the model a hot swap made live comes back (metrale.swap)
            spec = dataclasses.replace(self.engine_spec, resume=True)
            self.engine = self._spawn("metrale.engine_process", spec.to_json())
            log.info("engine restarted (pid %d)", self.engine.pid)
        return True

    def _announce(self) -> None:
        """Log "serving on URL" once, when /health first answers 200."""
        if self._announced:
            return
        url = health_url(self.frontend_spec["bind"])
        try:
            with urllib.request.urlopen(url, timeout=0.5) as r:
                ok = r.status == 200
                served = json.loads(r.read()).get("model")   # a hot swap may have changed it
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            ok = False
        if ok:
            self._announced = True
            log.info("serving %s on %s", served or self.engine_spec.model_name
                     or self.engine_spec.model, url.rsplit("/", 1)[0])

    def _stop_all(self) -> None:
        for proc in (self.frontends, self.engine):   # frontends first: no new requests
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    log.warning("pid %d did not stop in %.0fs: killing it", proc.pid,
                                STOP_TIMEOUT_S)
                    proc.kill()
                    proc.wait()


def health_url(bind: str) -> str:
    host, _, port = bind.rpartition(":")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    return f"http://{host}:{port}/health"


def serve(engine_spec: EngineSpec, frontend_spec: dict | None, ipc_dir: str | None,
          max_restarts: int = 5, restart_window_s: float = 60.0) -> int:
    if engine_spec.journal_dir and (pid := holder_pid(engine_spec.journal_dir)) is not None:
        log.error("the event journal %s is in use by another engine (pid %d); stop that server, "
                  "or give this one its own --event-log PATH (or --no-event-log)",
                  engine_spec.journal_dir, pid)
        return 1
    try:
        return Supervisor(engine_spec, frontend_spec,
                          RestartPolicy(max_restarts, restart_window_s)).run()
    finally:
        if ipc_dir:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def make_ipc_dir() -> str:
    """A fresh ipc folder owned by this process (owner.pid), after removing the folders of
    owners that are dead."""
    remove_stale_ipc_dirs()
    path = tempfile.mkdtemp(prefix=IPC_PREFIX)
    Path(path, OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return path


def remove_stale_ipc_dirs(base: str | None = None) -> list[str]:
    """Remove `metrale-*` folders whose owner.pid names a process that is gone (or a pid now
    reused by another process: the start time differs). Folders without owner.pid are not ours
    to judge and are left alone."""
    removed = []
    for d in Path(base or tempfile.gettempdir()).glob(IPC_PREFIX + "*"):
        try:
            pid, started = (d / OWNER_FILE).read_text().split()
            alive = _start_time(int(pid)) == started
        except (OSError, ValueError):
            continue
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    if removed:
        log.info("removed %d ipc folders of dead `met serve` processes", len(removed))
    return removed


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), "gone" when
    there is no such process: with the pid it names one process, never a later reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[19]
