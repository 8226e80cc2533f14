"""/v1/responses end to end through a real `met serve` of the scripted model (it answers a
fixed reply per prompt, so tool calls and reasoning are driven), with the official OpenAI SDK:
create, stream (events reassembled equal the final object), retrieve, delete, input_items,
previous_response_id chains (the engine's prompt holds the earlier turn), tools (function and
custom), reasoning items, max_output_tokens -> incomplete, truncation, background + cancel,
and errors in OpenAI's shape."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import requests

from tests.scripted_model import SERVE_ENV, make_scripted_model
from tests.serving import Server, metric

MODEL = "scripted"
WEATHER_ARGS = {"city": "Paris"}
SCRIPTS = [
    {"when": "say hello", "reply": "Hello there, friend."},
    {"when": "think first", "reply": "<think>\nLet me weigh it.\n</think>\n\nForty-two."},
    {"when": "weather in Paris", "reply": "<think>\nI need the tool.\n</think>\n\n<tool_call>\n"
     + json.dumps({"name": "get_weather", "arguments": WEATHER_ARGS}) + "\n</tool_call>"},
    {"when": "<tool_response>\nsunny", "reply": "It is sunny in Paris."},
    {"when": "run the shell", "reply": "<tool_call>\n" + json.dumps(
        {"name": "shell", "arguments": {"input": "ls -la /tmp"}}) + "\n</tool_call>"},
    {"when": "remember zork", "reply": "ok"},
    # only fires when the first turn's answer is in the prompt: the chain carried it
    {"when": "ok<|im_end|>", "reply": "your word was zork"},
    {"when": "Let me weigh it.\n</think>", "reply": "I remember my reasoning."},
    {"when": "count to many", "reply": "one two three four five six seven eight nine ten " * 8},
]
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    make_scripted_model(root / "model", SCRIPTS)
    with Server(["serve", str(root / "model"), "--model-name", MODEL, "--frontends", "2",
                 "--max-seq-len", "4096", "--tool-call-parser", "hermes"],
                root / "serve.log", env=SERVE_ENV).serving(180, workers=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_create_retrieve_input_items_delete(client, server):
    r = client.responses.create(model=MODEL, instructions="be brief", metadata={"k": "v"},
                                input=[{"role": "developer", "content": "and kind"},
                                       {"role": "user", "content": "say hello"}])
    assert r.status == "completed" and r.object == "response"
    assert r.output_text == "Hello there, friend."
    [msg] = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.status == "completed"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.metadata == {"k": "v"} and r.instructions == "be brief" and r.store is True
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message", "message"]     # newest first
    assert items.data[0].content[0].text == "say hello" and items.data[1].role == "developer"
    assert items.first_id == items.data[0].id and items.has_more is False
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["type"] == "not_found_error" and r.id in e.value.body["message"]


def test_store_false_is_not_retrievable(client):
    r = client.responses.create(model=MODEL, input="say hello", store=False)
    assert r.output_text == "Hello there, friend." and r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def _reassemble(events) -> dict:
    """The output items as the stream built them, keyed by id."""
    items, texts, args = {}, {}, {}
    for e in events:
        if e.type == "response.output_item.done":
            items[e.item.id] = e.item
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    return {"items": items, "texts": texts, "args": args}


def test_stream_with_reasoning_and_a_function_call_equals_the_final_object(client):
    events = list(client.responses.create(model=MODEL, input="what is the weather in Paris?",
                                          tools=TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.content_part.done", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in types, kind
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    reasoning, call = final.output
    built = _reassemble(events)
    assert set(built["items"]) == {reasoning.id, call.id}
    assert built["texts"][reasoning.id] == reasoning.content[0].text == "I need the tool."
    assert json.loads(built["args"][call.id]) == json.loads(call.arguments) == WEATHER_ARGS
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert built["items"][call.id].model_dump() == call.model_dump()
    stored = client.responses.retrieve(final.id)
    assert stored.model_dump() == final.model_dump()

    # the tool result goes back as a function_call_output on the chain
    follow = client.responses.create(model=MODEL, previous_response_id=final.id, tools=TOOLS,
                                     input=[{"type": "function_call_output",
                                             "call_id": call.call_id, "output": "sunny"}])
    assert follow.output_text == "It is sunny in Paris."
    assert follow.previous_response_id == final.id


def test_stream_helper_text_deltas_and_final(client):
    with client.responses.stream(model=MODEL, input="think first") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Forty-two."
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens > 0


def test_previous_response_id_carries_the_earlier_turn(client):
    first = client.responses.create(model=MODEL, input="remember zork")
    assert first.output_text == "ok"
    second = client.responses.create(model=MODEL, input="recall", previous_response_id=first.id)
    assert second.output_text == "your word was zork"
    alone = client.responses.create(model=MODEL, input="recall")
    assert alone.output_text == ""                # without the chain: no script fires


def test_custom_tool_call(client):
    r = client.responses.create(model=MODEL, input="run the shell", tool_choice="auto",
                                tools=[{"type": "custom", "name": "shell",
                                        "description": "runs a command"}])
    [call] = r.output
    assert call.type == "custom_tool_call" and call.input == "ls -la /tmp"
    assert call.name == "shell"


def test_max_output_tokens_is_incomplete_with_the_reason(client):
    events = list(client.responses.create(model=MODEL, input="count to many",
                                          max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 5 and final.output[0].status == "incomplete"
    r = client.responses.create(model=MODEL, input="count to many", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_truncation(client, server):
    long = [{"role": "user", "content": "filler " * 700}, {"role": "assistant", "content": "x"}] * 2
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=long + [{"role": "user",
                                                             "content": "say hello"}])
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(model=MODEL, truncation="auto",
                                input=long + [{"role": "user", "content": "say hello"}])
    assert r.output_text == "Hello there, friend." and r.truncation == "auto"


def test_background_and_cancel(client, server):
    r = client.responses.create(model=MODEL, input="count to many", background=True)
    assert r.status == "queued" and r.background is True
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert got.status == "completed" and got.output_text.startswith("one two")
    # a long one, cancelled through the other worker
    slow = client.responses.create(model=MODEL, input="count to many", background=True,
                                   extra_body={"ignore_eos": True}, max_output_tokens=3000)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    time.sleep(1.0)
    assert client.responses.retrieve(slow.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model=MODEL, input="say hello").id)
    assert metric(server.url, "metrale_requests_active") == 0


@pytest.mark.parametrize("body, param", [
    ({"input": 3}, "input"),
    ({"input": [{"type": "bogus"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "include": ["everything"]}, "include"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": ["high"]}}, "reasoning.effort"),
    ({"input": [{"type": "reasoning", "encrypted_content": "bm90IG91cnM="}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
    ({"input": "x", "conversation": ["c"]}, "conversation"),
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"},
     "previous_response_id"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": []}, "input"),
])
def test_bad_requests_are_400_in_openai_shape(server, body, param):
    r = requests.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_unknown_ids_are_404(server):
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items"),
                         ("POST", "/v1/responses/resp_nope/cancel")):
        r = requests.request(method, server.url + path, timeout=30)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "not_found_error"
    r = requests.post(server.url + "/v1/responses", json={
        "model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_input_items_pagination(client):
    r = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": f"item {i}"} for i in range(5)] + [
        {"role": "user", "content": "say hello"}])
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["item 0", "item 1"] and page.has_more
    rest = client.responses.input_items.list(r.id, limit=10, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data][-1] == "say hello" and not rest.has_more
    desc = client.responses.input_items.list(r.id)
    assert desc.data[0].content[0].text == "say hello"
    all_ids = [i.id for i in client.responses.input_items.list(r.id, order="asc").data]
    assert len(all_ids) == 6 and len(set(all_ids)) == 6


def test_text_format_json_schema_is_accepted_and_echoed(client):
    fmt = {"type": "json_schema", "name": "greeting", "strict": True,
           "schema": {"type": "object", "properties": {"g": {"type": "string"}}}}
    r = client.responses.create(model=MODEL, input="say hello", text={"format": fmt})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert r.text.format.name == "greeting"


def test_stored_counts_on_metrics(client, server):
    before = metric(server.url, "metrale_stored_responses")
    client.responses.create(model=MODEL, input="say hello")
    assert metric(server.url, "metrale_stored_responses") == before + 1
    with httpx.Client(timeout=30) as http:
        text = http.get(server.url + "/metrics").text
    assert "metrale_stored_conversations" in text


def test_background_stream_follows_the_run_and_the_result_is_stored(client):
    events = list(client.responses.create(model=MODEL, input="say hello", background=True,
                                          stream=True))
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert final.background is True and final.output_text == "Hello there, friend."
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_output_text_logprobs_on_request(client):
    r = client.responses.create(model=MODEL, input="say hello", top_logprobs=2,
                                include=["message.output_text.logprobs"])
    part = r.output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = list(client.responses.create(model=MODEL, input="say hello", stream=True,
                                          include=["message.output_text.logprobs"]))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in deltas] == [lp.token for lp in done.logprobs] != []


def test_stateless_reasoning_round_trip_with_encrypted_content(client):
    first = client.responses.create(model=MODEL, input="think first", store=False,
                                    include=["reasoning.encrypted_content"])
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    # the client sends the output back (content dropped: only the opaque copy), and the model
    # sees its earlier reasoning in the prompt
    back = [{"type": "reasoning", "id": reasoning.id, "summary": [],
             "encrypted_content": reasoning.encrypted_content},
            {"type": "message", "role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and now?"}]
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": "think first"},
                                                         *back], store=False)
    assert second.output_text == "I remember my reasoning."
