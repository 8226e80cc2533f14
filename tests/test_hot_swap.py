"""Hot swap (metrale.swap) through real `met serve` processes: two tiny models, one scripted
(alpha: its replies say "alpha") and one random tiny llama with a tokenizer and chat template of
its own (bravo), registered as recipes in a test folder (METRALE_RECIPES_PATH).

Under load, a swap answers nothing but 200s and 503 model_not_loaded + Retry-After; a request in
flight finishes on the model it started on; after the swap the new model's tokenizer and
template serve. Refusals come before anything is released; a failed load restores the old
model; ModelReleased / ModelLoaded are journalled; the admin key gates loading; --auto-swap
swaps only for a different model with a known recipe; rate-limit buckets survive a swap.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import requests

from metrale.events import read_events
from tests.scripted_model import SERVE_ENV, make_scripted_model
from tests.serving import CHATML, Server, cmdline, make_tiny_chat_model
from tests.slow_load_model import DELAY_KEY

LOAD_DELAY_S = 4.0

ALPHA, BRAVO = "tiny-alpha", "tiny-bravo"
ALPHA_REPLY = "alpha " * 200
HELLO = [{"role": "user", "content": "Hello"}]


def _recipe(folder: Path, name: str, checkpoint: Path, model_name: str, **serve) -> None:
    lines = [f'description = "{name}: a tiny test model"', f'checkpoint = "{checkpoint}"',
             'family = "llama"', 'format = "bf16"', "", "[serve]", 'device = "cpu"',
             "max-seq-len = 1024", f'model-name = "{model_name}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in serve.items()]
    (folder / f"{name}.toml").write_text("\n".join(lines) + "\n")


def _drop_tensor(src: Path, dst: Path, name: str) -> None:
    """A copy of checkpoint `src` whose safetensors lacks `name`: the loader's header checks
    pass, building the model fails."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("swap-models")
    alpha = Path(make_scripted_model(root / "alpha", [{"when": "Hello", "reply": ALPHA_REPLY}]))
    bravo = make_tiny_chat_model(root / "bravo")
    _drop_tensor(bravo, root / "corrupt", "model.layers.1.mlp.down_proj.weight")
    unsupported = root / "unsupported"
    shutil.copytree(bravo, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    recipes = root / "recipes"
    recipes.mkdir()
    _recipe(recipes, ALPHA, alpha, ALPHA)
    _recipe(recipes, BRAVO, bravo, BRAVO)
    _recipe(recipes, "tiny-corrupt", root / "corrupt", "tiny-corrupt")
    _recipe(recipes, "tiny-unsupported", unsupported, "tiny-unsupported")
    _recipe(recipes, "tiny-two-ranks", bravo, "tiny-two", **{"tensor-parallel-size": 2})
    _recipe(recipes, "tiny-other-port", bravo, "tiny-port", port=9999)
    slow = root / "slow"
    shutil.copytree(bravo, slow)
    (slow / "config.json").write_text(json.dumps({**config, DELAY_KEY: LOAD_DELAY_S}))
    _recipe(recipes, "tiny-slow", slow, "tiny-slow")
    return {"alpha": alpha, "bravo": bravo, "recipes": recipes, "root": root}


def _env(models, **more) -> dict:
    plugins = f"{SERVE_ENV['METRALE_MODEL_PLUGINS']},tests.slow_load_model"
    return {"METRALE_MODEL_PLUGINS": plugins, "METRALE_RECIPES_PATH": str(models["recipes"]),
            **more}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("swap-serve")
    with Server(["serve", str(models["alpha"]), "--model-name", ALPHA, "--device", "cpu",
                 "--max-seq-len", "1024", "--frontends", "2"], logs / "serve.log",
                env=_env(models)).serving(180, workers=2) as srv:
        srv.events = logs / "events"
        yield srv


def chat(url, model=None, headers=None, max_tokens=4, **kw):
    body = {"messages": HELLO, "max_tokens": max_tokens, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def load(url, headers=None, **body):
    return requests.post(url + "/v1/models/load", json=body, headers=headers, timeout=120)


def library(url, headers=None) -> dict:
    r = requests.get(url + "/v1/library", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_served(url, name, headers=None, timeout=60.0) -> None:
    """Until every worker serves `name` (a few requests in a row answer with it)."""
    deadline, streak = time.monotonic() + timeout, 0
    while streak < 6:
        assert time.monotonic() < deadline, f"{name} not served in {timeout}s"
        r = requests.get(url + "/v1/models", headers={**(headers or {}), "Connection": "close"},
                         timeout=30)
        streak = streak + 1 if r.status_code == 200 and r.json()["data"][0]["id"] == name else 0
        time.sleep(0.05)


def swap_to(url, headers=None, **body) -> dict:
    r = load(url, headers, **body)
    assert r.status_code == 200, r.text
    wait_served(url, r.json()["model"], headers)
    return r.json()


def model_events(events_dir) -> list[dict]:
    return [e for e in read_events(events_dir) if e["type"].startswith("Model")]


class Load:
    """Threads sending short chat requests until stopped: every answer is kept."""

    def __init__(self, url, threads=3):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def _run(self, i):
        while not self.stop.is_set():
            r = chat(self.url)
            body = r.json()
            self.results.append((i, r.status_code, r.headers.get("Retry-After"), body))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_swap_under_load_in_flight_finish_on_the_old_model(server, models):
    wait_served(server.url, ALPHA)
    stream = requests.post(server.url + "/v1/chat/completions", stream=True, timeout=120, json={
        "messages": HELLO, "max_tokens": 900, "temperature": 0, "stream": True})
    lines = stream.iter_lines()
    first = next(line for line in lines if line.startswith(b"data: "))
    with Load(server.url) as traffic:
        time.sleep(0.2)
        r = load(server.url, recipe=BRAVO, wait=False)
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "draining" and r.json()["target"] == BRAVO
        assert r.json()["in_flight"] >= 1           # the stream at least
        chunks = [first] + [line for line in lines if line.startswith(b"data: ")]
        wait_served(server.url, BRAVO)
        time.sleep(0.5)
    assert chunks[-1] == b"data: [DONE]"
    parsed = [json.loads(c[6:]) for c in chunks[:-1]]
    assert {p["model"] for p in parsed} == {ALPHA}          # it finished on alpha
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed if p["choices"])
    assert text == ALPHA_REPLY[:900], text

    statuses = [s for _, s, _, _ in traffic.results]
    assert set(statuses) <= {200, 503}, traffic.results
    assert 503 in statuses and 200 in statuses
    seen_bravo = set()
    for thread, status, retry_after, body in traffic.results:
        if status == 503:
            assert retry_after and int(retry_after) >= 1
            assert body["error"]["code"] == "model_not_loaded"
            continue
        model = body["model"]
        assert model in (ALPHA, BRAVO)
        if model == ALPHA:
            assert thread not in seen_bravo, "alpha answered after bravo did"
            assert ALPHA_REPLY.startswith(body["choices"][0]["message"]["content"])
        else:
            seen_bravo.add(thread)
    assert seen_bravo, "no request was served by the new model"


def test_after_a_swap_the_new_models_tokenizer_and_template_serve(server, models):
    from jinja2 import Template
    from tokenizers import Tokenizer

    swap_to(server.url, recipe=BRAVO)
    tok = Tokenizer.from_file(str(models["bravo"] / "tokenizer.json"))
    def tokenize(body):
        """A worker that has not fetched the new model_info yet answers 503 + Retry-After
        for a moment: retry as a client should."""
        for _ in range(50):
            r = requests.post(server.url + "/tokenize", json=body, timeout=30,
                              headers={"Connection": "close"})
            if r.status_code != 503:
                return r
            assert r.headers.get("Retry-After")
            time.sleep(0.2)
        return r
    for _ in range(4):      # both workers
        r = tokenize({"prompt": " w7 w8"})
        assert r.json()["tokens"] == tok.encode(" w7 w8").ids and r.json()["count"] == 2
        r = tokenize({"messages": HELLO})
        prompt = Template(CHATML).render(messages=HELLO, add_generation_prompt=True)
        assert r.json()["tokens"] == tok.encode(prompt, add_special_tokens=False).ids
    assert chat(server.url, max_tokens=3).json()["model"] == BRAVO
    # back to alpha by model path (the server's own flags): its reply again
    out = swap_to(server.url, model=str(models["alpha"]))
    assert out["status"] == "loaded"
    reply = chat(server.url, max_tokens=3).json()        # named for its folder: no recipe
    assert reply["model"] == "alpha" and reply["choices"][0]["message"]["content"] == "alp"
    assert library(server.url)["live"]["recipe"] is None


def test_while_a_model_loads_the_engine_answers_and_refuses_with_503(server, models):
    """The loading phase (the engine's loop busy building): /health, model routes and a second
    load answer at once (the engine's LoadingResponder), the Library shows the progress, and
    no worker takes the engine for lost."""
    swap_to(server.url, recipe=ALPHA)
    r = load(server.url, recipe="tiny-slow", wait=False)
    assert r.status_code == 202, r.text
    lib = _until(lambda: (lib := library(server.url))["swap"]["state"] == "loading" and lib)
    assert lib["swap"]["target"] == "tiny-slow" and lib["live"] is None
    t0 = time.monotonic()
    health = requests.get(server.url + "/health", timeout=30)
    assert health.status_code == 503 and health.headers["Retry-After"]
    assert health.json()["error"]["code"] == "model_not_loaded"
    r = chat(server.url)
    assert r.status_code == 503 and r.headers["Retry-After"]
    r = load(server.url, recipe=BRAVO)
    assert r.status_code == 409 and r.json()["error"]["code"] == "swap_in_progress"
    assert time.monotonic() - t0 < LOAD_DELAY_S / 2          # answered, not queued behind it
    later = library(server.url)["swap"]
    assert later["state"] == "loading" and later["elapsed_s"] > lib["swap"]["elapsed_s"]
    wait_served(server.url, "tiny-slow")
    last = library(server.url)["swap"]["last"]
    assert last["ok"] and last["seconds"] >= LOAD_DELAY_S
    assert chat(server.url).status_code == 200


def _until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("not within the timeout")


def test_unsupported_model_is_refused_before_anything_is_released(server, models):
    swap_to(server.url, recipe=ALPHA)
    before = len(model_events(server.events))
    r = load(server.url, recipe="tiny-unsupported")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "model_not_supported"
    assert "gpt2" in r.json()["error"]["message"]
    r = load(server.url, model=str(models["root"] / "nowhere"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = load(server.url, recipe="no-such-recipe")
    assert r.status_code == 404 and r.json()["error"]["code"] == "recipe_not_found"
    for bad in ({}, {"recipe": ALPHA, "model": "x"}, {"recipe": 3}, {"recipe": ALPHA, "wait": 1},
                {"recipe": ALPHA, "speed": "fast"}):
        r = load(server.url, **bad)
        assert r.status_code == 400, (bad, r.text)
    assert len(model_events(server.events)) == before        # nothing released
    assert chat(server.url).json()["model"] == ALPHA
    assert library(server.url)["swap"]["state"] == "serving"


def test_a_recipe_needing_two_ranks_is_refused_and_a_port_is_warned(server, models):
    r = load(server.url, recipe="tiny-two-ranks")
    assert r.status_code == 400 and r.json()["error"]["code"] == "multi_rank_recipe", r.text
    out = swap_to(server.url, recipe="tiny-other-port")
    assert any("--port" in w for w in out["warnings"]), out
    assert chat(server.url).json()["model"] == "tiny-port"
    assert library(server.url)["live"]["recipe"] == "tiny-other-port"


def test_failed_load_restores_the_previous_model(server, models):
    swap_to(server.url, recipe=ALPHA)
    r = load(server.url, recipe="tiny-corrupt")
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["status"] == "restored" and body["model"] == ALPHA
    assert body["error"]["code"] == "model_load_failed"
    assert "down_proj" in body["error"]["message"]
    wait_served(server.url, ALPHA)
    assert chat(server.url).json()["choices"][0]["message"]["content"].startswith("alph")
    last = library(server.url)["swap"]["last"]
    assert last["ok"] is False and last["restored"] is True and "down_proj" in last["error"]
    events = model_events(server.events)
    released, loaded = events[-2], events[-1]
    assert released["type"] == "ModelReleased" and released["to"] == "tiny-corrupt"
    assert loaded["type"] == "ModelLoaded" and loaded["model"] == ALPHA
    assert "down_proj" in loaded["error"]


def test_swaps_are_journalled(server, models):
    swap_to(server.url, recipe=BRAVO)
    swap_to(server.url, recipe=ALPHA)
    events = model_events(server.events)
    assert events[0]["type"] == "ModelLoaded" and events[0]["model"] == ALPHA
    pairs = [(a, b) for a, b in zip(events, events[1:]) if a["type"] == "ModelReleased"]
    assert len(pairs) >= 2
    for released, loaded in pairs:
        assert loaded["type"] == "ModelLoaded" and loaded["swap_id"] == released["swap_id"]
    assert [e["model"] for e in events[-2:]] == [BRAVO, ALPHA]
    assert events[-1]["recipe"] == ALPHA and events[-1]["error"] is None
    assert events[-1]["load_id"] > events[0]["load_id"]


def test_an_engine_restarted_after_a_crash_serves_the_swapped_in_model(server, models):
    swap_to(server.url, recipe=BRAVO)
    engine = next(pid for pid in server.children() if "metrale.engine_process" in cmdline(pid))
    os.kill(engine, signal.SIGKILL)
    _until(lambda: requests.get(server.url + "/health", timeout=30).status_code == 503, 30)
    wait_served(server.url, BRAVO, timeout=120)            # not the command line's alpha
    assert chat(server.url).json()["model"] == BRAVO
    assert library(server.url)["live"]["recipe"] == BRAVO
    swap_to(server.url, recipe=ALPHA)


def test_no_model_left_when_the_restore_fails_too_then_a_load_serves_again(models, tmp_path):
    """The failed load's restore finds the old checkpoint gone: no model is served (503
    model_not_loaded + Retry-After, /health too), the Library says so, and a later load works."""
    gone = tmp_path / "alpha-copy"
    shutil.copytree(models["alpha"], gone)
    with Server(["serve", str(gone), "--model-name", "doomed", "--device", "cpu",
                 "--max-seq-len", "1024", "--frontends", "1"], tmp_path / "serve.log",
                env=_env(models)).serving(180) as srv:
        shutil.rmtree(gone)
        r = load(srv.url, recipe="tiny-corrupt")
        assert r.status_code == 503 and r.json()["status"] == "empty", r.text
        assert "restoring the previous model failed" in r.json()["error"]["message"]
        lib = library(srv.url)
        assert lib["live"] is None and lib["swap"]["state"] == "empty"
        for path in ("/v1/models", "/health"):
            r = requests.get(srv.url + path, timeout=30)
            assert r.status_code == 503 and r.headers["Retry-After"], (path, r.text)
            assert r.json()["error"]["code"] == "model_not_loaded"
        r = chat(srv.url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
        assert swap_to(srv.url, recipe=BRAVO)["model"] == BRAVO
        assert chat(srv.url).json()["model"] == BRAVO
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
        assert "ModelLoadFailed" in [e["type"] for e in model_events(tmp_path / "events")]


# ---- auth, the admin key, --auto-swap and the rate limiter -------------------------------------

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def auth_server(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("swap-auth")
    with Server(["serve", str(models["alpha"]), "--model-name", ALPHA, "--device", "cpu",
                 "--max-seq-len", "1024", "--frontends", "1", "--auth-token", "user-key",
                 "--admin-token", "admin-key", "--auto-swap"], logs / "serve.log",
                env=_env(models, METRALE_RATE_LIMIT_RPM="1",
                         METRALE_RATE_LIMIT_BURST_RPM="10000")).serving(180) as srv:
        yield srv


def test_loading_needs_an_admin_key_when_auth_is_on(auth_server):
    url = auth_server.url
    r = load(url, recipe=BRAVO)
    assert r.status_code == 401
    r = load(url, USER, recipe=BRAVO)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert requests.get(url + "/v1/library", timeout=30).status_code == 401
    assert requests.get(url + "/", headers={"Accept": "text/html"}, timeout=30).status_code == 200
    out = swap_to(url, ADMIN, recipe=BRAVO)
    assert out["model"] == BRAVO
    assert chat(url, headers=ADMIN).json()["model"] == BRAVO      # an admin key is an API key
    swap_to(url, ADMIN, recipe=ALPHA)


def test_auto_swap_swaps_only_to_a_different_model_with_a_recipe(auth_server):
    url = auth_server.url
    wait_served(url, ALPHA, USER)
    swaps = library(url, USER)["swap"]["swap_id"]
    assert chat(url, headers=USER).json()["model"] == ALPHA                 # absent
    assert chat(url, ALPHA, headers=USER).json()["model"] == ALPHA          # already live
    r = chat(url, "gpt-4o", headers=USER)                # unrecognised: the live model serves it
    assert r.status_code == 200 and r.json()["model"] == ALPHA
    assert library(url, USER)["swap"]["swap_id"] == swaps                   # none of them swapped
    r = chat(url, BRAVO, headers=USER)                                      # a recipe's model name
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json()["error"]["code"] == "model_not_loaded"
    wait_served(url, BRAVO, USER)
    r = chat(url, BRAVO, headers=USER)
    assert r.status_code == 200 and r.json()["model"] == BRAVO
    assert library(url, USER)["swap"]["swap_id"] == swaps + 1
    r = chat(url, ALPHA, headers=USER)                                      # and back
    assert r.status_code == 503
    wait_served(url, ALPHA, USER)


def test_rate_limit_buckets_survive_a_swap(auth_server):
    url = auth_server.url
    wait_served(url, ALPHA, USER)

    def remaining():
        r = chat(url, headers=USER)
        assert r.status_code == 200, r.text
        return int(r.headers["x-ratelimit-remaining-requests"])

    for _ in range(6):
        before = remaining()
    swap_to(url, ADMIN, recipe=BRAVO)
    after = remaining()
    fresh = 10000 - 1                # what a new bucket would say after one request
    assert after <= before < fresh - 5       # the same bucket (refilling 1 a minute) goes on
    swap_to(url, ADMIN, recipe=ALPHA)


# ---- release: nothing of the old model is left -----------------------------------------------

def _spec(model: Path, device: str = "cpu", load_format: str = "auto", **engine):
    from metrale.engine_process import EngineSpec

    return EngineSpec(model=str(model), addresses={}, progress=False, load_format=load_format,
                      engine_config={"device": device, "max_seq_len": 256, **engine})


def test_release_frees_every_object_of_the_model(models):
    from metrale.engine_process import load_engine
    from metrale.swap import release

    core, info = load_engine(_spec(models["bravo"]))
    refs = [weakref.ref(o) for o in (core, core.model, core.runner, core.scheduler)]
    pool = weakref.ref(core.caches)
    core.itself = core                  # a reference cycle, as a CUDA engine has (graphs, ops)
    del info
    gc.disable()                        # only release's own collection may free the cycle
    try:
        reclaim = release(core)
        del core
        assert pool() is not None       # nothing collected behind the caller's back
        reclaim()
        assert all(r() is None for r in refs) and pool() is None
    finally:
        gc.enable()


def test_a_handler_that_keeps_log_records_does_not_keep_a_released_engine(tmp_path):
    """The engine's load-time warnings (here: a WordPiece tokenizer the grammar library cannot
    read) must not pin it: a record holding an exception holds its traceback's frames, and those
    the engine (on the H200 every swap kept the old model's memory under pytest's log capture)."""
    from metrale.engine_process import load_engine
    from metrale.swap import release
    from perf.ladder import write_model_folder

    folder = write_model_folder("smollm2_135m", tmp_path / "s")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("metrale").addHandler(handler)
    try:
        core, _ = load_engine(_spec(folder, "cpu", "dummy", warmup="off", num_kv_blocks=64))
        assert any("structured output is off" in r.getMessage() for r in records)
        engine = weakref.ref(core)
        reclaim = release(core)
        del core
        reclaim()
        assert engine() is None
    finally:
        logging.getLogger("metrale").removeHandler(handler)


@pytest.mark.gpu
def test_gpu_memory_after_ten_swaps_is_back_to_within_one_percent(tmp_path):
    """Two real shapes with synthetic weights swapped ten times: the device memory in use after
    each load is within 1 % of the first load's."""
    from metrale.engine_process import load_engine
    from metrale.swap import memory_figures, release
    from perf.ladder import write_model_folder

    folders = [write_model_folder(s, tmp_path / s) for s in ("smollm2_135m", "qwen3_5_9b")]
    used = {0: [], 1: []}
    for i in range(10):
        which = i % 2
        # a fixed KV pool: sized from free memory, it would fill whatever a leak left
        core, _ = load_engine(_spec(folders[which], "cuda", "dummy", warmup="off",
                                    num_kv_blocks=1024))
        used[which].append(memory_figures(core)["device_used_bytes"])
        reclaim = release(core)
        del core
        reclaim()
    for which, series in used.items():
        assert np.ptp(series) <= 0.01 * series[0], (which, series)
