"""`met serve`: one engine process and one gunicorn arbiter of N frontend workers, supervised.

    met serve ──spawn──▶ python -m metrale.engine_main SPEC     (loads the model, binds ipc/tcp)
              ──spawn──▶ python -m frontends.server SPEC        (gunicorn: N uvicorn workers, one port)

The frontends start at once and answer /health with 503 until the engine has loaded. SIGINT or
SIGTERM stops both (frontends first, so no new request reaches a stopping engine). If the engine
dies, the frontends are stopped too and `met serve` exits non-zero; if the frontend arbiter dies,
the engine is stopped and `met serve` exits non-zero.

The engine's socket addresses are written to `<event log>/engine.json` so that `met events`
finds a running single-box engine without being told where it is.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from metrale.engine_main import EngineSpec

log = logging.getLogger("metrale.serve")

ADDRESSES_FILE = "engine.json"
STOP_TIMEOUT_S = 15.0


def write_addresses(journal_dir: str | None, addresses: dict) -> None:
    if not journal_dir:
        return
    Path(journal_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(journal_dir) / f".{ADDRESSES_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({**addresses, "pid": os.getpid()}))
    tmp.replace(Path(journal_dir) / ADDRESSES_FILE)


class Supervisor:
    def __init__(self, engine_spec: EngineSpec, frontend_spec: dict | None):
        self.engine_spec = engine_spec
        self.frontend_spec = frontend_spec
        self.engine: subprocess.Popen | None = None
        self.frontends: subprocess.Popen | None = None
        self.stopping = False

    def _spawn(self, module: str, spec: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", module, spec])

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        self.engine = self._spawn("metrale.engine_main", self.engine_spec.to_json())
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
            if rc is not None:
                log.error("the engine process exited (status %s): stopping the frontends", rc)
                return rc or 1
            if self.frontends is not None and self.frontends.poll() is not None:
                log.error("the frontend server exited (status %s): stopping the engine",
                          self.frontends.returncode)
                return self.frontends.returncode or 1
            time.sleep(0.2)
        log.info("shutting down")
        return 0

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


def serve(engine_spec: EngineSpec, frontend_spec: dict | None, ipc_dir: str | None) -> int:
    write_addresses(engine_spec.journal_dir, engine_spec.addresses)
    try:
        return Supervisor(engine_spec, frontend_spec).run()
    finally:
        if ipc_dir:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def make_ipc_dir() -> str:
    return tempfile.mkdtemp(prefix="metrale-")
