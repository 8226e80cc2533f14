"""`met serve` and its event journal folder: a folder another engine holds is refused before
anything starts (engine.json untouched), and a real transformers-saved tokenizer_config (its
`model_max_length` of 1e30) boots and answers a chat request, with `met events` following."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import requests

from metrale.events import Journal
from tests.serving import REPO, Server, free_port, make_tiny_chat_model

HUGE = 1000000000000000019884624838656      # what transformers writes for "no limit"


def test_a_journal_held_by_another_engine_is_refused_before_anything_starts(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-llama")
    events = tmp_path / "events"
    held = Journal(events)             # "the other engine": this process holds the folder
    (events / "engine.json").write_text('{"events": "ipc:///the-live-one"}')
    try:
        out = subprocess.run([sys.executable, "-m", "metrale.cli", "serve", str(model),
                              "--event-log", str(events), "--port", str(free_port())],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    assert out.returncode != 0
    assert f"{events} is in use by another engine (pid {os.getpid()})" in out.stderr
    assert "--event-log" in out.stderr
    assert (events / "engine.json").read_text() == '{"events": "ipc:///the-live-one"}'


def test_a_transformers_tokenizer_config_with_a_huge_model_max_length_serves(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(model_max_length=HUGE, clean_up_tokenization_spaces=False,
                  added_tokens_decoder={"0": {"content": "!", "special": False}})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    events = tmp_path / "events"
    with Server(["serve", str(model), "--frontends", "1", "--max-seq-len", "256",
                 "--event-log", str(events)], tmp_path / "serve.log").serving(workers=1) as srv:
        r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        info = json.loads((events / "engine.json").read_text())
        assert info["pid"] != srv.proc.pid           # written by the engine, which holds the lock
        tail = subprocess.run([sys.executable, "-m", "metrale.cli", "events", "--event-log",
                               str(events), "--from-seq", "1", "--no-follow"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        types = [json.loads(line)["type"] for line in tail.stdout.splitlines()]
        assert types[0] == "ModelLoaded" and "RequestFinished" in types, tail.stderr
