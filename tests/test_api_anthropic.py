"""The Anthropic Messages API through the official `anthropic` SDK, against a live `met serve`
of the scripted test model (tests.scripted_model) with --tool-call-parser hermes and
--require-auth (the SDK sends its key as x-api-key). Streamed and non-streamed messages agree
block for block; the raw stream follows Anthropic's event order; errors have Anthropic's shape.
The last test kills the engine: /v1/messages then answers 529 overloaded_error."""
from __future__ import annotations

import time

import anthropic
import pytest
import requests

from metrale.api import anthropic_schema
from tests.scripted_model import SERVE_ENV, make_scripted_model
from tests.serving import Server, free_port
from tests.test_tool_calling import SCRIPTS

MODEL = "scripted"
KEY = "sk-test-anthropic"
WEATHER = {"name": "get_weather", "description": "current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "input_schema": {"type": "object",
                                             "properties": {"zone": {"type": "string"}}}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    path = make_scripted_model(root / "model", SCRIPTS)
    with Server(["serve", path, "--model-name", MODEL, "--frontends", "1", "--max-seq-len",
                 "2048", "--no-event-log", "--tool-call-parser", "hermes", "--require-auth",
                 "--auth-token", KEY], root / "serve.log", env=SERVE_ENV).serving(180) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _user(text):
    return [{"role": "user", "content": text}]


def _both(client, **kw):
    """The non-streamed message, checked against the streamed one and the raw event order."""
    kw = {"model": MODEL, "max_tokens": 300, **kw}
    full = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    body = {k: v for k, v in kw.items() if k != "extra_body"} | kw.get("extra_body", {})
    r = requests.post(str(client.base_url).rstrip("/") + "/v1/messages", json=body | {
        "stream": True}, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert r.headers["content-type"].startswith("text/event-stream")
    _check_order([line[7:] for line in r.text.splitlines() if line.startswith("event: ")])
    assert _blocks(streamed) == _blocks(full)
    assert (streamed.stop_reason, streamed.stop_sequence) == (full.stop_reason, full.stop_sequence)
    assert streamed.usage.output_tokens == full.usage.output_tokens
    return full


def _blocks(msg):
    out = []
    for b in msg.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_")
            out.append(("tool_use", b.name, b.input))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking))
        else:
            out.append((b.type, b.text))
    return out


def _check_order(types):
    assert types[:2] == ["message_start", "ping"]
    assert types[-2:] == ["message_delta", "message_stop"]
    body = types[2:-2]
    i = 0
    while i < len(body):
        assert body[i] == "content_block_start", types
        i += 1
        while body[i] == "content_block_delta":
            i += 1
        assert body[i] == "content_block_stop", types
        i += 1


def test_text_message_and_usage(client):
    msg = _both(client, messages=_user("say hi"), system="You are terse.")
    assert _blocks(msg) == [("text", "Hello there!")]
    assert msg.stop_reason == "end_turn" and msg.model == MODEL and msg.role == "assistant"
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    msg = _both(client, messages=_user("say hi"),
                system=[{"type": "text", "text": "You are terse.",
                         "cache_control": {"type": "ephemeral"}}],
                metadata={"user_id": "u1"},   # this SDK no longer types the samplers
                extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert _blocks(msg) == [("text", "Hello there!")]


def test_tool_use_blocks(client):
    msg = _both(client, messages=_user("weather in Paris?"), tools=TOOLS)
    assert msg.stop_reason == "tool_use"
    assert _blocks(msg) == [("tool_use", "get_weather", {"city": "Paris", "days": 3})]
    msg = _both(client, messages=_user("two cities"), tools=TOOLS)
    assert _blocks(msg) == [("text", "Checking both."),
                            ("tool_use", "get_weather", {"city": "Paris"}),
                            ("tool_use", "get_weather", {"city": "Tokyo"})]
    msg = _both(client, messages=_user("two cities"), tools=TOOLS,
                tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b[0] for b in _blocks(msg)] == ["text", "tool_use"]


def test_tool_choice_any_tool_none(client):
    msg = _both(client, messages=_user("weather in Paris?"), tools=TOOLS,
                tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use"
    msg = _both(client, messages=_user("what time"), tools=TOOLS,
                tool_choice={"type": "tool", "name": "get_time"})
    assert _blocks(msg) == [("tool_use", "get_time", {"zone": "UTC"})]
    msg = _both(client, messages=_user("say hi"), tools=TOOLS, tool_choice={"type": "none"})
    assert _blocks(msg) == [("text", "Hello there!")]


def test_thinking_blocks_and_budget(client):
    msg = _both(client, messages=_user("think then call"), tools=TOOLS)
    assert _blocks(msg) == [("thinking", "I should call the tool."),
                            ("tool_use", "get_weather", {"city": "Oslo"})]
    # the signature holds the thinking: sent back with the text omitted, it is restored
    signature = msg.content[0].signature
    assert signature and anthropic_schema.thinking_from_signature(signature) == \
        "I should call the tool."
    msg = _both(client, messages=_user("ponder first"), tools=TOOLS)
    assert msg.stop_reason == "end_turn" and _blocks(msg)[-1] == ("text", "It is sunny.")
    # enabled thinking: the template opens <think> in the prompt; the budget closes it
    msg = _both(client, messages=_user("think long"),
                thinking={"type": "enabled", "budget_tokens": 8})
    assert _blocks(msg) == [("thinking", "hmm hmm"), ("text", "Done.")]


def test_stop_sequence_and_max_tokens(client):
    msg = _both(client, messages=_user("tell a story"), stop_sequences=["THE END", "zzz"])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "THE END")
    assert _blocks(msg) == [("text", "Once upon a time there was a parser. ")]
    msg = _both(client, messages=_user("tell a story"), max_tokens=4)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4


def test_multi_turn_with_tool_results(client):
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "call it", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "21C"}]},
            {"type": "text", "text": "say hi"}]},
    ]
    msg = _both(client, messages=history, tools=TOOLS)
    assert _blocks(msg) == [("text", "Hello there!")]
    count = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert count.input_tokens > msg.usage.input_tokens - 5 > 0


def _bad(client, **kw):
    kw = {"model": MODEL, "max_tokens": 10, "messages": _user("say hi"), **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**kw)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    return e.value.body["error"]["message"]


def test_errors_have_anthropic_shape(client, server):
    r = requests.post(server.url + "/v1/messages", headers={"x-api-key": KEY,
                      "anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "messages": _user("hi")})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: field required"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    assert "text only" in _bad(client, messages=[{"role": "user", "content": [image]}])
    assert "tool_use_id" in _bad(client, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert "input_schema" in _bad(client, tools=[{"name": "f"}])
    assert "name" in _bad(client, tools=[{"name": "bad name!", "input_schema": {}}])
    assert "input_schema" in _bad(client, tools=[{"name": "f", "input_schema":
                                                  {"type": "array"}}])
    assert "not supported" in _bad(client, tools=[{"type": "web_search_20250305",
                                                   "name": "web_search"}])
    assert "tool_choice" in _bad(client, tool_choice={"type": "any"})
    assert "budget_tokens" in _bad(client, thinking={"type": "enabled", "budget_tokens": 50})
    # auth: a wrong x-api-key is a 401 authentication_error, on these paths in this shape
    bad_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model=MODEL, max_tokens=5, messages=_user("say hi"))
    assert e.value.body["error"]["type"] == "authentication_error"
    # the OpenAI paths keep the OpenAI shape
    r = requests.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "type" in r.json()["error"] and "type" not in r.json()


def test_engine_unavailable_is_overloaded(tmp_path):
    """A frontend whose engine is not there answers /v1/messages with 529 overloaded_error
    (the SDK's OverloadedError, which it retries), the OpenAI paths with 503."""
    srv = Server(["frontend", "--engine", f"tcp://127.0.0.1:{free_port(4)}", "--frontends", "1"],
                 tmp_path / "frontend.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(srv.url + "/health", timeout=10).status_code == 503:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.3)
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.OverloadedError) as e:
            client.messages.create(model=MODEL, max_tokens=5, messages=_user("say hi"))
        assert e.value.status_code == 529
        assert e.value.body["error"]["type"] == "overloaded_error"
        assert requests.post(srv.url + "/v1/chat/completions", json={}).status_code == 503
    finally:
        srv.stop()


def test_unknown_model_is_not_found(client, server):
    for call in (lambda: client.messages.create(model="claude-haiku-4-5", max_tokens=5,
                                                messages=_user("say hi")),
                 lambda: client.messages.count_tokens(model="claude-haiku-4-5",
                                                      messages=_user("say hi"))):
        with pytest.raises(anthropic.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "not_found_error"
        assert "claude-haiku-4-5" in e.value.body["error"]["message"]


def _post(server, body, path="/v1/messages?beta=true"):
    return requests.post(server.url + path, json=body, timeout=120, headers={
        "x-api-key": KEY, "anthropic-version": "2023-06-01"})


CLAUDE_CODE_FIELDS = {
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": '{"device_id": "d1", "session_id": "s1"}'},
}


def test_current_api_fields_as_claude_code_sends_them(server):
    """What Claude Code 2.1.x posts: system turns inside messages, adaptive thinking with the
    text omitted, context_management, output_config, deferred tools with $schema."""
    tools = [dict(WEATHER, input_schema={
        "$schema": "https://json-schema.org/draft/2020-12/schema", **WEATHER["input_schema"]},
        cache_control={"type": "ephemeral"}),
        {"name": "Deferred", "input_schema": {"type": "object", "properties": {}},
         "defer_loading": True}]
    body = {"model": MODEL, "max_tokens": 300, "tools": tools, **CLAUDE_CODE_FIELDS,
            "system": [{"type": "text", "text": "You are an agent."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "think then call"}]},
                         {"role": "system", "content": [
                             {"type": "text", "text": "# Environment", "cache_control":
                              {"type": "ephemeral"}}]}]}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    thinking, call = r.json()["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == ""   # display: omitted
    assert anthropic_schema.thinking_from_signature(thinking["signature"]) == \
        "I should call the tool."
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "get_weather",
                                                           {"city": "Oslo"})
    streamed = _post(server, body | {"stream": True}).text
    assert '"signature_delta"' in streamed and '"thinking_delta"' not in streamed
    # the omitted thinking comes back from its signature when the turn is replayed
    replay = body | {"messages": body["messages"] + [
        {"role": "assistant", "content": [thinking, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                      "content": "21C"}]}]}
    count = _post(server, replay, "/v1/messages/count_tokens").json()["input_tokens"]
    forged = dict(thinking, signature="not-ours")
    replay["messages"][2] = {"role": "assistant", "content": [forged, call]}
    without = _post(server, replay, "/v1/messages/count_tokens").json()["input_tokens"]
    assert count - without >= len("I should call the tool.")


def test_system_turn_inside_messages_reaches_the_prompt(server):
    base = {"model": MODEL, "messages": _user("say hi")}
    plain = _post(server, base, "/v1/messages/count_tokens").json()["input_tokens"]
    turn = {"role": "system", "content": "Mind the gap."}
    with_turn = _post(server, base | {"messages": _user("say hi") + [turn]},
                      "/v1/messages/count_tokens").json()["input_tokens"]
    assert with_turn - plain >= len("Mind the gap.")
    r = _post(server, base | {"max_tokens": 5, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, turn]})
    assert r.status_code == 400 and "must follow a user turn" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, message", [
    ({"frobnicate": 1}, "frobnicate: Extra inputs are not permitted"),
    ({"seed": 1}, "seed: Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]},
     "messages.0.name: Extra inputs are not permitted"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 5}},
     "thinking.adaptive.budget_tokens: Extra inputs are not permitted"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking.display"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "xml", "schema": {}}}}, "output_config.format"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text: field required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text: field required (a string), got integer"),
    ({"system": [{"type": "text"}]}, "system.0.text: field required"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 5}}]},
     "tool 'f' has an invalid JSON schema: 5 is not of type 'object'"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "required": "x"}}]},
     "tool 'f' has an invalid JSON schema: 'x' is not of type 'array'"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}]}, "'#/$defs/missing' does not resolve"),
])
def test_invalid_fields_are_400_as_anthropic_answers(server, extra, message):
    r = _post(server, {"model": MODEL, "max_tokens": 5, "messages": _user("say hi")} | extra)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert message in err["error"]["message"]
