"""The stored side of the Responses API, and Conversations (the engine's store: metrale.store).

    GET    /v1/responses/{id}                     a stored response
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items         ?after&limit&order (a list page)
    POST   /v1/responses/{id}/cancel              a background response still running
    POST   /v1/conversations                      {items, metadata}
    GET    /v1/conversations/{id}                 POST: {metadata} (update); DELETE
    GET    /v1/conversations/{id}/items           ?after&limit&order; POST: {items} (append)
    GET    /v1/conversations/{id}/items/{item}    DELETE: the item (answers the conversation)

Every call is one `wire.StoreRequest` to the engine, which answers writes only once they are
journalled and fsynced. With auth on, the owner is a fingerprint of the caller's API key (a
SHA-256 digest, never the key): another key's objects answer 404 like missing ones.

Chat completions take a conversation too (`conversation_id`, an extension, the operator
reference's "supports conversation_id"): the conversation's items are the context before the
request's messages, and the request's messages and the answer are appended to it.
"""
from __future__ import annotations

import hashlib

from frontends.request_plumbing import Resource, json_response
from frontends.worker import Worker, read_json
from metrale.api import errors
from metrale.api import responses_schema as rs
from metrale.api.errors import APIError
from metrale.client import EngineUnavailable, StoreRefused

MAX_CREATE_ITEMS = 20       # items a conversation may be created with (OpenAI's limit)


def owner(worker: Worker, req) -> str:
    """Whose objects a request may see: a fingerprint of its API key with auth on, else ""."""
    if not worker.settings.require_auth:
        return ""
    key = worker.api_key(req) or ""
    digest = hashlib.sha256(b"metrale-store\0" + key.encode("utf-8", "surrogatepass"))
    return "key:" + digest.hexdigest()[:32]


async def store(worker: Worker, req, op: str, **args) -> dict:
    """One store operation for this request's owner; its refusal as the API's error."""
    worker.ready()
    try:
        return await worker.client.store(op, owner(worker, req), **args)
    except StoreRefused as e:
        raise APIError(e.status, e.message, param=e.param) from None
    except EngineUnavailable as e:
        raise errors.engine_unavailable(str(e)) from None


def list_args(req) -> dict:
    """?after, ?limit (1..100, default 20), ?order (asc | desc, default desc)."""
    order = req.get_param("order") or "desc"
    if order not in ("asc", "desc"):
        raise errors.invalid(f"'order' must be asc or desc, got {order!r:.20}", "order")
    limit = req.get_param("limit")
    if limit is not None:
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise errors.invalid("'limit' must be an integer between 1 and 100", "limit")
        limit = int(limit)
    return {"after": req.get_param("after"), "limit": limit or 20, "order": order}


async def _object_body(worker: Worker, req) -> dict:
    body = await read_json(req, worker.settings)
    if not isinstance(body, dict):
        raise errors.invalid("the request body must be a JSON object")
    return body


class StoredResponse(Resource):
    async def on_get(self, req, resp, response_id):
        if req.get_param_as_bool("stream"):
            raise errors.invalid("replaying a stored response as a stream is not supported; "
                                 "GET it without stream", "stream")
        data = await store(self.worker, req, "response.get", id=response_id)
        json_response(resp, data["response"])

    async def on_delete(self, req, resp, response_id):
        json_response(resp, await store(self.worker, req, "response.delete", id=response_id))


class InputItems(Resource):
    async def on_get(self, req, resp, response_id):
        json_response(resp, await store(self.worker, req, "response.input_items",
                                        id=response_id, **list_args(req)))


class Cancel(Resource):
    async def on_post(self, req, resp, response_id):
        data = await store(self.worker, req, "response.cancel", id=response_id)
        json_response(resp, data["response"])


class Conversations(Resource):
    async def on_post(self, req, resp):
        body = await _object_body(self.worker, req)
        items = rs.parse_items(body.get("items") or [], "items")
        if len(items) > MAX_CREATE_ITEMS:
            raise errors.invalid(f"a conversation is created with at most {MAX_CREATE_ITEMS} "
                                 "items; append more with POST /v1/conversations/{id}/items",
                                 "items")
        conv = rs.conversation_object(rs.new_id("conv"), rs.parse_metadata(body.get("metadata")))
        data = await store(self.worker, req, "conversation.create", conversation=conv,
                           items=items)
        json_response(resp, data["conversation"])


class Conversation(Resource):
    async def on_get(self, req, resp, conversation_id):
        data = await store(self.worker, req, "conversation.get", id=conversation_id)
        json_response(resp, data["conversation"])

    async def on_post(self, req, resp, conversation_id):
        body = await _object_body(self.worker, req)
        if "metadata" not in body:
            raise errors.invalid("send {\"metadata\": {...}}: metadata is what a conversation "
                                 "update changes", "metadata")
        data = await store(self.worker, req, "conversation.update", id=conversation_id,
                           metadata=rs.parse_metadata(body["metadata"]))
        json_response(resp, data["conversation"])

    async def on_delete(self, req, resp, conversation_id):
        json_response(resp, await store(self.worker, req, "conversation.delete",
                                        id=conversation_id))


class ConversationItems(Resource):
    async def on_get(self, req, resp, conversation_id):
        json_response(resp, await store(self.worker, req, "conversation.items",
                                        id=conversation_id, **list_args(req)))

    async def on_post(self, req, resp, conversation_id):
        body = await _object_body(self.worker, req)
        if not isinstance(body.get("items"), list) or not body["items"]:
            raise errors.invalid("'items' is required: a non-empty array of items", "items")
        items = rs.parse_items(body["items"], "items")
        json_response(resp, await store(self.worker, req, "conversation.append",
                                        id=conversation_id, items=items))


class ConversationItem(Resource):
    async def on_get(self, req, resp, conversation_id, item_id):
        data = await store(self.worker, req, "conversation.item", id=conversation_id,
                           item_id=item_id)
        json_response(resp, data["item"])

    async def on_delete(self, req, resp, conversation_id, item_id):
        data = await store(self.worker, req, "conversation.item.delete", id=conversation_id,
                           item_id=item_id)
        json_response(resp, data["conversation"])


# ---- chat completions with a conversation ---------------------------------------------------

async def conversation_items(worker: Worker, req, conversation_id: str,
                             param: str = "conversation") -> list[dict]:
    """Every item of the conversation, oldest first (404 naming `param` when unknown)."""
    try:
        data = await store(worker, req, "conversation.items", id=conversation_id, all=True)
    except APIError as e:
        e.param = param if e.status == 404 else e.param
        raise
    return data["items"]


class ChatConversation:
    """A chat completions request's `conversation_id`: the context it prepends and the turn it
    appends once the answer is made."""

    def __init__(self, worker: Worker, req, conversation_id: str, items: list[dict]):
        self.worker, self.req, self.id, self.items = worker, req, conversation_id, items
        self.new_messages: list[dict] = []

    @classmethod
    async def of(cls, worker: Worker, req, body: dict) -> "ChatConversation | None":
        cid = body.get("conversation_id")
        if cid is None:
            return None
        if not isinstance(cid, str):
            raise errors.invalid("'conversation_id' must be a conversation id (a string)",
                                 "conversation_id")
        return cls(worker, req, cid, await conversation_items(worker, req, cid,
                                                              "conversation_id"))

    def messages(self, request_messages: list[dict]) -> list[dict]:
        self.new_messages = request_messages
        return rs.items_to_messages(self.items) + request_messages

    async def append(self, answer: dict) -> None:
        """`answer`: the assistant message of choice 0 (content, reasoning_content,
        tool_calls), appended after the request's messages."""
        items = rs.messages_to_items(self.new_messages + [{"role": "assistant", **answer}])
        await store(self.worker, self.req, "conversation.append", id=self.id, items=items)


def add_routes(app, worker: Worker) -> None:
    app.add_route("/v1/responses/{response_id}", StoredResponse(worker))
    app.add_route("/v1/responses/{response_id}/input_items", InputItems(worker))
    app.add_route("/v1/responses/{response_id}/cancel", Cancel(worker))
    app.add_route("/v1/conversations", Conversations(worker))
    app.add_route("/v1/conversations/{conversation_id}", Conversation(worker))
    app.add_route("/v1/conversations/{conversation_id}/items", ConversationItems(worker))
    app.add_route("/v1/conversations/{conversation_id}/items/{item_id}", ConversationItem(worker))
