"""OpenAI Responses and Conversations: request validation and the item <-> chat translations.

A Responses request becomes a chat request (`chat_body`): the items become chat messages
(`items_to_messages`), the tools chat tools, `text.format` the chat `response_format`,
`reasoning.effort` a thinking budget, so it runs down exactly the path chat completions run
(frontends.request_plumbing: prepare_chat, choice_specs). Custom tools (free-form input) are
offered to the model as a function with one string argument, `input`, and read back as
`custom_tool_call` items.

Items carry ids (`msg_`, `fc_`, `fco_`, `rs_`, `ctc_`, `ctco_`): ones a client sends are kept,
the rest are made here, so stored input items can be listed and referenced.

Reasoning items round-trip: with `include: ["reasoning.encrypted_content"]` the reasoning text
comes back base64-encoded in `encrypted_content` (opaque to the client, NOT encrypted: a
stateless client, store: false, sends it back and the model sees its reasoning again).
"""
from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from metrale.api.errors import invalid
from metrale.api.openai_schema import type_name

# reasoning.effort -> the thinking budget in tokens (None: no budget beyond the server's
# --max-thinking-budget); "none" also tells the template not to open a think block
REASONING_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None,
                     "xhigh": None}
INCLUDABLE = ("file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")
ENCRYPTED = "reasoning.encrypted_content"
LOGPROBS = "message.output_text.logprobs"
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning",
              "custom_tool_call", "custom_tool_call_output")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}},
                     "required": ["input"]}
MAX_METADATA = 16
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
           "reasoning": "rs", "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class ResponsesRequest:
    model: str | None
    input_items: list[dict]                 # this request's items (ids assigned)
    instructions: str | None = None
    tools: list[dict] = field(default_factory=list)          # as given (Responses shape)
    chat_tools: list[dict] | None = None                      # as chat completions takes them
    custom_tools: frozenset = frozenset()                     # names of custom tools
    tool_choice: Any = "auto"                                 # as given
    chat_tool_choice: Any = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: dict | None = None
    thinking_budget: int | None = None
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    response_format: dict | None = None                       # text.format as chat's
    store: bool = True
    background: bool = False
    stream: bool = False
    previous_response_id: str | None = None
    conversation_id: str | None = None
    truncation: str = "disabled"
    metadata: dict = field(default_factory=dict)
    include: list[str] = field(default_factory=list)
    user: str | None = None
    extra_sampling: dict = field(default_factory=dict)        # seed, top_k, ... (extensions)


def _get(body: dict, name: str, kinds, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (kinds in (int, (int, float)) and isinstance(value, bool)):
        raise invalid(f"'{name}' must be {what}, got {type_name(value)}", name)
    return value


def parse_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}")
    req = ResponsesRequest(model=_get(body, "model", str, "a string"),
                           input_items=parse_items(body.get("input"), "input"))
    req.instructions = _get(body, "instructions", str, "a string")
    _tools(body, req)
    req.parallel_tool_calls = _get(body, "parallel_tool_calls", bool, "a boolean", True)
    req.max_output_tokens = _get(body, "max_output_tokens", int, "an integer")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise invalid("'max_output_tokens' must be >= 1", "max_output_tokens")
    req.temperature = _get(body, "temperature", (int, float), "a number")
    req.top_p = _get(body, "top_p", (int, float), "a number")
    req.top_logprobs = _get(body, "top_logprobs", int, "an integer")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise invalid("'top_logprobs' must be between 0 and 20", "top_logprobs")
    _reasoning(body, req)
    _text(body, req)
    req.store = _get(body, "store", bool, "a boolean", True)
    req.background = _get(body, "background", bool, "a boolean", False)
    req.stream = _get(body, "stream", bool, "a boolean", False)
    if req.background and not req.store:
        raise invalid("'background': true needs 'store': true (a background response is "
                      "fetched with GET /v1/responses/{id})", "background")
    req.previous_response_id = _get(body, "previous_response_id", str, "a string")
    req.conversation_id = _conversation(body)
    if req.conversation_id and req.previous_response_id:
        raise invalid("pass 'previous_response_id' or 'conversation', not both",
                      "previous_response_id")
    req.truncation = _get(body, "truncation", str, "a string", "disabled")
    if req.truncation not in ("auto", "disabled"):
        raise invalid(f"'truncation' must be 'auto' or 'disabled', got {req.truncation!r:.40}",
                      "truncation")
    req.metadata = parse_metadata(body.get("metadata"))
    req.include = _include(body)
    req.user = _get(body, "user", str, "a string")
    for name in ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "ignore_eos"):
        if body.get(name) is not None:
            req.extra_sampling[name] = body[name]
    return req


def _conversation(body: dict) -> str | None:
    conv = body.get("conversation", body.get("conversation_id"))
    if isinstance(conv, dict):
        conv = conv.get("id")
    if conv is not None and not isinstance(conv, str):
        raise invalid("'conversation' must be a conversation id or {\"id\": ...}",
                      "conversation")
    return conv


def parse_metadata(value: Any) -> dict:
    """Up to 16 string pairs (keys <= 64 characters, values <= 512), as OpenAI."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()):
        raise invalid("'metadata' must be an object of at most 16 string values (keys up to "
                      "64 characters, values up to 512)", "metadata")
    return dict(value)


def _include(body: dict) -> list[str]:
    include = _get(body, "include", list, "an array of strings", [])
    bad = [i for i in include if i not in INCLUDABLE]
    if bad:
        raise invalid(f"'include' value {bad[0]!r:.60} is not one of {', '.join(INCLUDABLE)}",
                      "include")
    return include


def _reasoning(body: dict, req: ResponsesRequest) -> None:
    reasoning = _get(body, "reasoning", dict, "an object")
    if reasoning is None:
        return
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_BUDGETS):
        raise invalid(f"'reasoning.effort' must be one of {', '.join(REASONING_BUDGETS)}, got "
                      f"{effort!r:.40}", "reasoning.effort")
    req.reasoning = {"effort": effort, "summary": reasoning.get("summary")}
    if effort is not None:
        req.thinking_budget = REASONING_BUDGETS[effort]


def _text(body: dict, req: ResponsesRequest) -> None:
    text = _get(body, "text", dict, "an object")
    if text is None or text.get("format") is None:
        return
    fmt = text["format"]
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        pass
    elif kind == "json_object":
        req.response_format = {"type": "json_object"}
    elif kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise invalid("'text.format' of type json_schema needs a 'name' (string) and a "
                          "'schema' (object)", "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        req.response_format = {"type": "json_schema", "json_schema": spec}
    else:
        raise invalid("'text.format.type' must be text, json_object or json_schema",
                      "text.format")
    req.text = {**text, "format": fmt}


# ---- tools ----------------------------------------------------------------------------------

def _tools(body: dict, req: ResponsesRequest) -> None:
    tools = _get(body, "tools", list, "an array of tools", [])
    chat, custom = [], set()
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ("function", "custom") or not isinstance(tool.get("name"), str):
            raise invalid(f"tools[{i}]: only function and custom tools are served here (a "
                          f"{kind!r} tool needs a service this server does not run); each "
                          "needs a 'name'", "tools")
        fn = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if kind == "custom":
            custom.add(tool["name"])
            fn["parameters"] = CUSTOM_PARAMETERS
        else:
            fn["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
            if tool.get("strict") is not None:
                fn["strict"] = tool["strict"]
        chat.append({"type": "function", "function": fn})
    req.tools = [_echo_tool(t) for t in tools]
    req.chat_tools = chat or None
    req.custom_tools = frozenset(custom)
    choice = body.get("tool_choice")
    req.tool_choice = "auto" if choice is None else choice
    req.chat_tool_choice = _tool_choice(choice, chat)


def _echo_tool(tool: dict) -> dict:
    """A tool as the response object lists it (the SDK's FunctionTool / CustomTool)."""
    if tool["type"] == "function":
        return {"type": "function", "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}
    return {k: v for k, v in tool.items() if k in ("type", "name", "description", "format")}


def _tool_choice(choice: Any, chat_tools: list[dict]):
    """Responses' tool_choice as chat's."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom") and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
            return choice["mode"]
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\", "
                  "{\"type\": \"function\", \"name\": ...} or {\"type\": \"custom\", \"name\": "
                  "...}", "tool_choice")


# ---- items ----------------------------------------------------------------------------------

def parse_items(value: Any, param: str) -> list[dict]:
    """`input` (a string, or an array of items) as items with ids, checked."""
    if isinstance(value, str):
        return [input_message("user", value)]
    if not isinstance(value, list):
        raise invalid(f"'{param}' is required: a string or an array of input items", param)
    return [_item(item, f"{param}[{i}]") for i, item in enumerate(value)]


def input_message(role: str, text: str) -> dict:
    part = "output_text" if role == "assistant" else "input_text"
    content = {"type": part, "text": text}
    if role == "assistant":
        content["annotations"] = []
    return {"id": new_id("msg"), "type": "message", "role": role, "status": "completed",
            "content": [content]}


def _item(item: Any, where: str) -> dict:
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an item object, got {type_name(item)}", where)
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise invalid(f"{where}.type must be one of {', '.join(ITEM_TYPES)}, got {kind!r:.40}",
                      where)
    out = {**item, "type": kind}
    out.setdefault("id", new_id(_PREFIX[kind]))
    if not isinstance(out["id"], str):
        raise invalid(f"{where}.id must be a string", where)
    _check_item(out, where)
    if kind != "reasoning":
        out.setdefault("status", "completed")
    return out


def _check_item(item: dict, where: str) -> None:
    kind = item["type"]
    if kind == "message":
        if item.get("role") not in INPUT_ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(INPUT_ROLES)}", where)
        content = item.get("content")
        if isinstance(content, str):
            item["content"] = [{"type": "output_text" if item["role"] == "assistant"
                                else "input_text", "text": content}]
        elif not isinstance(content, list):
            raise invalid(f"{where}.content must be a string or an array of content parts",
                          where)
        for j, part in enumerate(item["content"]):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS + ("refusal",) \
                    or not isinstance(part.get("text", part.get("refusal")), str):
                raise invalid(f"{where}.content[{j}]: only text parts (input_text, output_text) "
                              "are read by this model; images, files and audio are not", where)
    elif kind in ("function_call", "custom_tool_call"):
        key = "arguments" if kind == "function_call" else "input"
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", key)):
            raise invalid(f"{where}: a {kind} needs string 'call_id', 'name' and '{key}'", where)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str) or item.get("output") is None:
            raise invalid(f"{where}: a {kind} needs a 'call_id' and an 'output'", where)
    elif kind == "reasoning":
        item.setdefault("summary", [])


def _text_of(parts) -> str:
    """The text of a content value: a string, or the text parts of a list (others: none)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        return ""
    texts = (p.get("text", p.get("refusal", "")) for p in parts if isinstance(p, dict))
    return "".join(t for t in texts if isinstance(t, str))


def reasoning_text(item: dict) -> str:
    text = _text_of(item.get("content")) or _text_of(item.get("summary"))
    if not text and isinstance(item.get("encrypted_content"), str):
        try:
            text = json.loads(base64.b64decode(item["encrypted_content"]))["text"]
            if not isinstance(text, str):
                raise TypeError(text)
        except (ValueError, KeyError, TypeError):
            raise invalid("a reasoning item's encrypted_content is not one this server made",
                          "input") from None
    return text


def encrypt_reasoning(text: str) -> str:
    return base64.b64encode(json.dumps({"text": text}).encode()).decode()


def items_to_messages(items: list[dict]) -> list[dict]:
    """Items (stored context + this input) -> chat messages: an assistant turn gathers its
    reasoning, text and calls into one message; tool outputs become `tool` messages."""
    messages: list[dict] = []
    reasoning = ""
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += reasoning_text(item)
            continue
        if kind == "message" and item.get("role") != "assistant":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item["output"])})
        else:
            turn = _assistant_turn(messages)
            if kind == "message":
                turn["content"] = (turn["content"] or "") + _text_of(item.get("content"))
            else:
                args = item["arguments"] if kind == "function_call" else \
                    json.dumps({"input": item["input"]})
                turn["tool_calls"].append({"id": item["call_id"], "type": "function",
                                           "function": {"name": item["name"],
                                                        "arguments": args}})
            if reasoning:
                turn["reasoning_content"] = (turn.get("reasoning_content") or "") + reasoning
                reasoning = ""
    for m in messages:
        if m["role"] == "assistant" and not m["tool_calls"]:
            del m["tool_calls"]
    return messages


def merge_system(messages: list[dict]) -> list[dict]:
    """The leading system messages (instructions, system and developer items) as one: chat
    templates take a single system message, at the start."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    if lead <= 1:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:lead] if m["content"])
    return [{"role": "system", "content": text}] + messages[lead:]


def _assistant_turn(messages: list[dict]) -> dict:
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None, "tool_calls": []})
    return messages[-1]


def messages_to_items(messages: list[dict]) -> list[dict]:
    """Chat messages (chat completions with conversation_id) -> conversation items."""
    items = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        text = content if isinstance(content, str) else _text_of(content)
        if role == "tool":
            items.append({"id": new_id("fco"), "type": "function_call_output",
                          "call_id": m.get("tool_call_id") or "", "output": text,
                          "status": "completed"})
            continue
        if role == "assistant" and m.get("reasoning_content"):
            items.append(reasoning_item(m["reasoning_content"]))
        if text or role != "assistant":
            items.append(input_message(role if role in INPUT_ROLES else "user", text or ""))
        for call in m.get("tool_calls") or () if role == "assistant" else ():
            fn = call.get("function") or {}
            args = fn.get("arguments")
            items.append({"id": new_id("fc"), "type": "function_call",
                          "call_id": call.get("id") or new_id("call"), "name": fn.get("name"),
                          "arguments": args if isinstance(args, str) else json.dumps(args or {}),
                          "status": "completed"})
    return items


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat completions request this Responses request runs as."""
    body = {"messages": messages, "tools": req.chat_tools, "stream": req.stream,
            "parallel_tool_calls": req.parallel_tool_calls, **req.extra_sampling}
    if req.chat_tools:
        body["tool_choice"] = req.chat_tool_choice
    for key, value in (("max_completion_tokens", req.max_output_tokens),
                       ("temperature", req.temperature), ("top_p", req.top_p),
                       ("response_format", req.response_format),
                       ("max_thinking_tokens", req.thinking_budget)):
        if value is not None:
            body[key] = value
    if req.top_logprobs is not None or LOGPROBS in req.include:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.thinking_budget == 0:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def conversation_object(cid: str, metadata: dict, created_at: int | None = None) -> dict:
    return {"id": cid, "object": "conversation",
            "created_at": int(time.time()) if created_at is None else created_at,
            "metadata": metadata}
