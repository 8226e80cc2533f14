"""The OpenAI-compatible API through the official `openai` SDK, against a live `met serve` of the
real default model (SmolLM2-135M-Instruct, GGUF) with 2 frontend workers. Every error case gets
the API's error shape and a 4xx, and the server keeps serving."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import requests

from tests.assets import smollm2_gguf_path
from tests.serving import Server

MODEL = "SmolLM2-135M-Instruct"
MAX_BODY = 65536
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("api")
    with Server(["serve", str(smollm2_gguf_path()), "--model-name", MODEL, "--frontends", "2",
                 "--max-seq-len", "512", "--no-event-log"], logs / "serve.log",
                env={"METRALE_MAX_BODY_BYTES": str(MAX_BODY)}).serving(300, workers=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_streamed_equals_non_streamed_greedy(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                          temperature=0)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 6
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_async_seeded_sampling_streamed_equals_non_streamed(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x",
                                      max_retries=0, timeout=300) as aclient:
            kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0.9,
                      seed=1234)
            full = await aclient.completions.create(**kw)
            stream = await aclient.completions.create(**kw, stream=True)
            streamed = "".join([c.choices[0].text async for c in stream if c.choices])
            return full.choices[0].text, streamed
    full, streamed = asyncio.run(main())
    assert full == streamed


def test_completions_n2_logprobs_echo(client):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2,
                                    temperature=0.8, seed=7, logprobs=2, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.text.startswith(prompt)
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 3
        assert all(len(top) >= 1 for top in c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(requests.post(
        client.base_url.join("/tokenize").__str__(), json={"prompt": prompt}).json()["tokens"])


def test_completions_token_id_prompt_and_stop_string(client, server):
    ids = requests.post(server.url + "/tokenize",
                        json={"prompt": "The capital of France is"}).json()["tokens"]
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    text = full.choices[0].text
    assert text.startswith(" Paris")
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                    stop=["aris"])
    assert cut.choices[0].text == " P" and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                         stop=["aris"], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == " P"


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.token == t.top_logprobs[0].token for t in content)
    assert "".join(t.token for t in content) == out.choices[0].message.content


def test_tokenize_detokenize_round_trip(server):
    r = requests.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    back = requests.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = requests.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]


def test_health_and_metrics(server):
    assert requests.get(server.url + "/health").json()["status"] == "ok"
    text = requests.get(server.url + "/metrics").text
    assert "metrale_requests_active" in text and "metrale_requests_total" in text


# ---- errors ---------------------------------------------------------------------------------

def _error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "max_tokens": "5"}, "max_tokens"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "n": 1000}, "n"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 100000}, "max_tokens"),
    ({"messages": CHAT, "top_p": 1.5}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": CHAT, "stop": 5}, "stop"),
    ({"messages": CHAT, "stream": "yes"}, "stream"),
    ([1, 2, 3], None),
    ({"messages": CHAT, "seed": -1}, "seed"),
    ({"messages": CHAT, "seed": 2**64}, "seed"),
    ({"messages": CHAT, "seed": 1.5}, "seed"),
    ({"messages": CHAT, "seed": "7"}, "seed"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content"),
])
def test_invalid_chat_requests_get_400(server, body, param):
    _error(requests.post(server.url + "/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("seed", [-1, 2**64, 0.5])
def test_seed_out_of_range_is_400_on_completions(server, seed):
    r = requests.post(server.url + "/v1/completions",
                      json={"prompt": "Hi", "max_tokens": 1, "seed": seed})
    assert "seed" in _error(r, 400, "seed")["message"]


def _tool(parameters):
    return [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}]


@pytest.mark.parametrize("parameters, problem", [
    ({"type": "object", "properties": 5}, "5 is not of type 'object'"),
    ({"type": "object", "required": "x"}, "'x' is not of type 'array'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, "does not resolve"),
    ({"type": "object", "properties": {"a": {"type": "strang"}}}, "properties/a/type"),
])
def test_invalid_tool_schemas_get_400_naming_the_tool(server, parameters, problem):
    r = requests.post(server.url + "/v1/chat/completions",
                      json={"messages": CHAT, "tools": _tool(parameters)})
    message = _error(r, 400, "tools")["message"]
    assert "'lookup'" in message and problem in message
    # the same schema with its $ref resolving is accepted as far as the schema goes
    ok = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
          "$defs": {"A": {"type": "string"}}}
    r = requests.post(server.url + "/v1/chat/completions",
                      json={"messages": CHAT, "tools": _tool(ok), "max_tokens": 1})
    assert "invalid JSON schema" not in r.text


def test_invalid_json_and_unknown_model(server):
    r = requests.post(server.url + "/v1/chat/completions", data=b"{not json",
                      headers={"Content-Type": "application/json"})
    _error(r, 400)
    err = _error(requests.post(server.url + "/v1/chat/completions",
                               json={"model": "gpt-9", "messages": CHAT}), 404, "model")
    assert err["code"] == "model_not_found"


def test_prompt_longer_than_max_seq_len(server):
    r = requests.post(server.url + "/v1/completions",
                      json={"prompt": "hello " * 600, "max_tokens": 1})
    assert _error(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = requests.post(server.url + "/v1/completions", json={"prompt": [10**7], "max_tokens": 1})
    _error(r, 400, "prompt")


def test_body_over_the_limit_gets_413(server):
    big = {"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}
    _error(requests.post(server.url + "/v1/completions", json=big), 413)

    def chunks():   # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_BODY // 1024 + 4):
            yield b" " * 1024
    r = requests.post(server.url + "/v1/completions", data=chunks(),
                      headers={"Content-Type": "application/json"})
    _error(r, 413)


def test_unknown_route_and_wrong_method(server):
    _error(requests.get(server.url + "/v1/nothing-here"), 404)
    _error(requests.get(server.url + "/v1/chat/completions"), 405)
    _error(requests.delete(server.url + "/v1/models"), 405)


def test_sdk_raises_typed_errors_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True,
                                       n=0)
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert out.usage.completion_tokens == 1
    assert httpx.get(str(client.base_url) + "models").status_code == 200
