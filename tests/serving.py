"""Helpers for end-to-end tests: a real `met serve` (or `met frontend`) process on a free port,
and a tiny random model folder with a real byte-level tokenizer and a ChatML template.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from tests.tiny_models import VOCAB, make_tiny

REPO = Path(__file__).resolve().parent.parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def free_port(span: int = 1) -> int:
    """A port p with p..p+span-1 free (for --engine-bind, which uses 4)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65535 and all(_free(port + i) for i in range(span)):
            return port
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def make_tiny_chat_model(path: Path, **shape) -> Path:
    """A tiny random llama with a byte-level BPE tokenizer filling its 320-id vocabulary
    (`shape`: config overrides, e.g. a head_dim the CUDA kernels instantiate)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return path
    make_tiny("llama", path, max_position_embeddings=4096, **shape)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    extra = VOCAB - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f" w{i}", special=False) for i in range(extra)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))
    return path


class Server:
    """`python -m metrale.cli ARGS...` with its output in a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.args = list(args) + ["--port", str(self.port)]
        if args and args[0] == "serve" and not {"--event-log", "--no-event-log"} & set(args):
            # a journal of its own: the default folder is one engine's at a time (journal.lock),
            # and a server of the developer's or of another test run may hold it
            self.args += ["--event-log", str(self.log_path.parent / "events")]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
        full_env.update(env or {})
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "metrale.cli", *self.args],
                                     cwd=REPO, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    @contextmanager
    def serving(self, timeout: float = 180.0, workers: int = 0):
        """Healthy (and `workers` frontend workers with the model) inside the block, stopped
        after it: a module fixture is `with Server(...).serving() as srv: yield srv`."""
        try:
            self.wait_healthy(timeout)
            if workers:
                self.wait_workers_ready(workers)
            yield self
        finally:
            self.stop()

    def wait_healthy(self, timeout: float = 180.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=10).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not healthy in {timeout}s:\n{self.tail()}")

    def wait_workers_ready(self, n: int, timeout: float = 60.0) -> None:
        """Until n distinct workers have answered /v1/models (each fetched model_info)."""
        seen = set()
        deadline = time.monotonic() + timeout
        while len(seen) < n and time.monotonic() < deadline:
            r = requests.get(self.url + "/v1/models", timeout=10,
                             headers={"Connection": "close"})
            if r.status_code == 200:
                seen.add(r.headers["x-metrale-worker"])
        assert len(seen) >= n, f"only workers {seen} answered"

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def children(self) -> list[int]:
        return children_of(self.proc.pid)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in _descendants(self.proc.pid):
                    _kill(pid)
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _descendants(pid: int) -> list[int]:
    out = []
    for c in children_of(pid):
        out += [c, *_descendants(c)]
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_subscribed(push, sub, frontend_id: str) -> None:
    """Send heartbeats of `frontend_id` on `push` until the engine's echo arrives on `sub`: the
    SUB socket is subscribed from then on (ZeroMQ drops what a PUB sends before that)."""
    from metrale import wire

    hello = wire.encode(wire.Heartbeat(frontend_id))
    while True:
        push.send_multipart(hello)
        if sub.poll(200):
            sub.recv_multipart()
            return
