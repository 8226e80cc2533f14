"""Sampling through the engine: a bad seed fails its own request only, the engine seed makes
unseeded text differ across restarts (and repeat under --seed N), and a model's
generation_config.json supplies the defaults of a real `met serve`."""
from __future__ import annotations

import json
import math

import pytest
import requests
import zmq

from metrale import wire
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.engine_server import EngineAddresses, EngineServer
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams
from tests.serving import Server, make_tiny_chat_model
from tests.tiny_models import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_checkpoint(make_tiny("llama", tmp_path_factory.mktemp("tiny") / "m"))


def _core(ckpt, **kw) -> EngineCore:
    return EngineCore(ckpt, EngineConfig(max_seq_len=128, max_batch_size=4, **kw))


def _generate(core: EngineCore, params: SamplingParams, rid: str = "r") -> list[int]:
    core.add_request(Request(rid, [5, 6, 7, 8], params))
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == rid:
                tokens += out.token_ids
    return tokens


UNSEEDED = dict(max_tokens=24, temperature=1.0, ignore_eos=True)


def test_unseeded_text_differs_across_restarts_and_repeats_under_a_fixed_seed(tiny):
    fresh = [_generate(_core(tiny), SamplingParams(**UNSEEDED).validate()) for _ in range(2)]
    assert fresh[0] != fresh[1], "two fresh engines drew the same 'random' text"
    fixed = [_generate(_core(tiny, seed=7), SamplingParams(**UNSEEDED).validate())
             for _ in range(2)]
    assert fixed[0] == fixed[1]


def test_a_seed_the_generator_refuses_fails_at_admission_not_in_the_step(tiny):
    core = _core(tiny)
    bad = SamplingParams(max_tokens=4, temperature=1.0, seed=-1)     # not validated
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^64\)"):
        core.add_request(Request("bad", [1, 2, 3], bad))
    assert not core.has_unfinished()
    assert len(_generate(core, SamplingParams(max_tokens=4, temperature=1.0,
                                              ignore_eos=True).validate())) == 4


def test_a_negative_seed_is_refused_alone_and_the_good_request_completes(tiny, tmp_path):
    core = _core(tiny)
    server = EngineServer(core, wire.ModelInfo("tiny"), EngineAddresses.ipc(str(tmp_path)), None)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"fe")
    sub.connect(server.addresses.output)
    while True:          # the subscription is live once an echo comes back
        server._send("fe", [])
        if sub.poll(100):
            sub.recv_multipart()
            break
    try:
        server._submit(wire.Submit("good", "fe", (1, 2, 3), SamplingParams(
            max_tokens=5, temperature=1.0, ignore_eos=True)))
        server._submit(wire.Submit("bad", "fe", (1, 2, 3), SamplingParams(
            max_tokens=5, temperature=1.0, seed=-1)))
        while core.has_unfinished():
            server._step()
        server._flush()
        deltas = []
        while sub.poll(1000):
            deltas += wire.decode(sub.recv_multipart()[1:]).deltas
        bad = [d for d in deltas if d.request_id == "bad"]
        assert len(bad) == 1 and bad[0].error_status == 400 and "seed" in bad[0].error
        good = [d for d in deltas if d.request_id == "good"]
        assert not any(d.error for d in good)
        assert sum(len(d.token_ids) for d in good) == 5
    finally:
        sub.close(0)
        server.close()


# ---- generation_config.json through a real server --------------------------------------------

GENERATION_CONFIG = {"temperature": 0.0, "top_k": 3, "top_p": 0.5, "repetition_penalty": 1.5}
CHAT = [{"role": "user", "content": "tell me about the weather in spring"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_chat_model(tmp_path_factory.mktemp("gen") / "m")
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **GENERATION_CONFIG}))
    logs = tmp_path_factory.mktemp("gen-logs")
    with Server(["serve", "--model-from-path", str(folder), "--frontends", "1", "--device", "cpu",
                 "--max-seq-len", "256", "--no-event-log", "--default-min-p", "0",
                 "--default-top-n-sigma", "0"], logs / "serve.log").serving(240) as srv:
        yield srv


def _chat(server, **fields) -> list[dict]:
    body = {"messages": CHAT, "max_tokens": 12, "logprobs": True, "top_logprobs": 5, **fields}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["content"]


def _ranks(content: list[dict]) -> list[int]:
    return [1 + sum(t["logprob"] > c["logprob"] for t in c["top_logprobs"]) for c in content]


def test_generation_config_temperature_and_repetition_penalty_are_the_defaults(server):
    plain = _chat(server)
    assert _chat(server) == plain                    # temperature 0 from generation_config
    assert _ranks(plain) == [1] * len(plain)
    assert _chat(server, temperature=0, repetition_penalty=1.5) == plain
    unpenalised = _chat(server, temperature=0, repetition_penalty=1.0)
    assert unpenalised[0]["logprob"] != plain[0]["logprob"]    # the penalty was applied


def test_generation_config_top_k_and_top_p_truncate_a_request_that_sets_temperature(server):
    for _ in range(3):
        content = _chat(server, temperature=1.0, max_tokens=16)
        for c in content:
            tops = sorted((t["logprob"] for t in c["top_logprobs"]), reverse=True)[:3]
            assert c["logprob"] >= tops[2] - 1e-6, "drew outside generation_config's top_k 3"
            before = sum(math.exp(lp) for lp in tops if lp > c["logprob"])
            assert before / sum(math.exp(lp) for lp in tops) < 0.5 + 1e-6, "outside top_p 0.5"
    untruncated = [r for _ in range(3) for r in _ranks(_chat(
        server, temperature=1.0, top_k=0, top_p=1.0, max_tokens=16))]
    assert max(untruncated) > 3          # the request's own values win, and the check can fail
