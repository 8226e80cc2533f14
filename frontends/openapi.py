"""GET /openapi.json: an OpenAPI 3.1 description of every route this server answers.

Hand-written, but its limits come from the modules that enforce them (the validators'
field lists and bounds in metrale.api.openai_schema, the sampling ranges in metrale.sampling,
the served model's max_seq_len, METRALE_MAX_MESSAGES), so the description and the checks stay
in step. It reflects the running server: the served model's name and context length, and
security requirements only when --require-auth is on. Under --require-auth it needs a key like
every route but /health (`--require-auth`'s help): it names the served model and its context.

    spec(model="m", max_seq_len=4096, require_auth=True, metrics_public=False) -> dict
"""
from __future__ import annotations

import falcon
import orjson

from metrale import __version__
from metrale.api import openai_schema as oai
from metrale.sampling import FLOAT_RULES, INT_RULES

JSON = "application/json"
INT64 = {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _rule(rule, integer: bool) -> dict:
    """A metrale.sampling range rule as JSON Schema."""
    out = {"type": "integer" if integer else "number"}
    if rule.low is not None:
        out["exclusiveMinimum" if rule.low_open else "minimum"] = rule.low
    if rule.high is not None:
        out["exclusiveMaximum" if rule.high_open else "maximum"] = rule.high
    if rule.note:
        out["description"] = rule.note
    return out


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _sampling(max_seq_len: int | None) -> dict:
    """The sampling and stopping fields both OpenAI generation routes read."""
    props = {name: _nullable(_rule(FLOAT_RULES[name], False)) for name in oai.NUMBER_FIELDS
             if name in FLOAT_RULES}
    for name in oai.INT_FIELDS:
        props[name] = _nullable(_rule(INT_RULES[name], True) if name in INT_RULES else INT64)
    max_tokens = {"type": "integer", "minimum": 1}
    if max_seq_len:
        max_tokens["maximum"] = max_seq_len
        max_tokens["description"] = ("prompt tokens + max_tokens must not exceed the model's "
                                     f"context length ({max_seq_len})")
    props.update({
        "model": {"type": "string", "description": "the served model (GET /v1/models)"},
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": oai.MAX_N}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": {"type": "boolean"}}, "description": "only with stream: true"}),
        "max_tokens": _nullable(max_tokens),
        "max_completion_tokens": _nullable(max_tokens),
        "stop": _nullable({"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1},
             "maxItems": oai.MAX_STOP_STRINGS}]}),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer",
                                                                "minimum": 0}}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "user": _nullable({"type": "string"}),
    })
    return props


def _chat_request(max_seq_len, max_messages) -> dict:
    part = {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "description": "text (images and audio are not served)"},
        "text": {"type": "string"}}}
    tool_call = {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(oai.CHAT_ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part},
                              {"type": "null"}],
                    "description": "required except for assistant messages with tool_calls"},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": tool_call},
        "tool_call_id": {"type": "string"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"},
            "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}
    props = _sampling(max_seq_len)
    props.update({
        "messages": {"type": "array", "items": message, "minItems": 1,
                     "maxItems": max_messages},
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0,
                                   "maximum": oai.MAX_TOP_LOGPROBS,
                                   "description": "needs logprobs: true"}),
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string"}}}}}]}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "chat_template_kwargs": _nullable({"type": "object"}),
        "add_generation_prompt": _nullable({"type": "boolean"}),
        "continue_final_message": _nullable({"type": "boolean"}),
        "max_thinking_tokens": _nullable({"type": "integer", "minimum": 0}),
    })
    return {"type": "object", "required": ["messages"], "properties": props}


def _completion_request(max_seq_len) -> dict:
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    props = _sampling(max_seq_len)
    props.update({
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                                  "minItems": 1},
                             ids, {"type": "array", "items": ids, "minItems": 1}]},
        "logprobs": _nullable({"type": "integer", "minimum": 0,
                               "maximum": oai.MAX_TOP_LOGPROBS}),
        "echo": _nullable({"type": "boolean"}),
        "suffix": _nullable({"type": "string", "description": "not supported: must be empty"}),
        "best_of": _nullable({"type": "integer", "description": "must equal n"}),
    })
    return {"type": "object", "required": ["prompt"], "properties": props}


def _anthropic_schemas(max_seq_len, max_messages) -> dict:
    text = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}}
    block = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking"]},
        "text": {"type": "string"}, "id": {"type": "string"}, "name": {"type": "string"},
        "input": {"type": "object"}, "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text}]},
        "is_error": {"type": "boolean"}, "thinking": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": block}]}}}
    tool = {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"},
        "input_schema": {"type": "object"}}}
    common = {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": message, "minItems": 1,
                     "maxItems": max_messages},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": text}]},
        "tools": {"type": "array", "items": tool},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}}},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "disabled"]},
            "budget_tokens": {"type": "integer", "minimum": 0}}},
    }
    max_tokens = {"type": "integer", "minimum": 1}
    if max_seq_len:
        max_tokens["maximum"] = max_seq_len
    messages = {"type": "object", "required": ["model", "messages", "max_tokens"],
                "properties": {**common, "max_tokens": max_tokens,
                               "stop_sequences": {"type": "array",
                                                  "items": {"type": "string", "minLength": 1},
                                                  "maxItems": oai.MAX_STOP_STRINGS},
                               "stream": {"type": "boolean"},
                               "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                               "top_p": {"type": "number", "exclusiveMinimum": 0,
                                         "maximum": 1},
                               "top_k": {"type": "integer", "minimum": 0},
                               "metadata": {"type": "object", "properties": {
                                   "user_id": {"type": "string"}}}}}
    count = {"type": "object", "required": ["model", "messages"], "properties": common}
    response = {"type": "object", "required": ["id", "type", "role", "content", "model",
                                               "stop_reason", "usage"], "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object"}},
        "model": {"type": "string"},
        "stop_reason": {"anyOf": [{"enum": ["end_turn", "max_tokens", "stop_sequence",
                                            "tool_use"]}, {"type": "null"}]},
        "stop_sequence": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "usage": {"type": "object", "properties": {
            "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}}}
    return {"AnthropicMessagesRequest": messages, "AnthropicCountTokensRequest": count,
            "AnthropicMessage": response,
            "AnthropicTokenCount": {"type": "object", "required": ["input_tokens"],
                                    "properties": {"input_tokens": {"type": "integer"}}},
            "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
                "type": {"const": "error"},
                "error": {"type": "object", "required": ["type", "message"], "properties": {
                    "type": {"type": "string"}, "message": {"type": "string"}}}}}}


def _response_schemas() -> dict:
    usage = {"type": "object", "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object"}}}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
        "Usage": usage,
        "ChatCompletion": {"type": "object", "required": ["id", "object", "choices"],
                           "properties": {"id": {"type": "string"},
                                          "object": {"const": "chat.completion"},
                                          "created": {"type": "integer"},
                                          "model": {"type": "string"},
                                          "choices": {"type": "array"}, "usage": usage}},
        "Completion": {"type": "object", "required": ["id", "object", "choices"],
                       "properties": {"id": {"type": "string"},
                                      "object": {"const": "text_completion"},
                                      "created": {"type": "integer"},
                                      "model": {"type": "string"},
                                      "choices": {"type": "array"}, "usage": usage}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id"], "properties": {
                    "id": {"type": "string"}, "max_model_len": {"type": "integer"}}}}}},
    }


def _responses(ok: dict | None, error: str = "Error", ok_type: str = JSON) -> dict:
    out = {}
    if ok is not None:
        out["200"] = {"description": "success", "content": {ok_type: {"schema": ok}}}
    described = {"400": "the request is invalid", "401": "missing or invalid API key",
                 "404": "no such model", "408": "the request did not arrive in time",
                 "413": "the body is too large", "429": "rate limited (see Retry-After)",
                 "431": "the headers are too large",
                 "503": "the engine is loading or gone (retriable)"}
    for status, text in described.items():
        out[status] = {"description": text, "content": {JSON: {"schema": _ref(error)}}}
    return out


def _post(summary: str, request: str, ok: dict, error: str = "Error", sse: bool = False) -> dict:
    responses = _responses(ok, error)
    if sse:
        responses["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    return {"summary": summary, "requestBody": {"required": True, "content": {
        JSON: {"schema": _ref(request)}}}, "responses": responses}


def _load_model(gated: list) -> dict:
    """POST /v1/models/load (frontends.library): a hot swap."""
    op = _post("swap the served model (a recipe, or an HF id / path with the server's flags); "
               "an admin key (--admin-token) when auth is on", "LoadModelRequest",
               {"type": "object"})
    op["responses"].update({
        "202": {"description": "accepted (wait: false), or still loading at the timeout",
                "content": {JSON: {"schema": {"type": "object"}}}},
        "403": {"description": "the key is not an admin key",
                "content": {JSON: {"schema": _ref("Error")}}},
        "409": {"description": "a swap is already under way",
                "content": {JSON: {"schema": _ref("Error")}}},
        "422": {"description": "the load failed; the previous model was restored",
                "content": {JSON: {"schema": {"type": "object"}}}}})
    return {**op, "security": gated}


LOAD_MODEL_REQUEST = {"type": "object", "properties": {
    "recipe": {"type": "string", "minLength": 1}, "model": {"type": "string", "minLength": 1},
    "wait": {"type": "boolean"}, "timeout": {"type": "number", "exclusiveMinimum": 0,
                                             "maximum": 3600}},
    "additionalProperties": False, "description": "exactly one of recipe or model"}
def _responses_paths(gated: list, max_seq_len: int | None) -> dict:
    """/v1/responses and /v1/conversations (frontends.responses, frontends.responses_store):
    the fields the server reads; the OpenAI API reference has the full shapes."""
    obj = {"type": "object"}
    text_or_items = {"anyOf": [{"type": "string"}, {"type": "array", "items": obj}]}
    create = {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"}, "input": text_or_items, "instructions": {"type": "string"},
        "tools": {"type": "array", "items": obj}, "stream": {"type": "boolean"},
        "max_output_tokens": {"type": "integer", "minimum": 1,
                              **({"maximum": max_seq_len} if max_seq_len else {})},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "store": {"type": "boolean"}, "background": {"type": "boolean"},
        "previous_response_id": {"type": "string"}, "conversation": {"type": "string"},
        "truncation": {"enum": ["auto", "disabled"]}, "metadata": obj,
        "reasoning": obj, "text": obj, "include": {"type": "array",
                                                    "items": {"type": "string"}}}}
    items = {"type": "object", "properties": {"items": {"type": "array", "items": obj},
                                              "metadata": obj}}

    def op(summary, body=None):
        out = {"summary": summary, "security": gated, "responses": _responses(obj)}
        if body is not None:
            out["requestBody"] = {"required": True, "content": {JSON: {"schema": body}}}
        return out

    rid = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    cid = [{"name": "conversation_id", "in": "path", "required": True,
            "schema": {"type": "string"}}]
    iid = cid + [{"name": "item_id", "in": "path", "required": True,
                  "schema": {"type": "string"}}]
    return {
        "/v1/responses": {"post": op("OpenAI Responses (SSE when stream: true)", create)},
        "/v1/responses/{response_id}": {"parameters": rid, "get": op("a stored response"),
                                        "delete": op("delete a stored response")},
        "/v1/responses/{response_id}/input_items": {"parameters": rid,
                                                    "get": op("its input items (a page)")},
        "/v1/responses/{response_id}/cancel": {"parameters": rid,
                                               "post": op("cancel a background response")},
        "/v1/conversations": {"post": op("create a conversation", items)},
        "/v1/conversations/{conversation_id}": {
            "parameters": cid, "get": op("a conversation"),
            "post": op("update its metadata", items), "delete": op("delete it")},
        "/v1/conversations/{conversation_id}/items": {
            "parameters": cid, "get": op("its items (a page)"),
            "post": op("append items", items)},
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "parameters": iid, "get": op("one item"), "delete": op("delete one item")},
    }


def spec(model: str | None = None, max_seq_len: int | None = None, require_auth: bool = False,
         metrics_public: bool = False, max_messages: int = 2048) -> dict:
    gated = [{"bearerAuth": []}, {"apiKeyHeader": []}] if require_auth else []
    open_: list = []         # an empty requirement list: no auth
    tokenize = {"type": "object", "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}, "minItems": 1,
                     "maxItems": max_messages},
        "add_generation_prompt": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "chat_template_kwargs": {"type": "object"}, "continue_final_message": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}},
        "description": "send prompt (a string) or messages (a chat)"}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string"},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
    paths = {
        "/health": {"get": {"summary": "200 while serving; 503 while loading or without engine",
                            "security": open_, "responses": _responses({"type": "object"})}},
        "/openapi.json": {"get": {"summary": "this document", "security": gated,
                                  "responses": _responses({"type": "object"})}},
        "/metrics": {"get": {"summary": "Prometheus metrics of the engine",
                             "security": open_ if metrics_public else gated,
                             "responses": _responses({"type": "string"},
                                                     ok_type="text/plain")}},
        "/v1/models": {"get": {"summary": "the served model", "security": gated,
                               "responses": _responses(_ref("ModelList"))}},
        "/v1/chat/completions": {"post": {**_post("chat completion (SSE when stream: true)",
                                                  "ChatCompletionRequest",
                                                  _ref("ChatCompletion"), sse=True),
                                          "security": gated}},
        "/v1/completions": {"post": {**_post("legacy completion (SSE when stream: true)",
                                             "CompletionRequest", _ref("Completion"), sse=True),
                                     "security": gated}},
        "/tokenize": {"post": {**_post("text or chat -> token ids", "TokenizeRequest",
                                       {"type": "object"}), "security": gated}},
        "/detokenize": {"post": {**_post("token ids -> text", "DetokenizeRequest",
                                         {"type": "object"}), "security": gated}},
        "/v1/messages": {"post": {**_post("Anthropic Messages (SSE when stream: true)",
                                          "AnthropicMessagesRequest", _ref("AnthropicMessage"),
                                          "AnthropicError", sse=True), "security": gated}},
        "/v1/messages/count_tokens": {"post": {**_post(
            "Anthropic token count of a Messages request", "AnthropicCountTokensRequest",
            _ref("AnthropicTokenCount"), "AnthropicError"), "security": gated}},
        "/v1/library": {"get": {"summary": "the live model, the hot-swap state, the recipes, "
                                           "the HF cache's models, memory (the Library page)",
                                "security": gated, "responses": _responses({"type": "object"})}},
        "/v1/models/load": {"post": _load_model(gated)},
        **_responses_paths(gated, max_seq_len),
    }
    schemas = {"ChatCompletionRequest": _chat_request(max_seq_len, max_messages),
               "CompletionRequest": _completion_request(max_seq_len),
               "TokenizeRequest": tokenize, "DetokenizeRequest": detokenize,
               "LoadModelRequest": LOAD_MODEL_REQUEST,
               **_response_schemas(), **_anthropic_schemas(max_seq_len, max_messages)}
    title = f"Metrale ({model})" if model else "Metrale"
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__,
                 "description": "OpenAI- and Anthropic-compatible API of a Metrale server. "
                                "With --require-auth, send 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY' (either, on every route)."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearerAuth": {"type": "http", "scheme": "bearer"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    }


class OpenAPI:
    """GET /openapi.json (open, like /health). Until the engine has answered, the model's name
    and context length are left out."""

    def __init__(self, worker):
        self.worker = worker

    async def on_get(self, req, resp):
        info = self.worker.ready_info or {}
        s = self.worker.settings
        resp.content_type = falcon.MEDIA_JSON
        resp.data = orjson.dumps(spec(info.get("name"), info.get("max_seq_len"),
                                      s.require_auth, s.metrics_public, s.max_messages))
