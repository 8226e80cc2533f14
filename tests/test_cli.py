"""The `met` command line: flags, refusals, dump-serve-options, and auth + rate limits on a live
server of a tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from metrale import __version__
from metrale.cli import default_model_path
from tests.serving import REPO, Server, make_tiny_chat_model


def met(*args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "metrale.cli", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120)


def test_version_and_help():
    out = met("--version")
    assert out.returncode == 0 and __version__ in out.stdout
    out = met("--help")
    assert out.returncode == 0
    for command in ("serve", "frontend", "events", "dump-serve-options"):
        assert command in out.stdout
    out = met("serve", "--help")
    assert "--enable-prefix-caching" in out.stdout and "--served-model-name" in out.stdout


@pytest.mark.parametrize("args", [["--enable-prefix-caching", "true"],
                                  ["--profile=false"], ["/some/model", "--disable-thinking", "on"]])
def test_boolean_flags_are_presence_only(args):
    out = met("serve", *args)
    assert out.returncode == 2
    assert "presence-only" in out.stderr and args[-1].split("=")[-1] in out.stderr


def test_undeclared_lever_is_refused():
    out = met("dump-serve-options", env={"METRALE_MAX_BODY_BYTE": "5"})
    assert out.returncode == 2 and "METRALE_MAX_BODY_BYTE" in out.stderr


def test_bad_values_are_refused_with_the_flag_named():
    out = met("serve", "/nonexistent", "--max-batch-size", "0")
    assert out.returncode == 2 and "--max-batch-size" in out.stderr
    out = met("serve", "/nonexistent", "--require-auth")
    assert out.returncode == 2 and "--auth-token" in out.stderr
    out = met("serve", "/nonexistent", "--require-auth", "--auth-token", " ")
    assert out.returncode == 2 and "empty" in out.stderr


def test_auth_needs_real_keys(tmp_path):
    """No "accept any key" mode: --require-auth with no key, an empty key, or a keys file of
    nothing but comments is refused before anything starts."""
    comments = tmp_path / "keys"
    comments.write_text("# no keys yet\n\n   \n")
    for args in (["--require-auth"], ["--require-auth", "--auth-tokens-file", str(comments)],
                 ["--require-auth", "--auth-token", ""],
                 ["--require-auth", "--auth-token", "k", "--auth-token", ""]):
        out = met("serve", "/nonexistent", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert "key" in out.stderr
    out = met("serve", "/nonexistent", "--require-auth", "--auth-tokens-file",
              str(tmp_path / "missing"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_more_bad_values():
    out = met("serve", "--model-from-path", "/nonexistent")
    assert out.returncode == 2 and "/nonexistent" in out.stderr
    out = met("frontend", "--engine", "ipc://nope")
    assert out.returncode == 2 and "tcp://HOST:PORT" in out.stderr


def test_dump_serve_options():
    out = met("dump-serve-options")
    assert out.returncode == 0
    data = json.loads(out.stdout)
    flags = data["flags"]
    assert flags["--port"]["default"] == 8888
    assert flags["--host"]["default"] == "127.0.0.1"
    assert flags["--max-seq-len"]["default"] == 32768
    assert flags["--request-timeout"]["default"] == 300
    assert flags["--tool-max-tokens"]["default"] == 8192
    assert flags["--enable-prefix-caching"]["boolean"] is True
    assert "--model-name" in flags["--served-model-name"]["aliases"]
    names = {lv["name"] for lv in data["levers"]}
    assert {"METRALE_MAX_BODY_BYTES", "METRALE_RATE_LIMIT_RPM", "METRALE_LOG_LEVEL"} <= names


def test_default_model_is_the_embedded_smollm2():
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_auth_and_rate_limits(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny")
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk2\n")
    srv = Server(["serve", str(model), "--frontends", "1", "--max-seq-len", "256",
                  "--no-event-log", "--require-auth", "--auth-token", "k1", "--auth-tokens-file",
                  str(keys), "--metrics-public"], tmp_path / "serve.log",
                 env={"METRALE_RATE_LIMIT_RPM": "3"})
    try:
        srv.wait_healthy()
        models = srv.url + "/v1/models"
        r = requests.get(models)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(models, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert requests.get(models, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert requests.get(models, headers={"x-api-key": "k2"}).status_code == 200
        assert requests.post(srv.url + "/tokenize", json={"prompt": "a"}).status_code == 401
        assert requests.get(srv.url + "/metrics").status_code == 200     # --metrics-public

        def complete(key):
            return requests.post(srv.url + "/v1/completions", json={"prompt": "a",
                                 "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"})
        answers = [complete("k1") for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
        assert answers[0].headers["x-ratelimit-reset-requests"].endswith("s")
        assert int(answers[3].headers["Retry-After"]) >= 1
        assert answers[3].json()["error"]["type"] == "rate_limit_error"
        assert complete("k2").status_code == 200      # another key has its own bucket
    finally:
        assert srv.stop() == 0    # SIGTERM: engine and workers stop cleanly


def test_serve_help_shows_every_default():
    out = met("serve", "--help").stdout
    for text in ("(default: 8888)", "(default 127.0.0.1", "(default: 32768)",
                 "(default: off)", "(default: 300.0)"):
        assert text in " ".join(out.split()), text
    # every option line carries its default
    import argparse

    from metrale.cli import build_parser

    serve = next(a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    helps = [serve.formatter_class(prog="x")._get_help_string(a) for a in serve._actions
             if a.option_strings and a.dest != "help"]
    assert all("default" in h for h in helps), [h for h in helps if "default" not in h]


def test_unknown_flag_prints_the_serve_usage_and_the_closest_flags():
    out = met("serve", "--max-seq-lenn", "64")
    assert out.returncode == 2
    assert "did you mean --max-seq-len" in out.stderr
    assert "usage: met serve" in out.stderr and "usage: met [-h]" not in out.stderr
    out = met("serve", "--max-num-batched-tokens", "64")       # a vLLM flag we spell otherwise
    assert out.returncode == 2 and "--max-prefill-tokens" in out.stderr
    out = met("events", "--from-sq", "3")
    assert out.returncode == 2 and "--from-seq" in out.stderr and "usage: met events" in out.stderr


def test_vllm_spellings_with_the_same_meaning_are_accepted():
    flags = json.loads(met("dump-serve-options").stdout)["flags"]
    assert "--max-model-len" in flags["--max-seq-len"]["aliases"]
    assert "--api-key" in flags["--auth-token"]["aliases"]
    assert flags["--tensor-parallel-size"]["default"] == 1
    assert "--chat-template" in flags
    out = met("serve", "/nonexistent", "--tensor-parallel-size", "2")
    assert out.returncode == 2 and "--tensor-parallel-size" in out.stderr


def test_port_in_use_is_refused_before_the_model_loads(tmp_path):
    import socket
    import time as _time

    model = make_tiny_chat_model(tmp_path / "tiny")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = _time.monotonic()
        out = met("serve", str(model), "--no-event-log", "--port", str(port))
        assert out.returncode == 2, out.stderr
        assert "--port" in out.stderr and "in use" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr     # one line, no traceback
        assert _time.monotonic() - t0 < 30


def test_dump_serve_options_into_a_closed_pipe_prints_no_traceback():
    out = subprocess.run(f"{sys.executable} -m metrale.cli dump-serve-options | head -1",
                         shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "{"
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_an_auth_token_without_require_auth_turns_auth_on(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny")
    srv = Server(["serve", str(model), "--frontends", "1", "--max-seq-len", "256",
                  "--no-event-log", "--api-key", "k1"], tmp_path / "serve.log")
    try:
        srv.wait_healthy()
        models = srv.url + "/v1/models"
        assert requests.get(models).status_code == 401
        assert requests.get(models, headers={"Authorization": "Bearer k1"}).status_code == 200
    finally:
        assert srv.stop() == 0


def test_chat_template_flag_is_checked_before_the_model_loads(tmp_path):
    out = met("serve", "/nonexistent", "--chat-template", "no-such-template.jinja")
    assert out.returncode == 2 and "--chat-template" in out.stderr and "no such file" in out.stderr


def test_chat_template_flag_renders_the_served_prompt(tmp_path):
    """The tiny model's tokenizer is one token per byte: the prompt token count shows which
    template rendered the conversation."""
    model = make_tiny_chat_model(tmp_path / "tiny")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    srv = Server(["serve", str(model), "--frontends", "1", "--max-seq-len", "256",
                  "--no-event-log", "--chat-template", str(template)], tmp_path / "serve.log")
    try:
        srv.wait_healthy()
        r = requests.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "abc"}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len("<<abc>>")
    finally:
        assert srv.stop() == 0


def test_startup_log_is_one_format_without_warnings_for_defaults(tmp_path):
    """Engine, gunicorn and uvicorn lines share one format; the weights' memory is logged next
    to the KV and state pools; a default --max-seq-len above the model's positions is capped
    and said once at info level, and nothing at startup is a warning."""
    import re
    import time as _time

    model = make_tiny_chat_model(tmp_path / "tiny")        # 4096 positions < the 32768 default
    srv = Server(["serve", str(model), "--frontends", "1", "--no-event-log"],
                 tmp_path / "serve.log", env={"METRALE_LOG_LEVEL": "info"})
    try:
        srv.wait_healthy()
        requests.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        _time.sleep(0.5)
    finally:
        assert srv.stop() == 0
    text = (tmp_path / "serve.log").read_text(errors="replace")
    lines = [ln for ln in text.replace("\r", "\n").splitlines()
             if ln.strip() and not ln.lstrip().startswith("loading ")]    # the tqdm load bar
    line = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")
    odd = [ln for ln in lines if not line.match(ln)]
    assert not odd, odd[:5]
    assert not [ln for ln in lines if " WARNING " in ln], [ln for ln in lines if " WARNING " in ln]
    caps = [ln for ln in lines if "--max-seq-len" in ln]
    assert len(caps) == 1 and " INFO " in caps[0] and "4096" in caps[0], caps
    ready = [ln for ln in lines if "engine ready" in ln]
    assert len(ready) == 1 and "weights" in ready[0] and "KV pool" in ready[0], ready
