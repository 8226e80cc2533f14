"""/v1/conversations end to end with the official OpenAI SDK against a real `met serve` of the
scripted model: create / retrieve / update / delete, items list / create / retrieve / delete,
a conversation as the context of /v1/responses (`conversation`) and of chat completions
(`conversation_id`, the operator reference's extension), each turn appended; API-key scoping
(another key gets 404); errors in OpenAI's shape."""
from __future__ import annotations

import openai
import pytest
import requests

from tests.scripted_model import SERVE_ENV, make_scripted_model
from tests.serving import Server, metric

MODEL = "scripted"
KEYS = ("key-alice", "key-bob")
SCRIPTS = [
    {"when": "say hello", "reply": "Hello there, friend."},
    {"when": "remember zork", "reply": "ok"},
    {"when": "ok<|im_end|>", "reply": "your word was zork"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("conversations")
    make_scripted_model(root / "model", SCRIPTS)
    args = ["serve", str(root / "model"), "--model-name", MODEL, "--frontends", "1",
            "--max-seq-len", "4096", "--metrics-public"]
    for key in KEYS:
        args += ["--auth-token", key]
    with Server(args, root / "serve.log", env=SERVE_ENV).serving(180) as srv:
        yield srv


def _client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_conversation_crud_and_items(server):
    client = _client(server)
    conv = client.conversations.create(metadata={"topic": "demo"}, items=[
        {"type": "message", "role": "user", "content": "first"},
        {"type": "message", "role": "assistant", "content": "second"}])
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "demo"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    updated = client.conversations.update(conv.id, metadata={"topic": "changed"})
    assert updated.metadata == {"topic": "changed"}
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "third"}]}])
    assert [i.content[0].text for i in added.data] == ["third"]
    items = client.conversations.items.list(conv.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["first", "second", "third"]
    assert items.first_id == items.data[0].id and items.last_id == items.data[-1].id
    page = client.conversations.items.list(conv.id, limit=1)      # newest first by default
    assert page.data[0].content[0].text == "third" and page.has_more
    one = client.conversations.items.retrieve(items.data[1].id, conversation_id=conv.id)
    assert one.content[0].text == "second" and one.role == "assistant"
    after = client.conversations.items.delete(items.data[1].id, conversation_id=conv.id)
    assert after.id == conv.id
    assert [i.content[0].text for i in client.conversations.items.list(
        conv.id, order="asc").data] == ["first", "third"]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(items.data[1].id, conversation_id=conv.id)
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted is True and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_a_conversation_is_the_context_of_responses(server):
    client = _client(server)
    conv = client.conversations.create()
    first = client.responses.create(model=MODEL, input="remember zork", conversation=conv.id)
    assert first.output_text == "ok" and first.conversation.id == conv.id
    second = client.responses.create(model=MODEL, input="recall", conversation={"id": conv.id})
    assert second.output_text == "your word was zork"
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant")] * 2
    assert items[1].id == first.output[0].id and items[3].id == second.output[0].id
    assert items[3].content[0].text == "your word was zork"


def test_chat_completions_with_conversation_id(server):
    client = _client(server)
    conv = client.conversations.create()
    out = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "remember zork"}], extra_body={"conversation_id": conv.id})
    assert out.choices[0].message.content == "ok"
    stream = client.chat.completions.create(model=MODEL, stream=True, messages=[
        {"role": "user", "content": "recall"}], extra_body={"conversation_id": conv.id})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "your word was zork"
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.content[0].text for i in items] == ["remember zork", "ok", "recall",
                                                 "your word was zork"]
    r = requests.post(server.url + "/v1/chat/completions", headers={
        "Authorization": f"Bearer {KEYS[0]}"}, json={
        "messages": [{"role": "user", "content": "x"}], "conversation_id": "conv_nope"},
        timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "conversation_id"


def test_objects_are_scoped_to_the_key_that_made_them(server):
    alice, bob = _client(server, KEYS[0]), _client(server, KEYS[1])
    conv = alice.conversations.create(items=[{"type": "message", "role": "user",
                                              "content": "secret"}])
    resp = alice.responses.create(model=MODEL, input="say hello")
    for call in (lambda: bob.conversations.retrieve(conv.id),
                 lambda: bob.conversations.items.list(conv.id),
                 lambda: bob.conversations.delete(conv.id),
                 lambda: bob.conversations.update(conv.id, metadata={"a": "b"}),
                 lambda: bob.responses.retrieve(resp.id),
                 lambda: bob.responses.input_items.list(resp.id),
                 lambda: bob.responses.delete(resp.id),
                 lambda: bob.responses.create(model=MODEL, input="x",
                                              previous_response_id=resp.id),
                 lambda: bob.responses.create(model=MODEL, input="x", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.conversations.retrieve(conv.id).id == conv.id
    assert alice.responses.retrieve(resp.id).output_text == "Hello there, friend."
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).conversations.retrieve(conv.id)
    assert metric(server.url, "metrale_stored_conversations") >= 1


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/conversations", {"metadata": {"k": 1}}, 400, "metadata"),
    ("POST", "/v1/conversations", {"items": [{"type": "nope"}]}, 400, "items[0]"),
    ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, 400,
     "items"),
    ("GET", "/v1/conversations/conv_nope", None, 404, "id"),
    ("POST", "/v1/conversations/conv_nope/items", {"items": [{"role": "user",
                                                              "content": "x"}]}, 404, "id"),
    ("GET", "/v1/conversations/conv_nope/items?limit=500", None, 400, "limit"),
])
def test_conversation_errors(server, method, path, body, status, param):
    r = requests.request(method, server.url + path, json=body, timeout=30,
                         headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
