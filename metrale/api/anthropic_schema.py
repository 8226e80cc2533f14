"""Anthropic Messages API: request validation, conversion to chat-template messages, response
and error shapes.

    POST /v1/messages {"model", "max_tokens", "messages", "system"?, "tools"?, "tool_choice"?,
                       "stop_sequences"?, "temperature"?, "top_p"?, "top_k"?, "thinking"?,
                       "metadata"?, "stream"?, "output_config"?, "context_management"?, ...}

Fields are those of the current Messages API (beta fields included, as Claude Code sends them
to /v1/messages?beta=true). As Anthropic does, a field the API does not know is a 400
"NAME: Extra inputs are not permitted" (top level, and on each message); known fields that do
not change what this server generates are accepted and ignored: `context_management` (nothing
is cleared: thinking is kept), `output_config.effort`, `service_tier`, `speed`,
`inference_geo`, `cache_control`, `container`, `diagnostics`, .... Known fields it cannot honour
(`mcp_servers`) are a 400 saying so.

Structured outputs (metrale.grammar): `output_config.format` {"type": "json_schema", "schema"}
(and the beta's top-level `output_format`) constrains the text answer, sent down the path of
OpenAI's `response_format`; tools with `strict: true`, or forced by `tool_choice` any / tool,
get their input constrained to their input_schema (--tool-grammar).

Conversion to the OpenAI-style messages our chat templates read:
  * `system` (a string or text blocks) -> a leading {"role": "system"} message; a `system`
    message inside `messages` (the current API's mid-conversation system turn) right at the start
    joins the leading one, after a user turn (or tool results) it is appended to that turn's text
    (templates render system text only at the top), after an assistant turn it is a 400;
  * user text blocks -> one user message; `tool_result` blocks -> {"role": "tool",
    "tool_call_id": tool_use_id, "content": text}, in order (a tool_result must answer a
    tool_use of an earlier assistant turn, else 400);
  * assistant text -> content, `thinking` -> `reasoning_content` (templates that know it render
    it; a block whose text was omitted is read back from its signature), `redacted_thinking` is
    dropped, `tool_use` -> `tool_calls` (id kept, input validated);
  * a text block needs a string `text`; image / document / server-tool blocks -> 400 naming the
    block (text-only models).
Tools: custom tools `{"name", "description"?, "input_schema", "defer_loading"?, ...}` -> OpenAI
function tools, their input_schema checked as a JSON Schema (tool_parsers.validation); tools
with `defer_loading: true` are not rendered into the prompt (as the API does not show them to
the model). `tool_choice` auto / any / tool / none, `disable_parallel_tool_use`.
`thinking`: enabled (budget_tokens < max_tokens) / adaptive / between_tools set the template's
`enable_thinking` (enabled also the thinking budget), disabled sets `enable_thinking=false`,
absent leaves the template's default; `display: "omitted"` sends thinking blocks with empty
text and their signature only.

`model` must name the served model (404 not_found_error otherwise, as on the OpenAI routes):
point Claude Code's background model at it too (ANTHROPIC_DEFAULT_HAIKU_MODEL).
Thinking blocks carry a `signature` (a signature_delta before the block stops when streamed):
the thinking text, compressed, with a checksum (`thinking_signature`), so a client that got the
thinking omitted can send the block back and the text is restored.

Errors: {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}; an
engine that is loading, restarting or gone answers 529 overloaded_error (the SDK's
OverloadedError, retried), a full queue or rate limit 429 rate_limit_error.
"""
from __future__ import annotations

import base64
import hashlib
import re
import secrets
import string
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from metrale.api.errors import APIError, invalid
from metrale.api.openai_schema import GenerationParams, MAX_STOP_STRINGS, type_name, check_model
from metrale.api.tool_parsers import (ToolChoice, validate_replayed_tool_call,
                                      validate_tool_choice, validate_tools)

OVERLOADED = 529
_ALPHABET = string.ascii_letters + string.digits
_CUSTOM_TOOL_TYPES = (None, "custom")
_NUMBERS = ("temperature", "top_p")
# the request fields of the current Messages API (beta included); any other is a 400
REQUEST_FIELDS = frozenset((
    "model", "max_tokens", "messages", "system", "metadata", "stop_sequences", "stream",
    "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "output_config",
    "context_management", "service_tier", "speed", "inference_geo", "cache_control",
    "container", "diagnostics", "mcp_servers", "billing_policy", "compaction",
    "fallback_credit_token", "fallbacks", "thread", "output_format"))
_MESSAGE_FIELDS = {"user": {"role", "content"}, "assistant": {"role", "content"},
                   "system": {"role", "content", "clear_at", "output_config"}}
_THINKING_FIELDS = {"enabled": {"type", "budget_tokens", "display"},
                    "adaptive": {"type", "display", "block_binding"},
                    "between_tools": {"type"}, "disabled": {"type"}}
_DISPLAYS = ("summarized", "omitted", "updates")
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_OUTPUT_CONFIG_FIELDS = {"effort", "format", "task_budget"}


@dataclass
class MessagesRequest(GenerationParams):
    messages: list[dict] = field(default_factory=list)    # converted, OpenAI-style
    tools: list[dict] | None = None                       # OpenAI function tools
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    thinking_budget: int | None = None
    thinking_display: str = "summarized"                  # or "omitted": text left out
    response_format: dict | None = None                   # output_config.format, OpenAI-shaped


# ---- errors ----------------------------------------------------------------------------------

def error_status(e: APIError) -> int:
    return OVERLOADED if e.status == 503 else e.status


def error_body(e: APIError) -> dict:
    return e.anthropic_body()


def error_json(e: APIError) -> bytes:
    return orjson.dumps(error_body(e))


# ---- ids -------------------------------------------------------------------------------------

def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call_id: str) -> str:
    """Our parsers' `call_XXXX` ids as Anthropic `toolu_XXXX`."""
    if call_id.startswith("call_"):
        return "toolu_" + call_id[5:]
    return call_id if call_id.startswith("toolu_") else \
        "toolu_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


# ---- thinking signatures -----------------------------------------------------------------------

_SIGNATURE_TAG = b"metrale-thinking-v1\0"


def thinking_signature(text: str) -> str:
    """The signature of a thinking block: its text (zlib) behind a 12-byte checksum, base64."""
    payload = zlib.compress(text.encode())
    digest = hashlib.sha256(_SIGNATURE_TAG + payload).digest()[:12]
    return base64.b64encode(digest + payload).decode()


def thinking_from_signature(signature) -> str | None:
    """The text a `thinking_signature` holds; None for any other string (e.g. Anthropic's)."""
    try:
        raw = base64.b64decode(signature, validate=True)
        digest, payload = raw[:12], raw[12:]
        if hashlib.sha256(_SIGNATURE_TAG + payload).digest()[:12] != digest:
            return None
        return zlib.decompress(payload).decode()
    except (TypeError, ValueError, zlib.error):
        return None


# ---- requests --------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _extra_inputs(obj: dict, known, where: str = "") -> None:
    """Anthropic's answer to a field it does not know."""
    for name in obj:
        if name not in known:
            raise invalid(f"{where}{name}: Extra inputs are not permitted", where + name)


def parse_messages_request(body: Any, count_only: bool = False,
                           served: str | None = None) -> MessagesRequest:
    """The request, checked; `served` (the served model's name) makes any other model a 404."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}")
    _extra_inputs(body, REQUEST_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: field required (a string)", "model")
    if served is not None:
        check_model(model, served)
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise invalid("max_tokens: field required", "max_tokens")
        if not _is_int(max_tokens) or max_tokens < 1:
            raise invalid(f"max_tokens: must be an integer >= 1, got {max_tokens!r:.40}",
                          "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream: must be a boolean", "stream")
    req = MessagesRequest(model=model, stream=stream,
                          max_tokens=None if count_only else max_tokens,
                          stop=_stop_sequences(body.get("stop_sequences")),
                          sampling=_sampling(body))
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid("metadata: must be an object", "metadata")
        user = metadata.get("user_id")
        req.user = user if isinstance(user, str) else None
    _unhonoured(body)
    req.tools = _tools(body.get("tools"))
    req.tool_choice, req.parallel_tool_calls = _tool_choice(body.get("tool_choice"), req.tools)
    _thinking(body.get("thinking"), req, max_tokens if not count_only else None)
    req.response_format = _output_format(body)
    messages = _system(body.get("system"))
    req.messages = convert_messages(body.get("messages"), messages)
    return req


def _unhonoured(body: dict) -> None:
    """Known fields this server cannot act on as asked: a 400 rather than silence."""
    if body.get("mcp_servers"):
        raise invalid("mcp_servers: MCP servers are not supported by this server; run the MCP "
                      "client on your side and declare its tools in 'tools'", "mcp_servers")
    for name in ("context_management", "metadata"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise invalid(f"{name}: must be an object", name)


def _output_config(config: Any, where: str) -> dict | None:
    """`effort` is accepted (generation here has no effort knob); `format` is returned."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise invalid(f"{where}: must be an object", where)
    _extra_inputs(config, _OUTPUT_CONFIG_FIELDS, where + ".")
    effort = config.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise invalid(f"{where}.effort: must be one of {', '.join(_EFFORTS)}, got {effort!r:.40}",
                      where)
    return config.get("format")


def _output_format(body: dict) -> dict | None:
    """output_config.format (or the beta's output_format) as an OpenAI response_format."""
    fmt, where = _output_config(body.get("output_config"), "output_config"), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, where = body["output_format"], "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid(f"{where}: must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}",
                      where)
    _extra_inputs(fmt, {"type", "schema"}, where + ".")
    if not isinstance(fmt.get("schema"), dict):
        raise invalid(f"{where}.schema: field required (a JSON schema object)", where)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                   "strict": True}}


def _sampling(body: dict) -> dict:
    out = {}
    for name in _NUMBERS:
        v = body.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise invalid(f"{name}: must be a number, got {type_name(v)}", name)
            out[name] = v
    if body.get("top_k") is not None:
        if not _is_int(body["top_k"]) or body["top_k"] < 0:
            raise invalid("top_k: must be an integer >= 0", "top_k")
        out["top_k"] = body["top_k"]
    return out


def _stop_sequences(stop: Any) -> list[str]:
    if stop is None:
        return []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop_sequences: must be an array of non-empty strings", "stop_sequences")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop_sequences: at most {MAX_STOP_STRINGS} strings", "stop_sequences")
    return list(dict.fromkeys(stop))


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools: must be an array of tool definitions", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise invalid(f"tools.{i}: must be an object", "tools")
        if t.get("type") not in _CUSTOM_TOOL_TYPES:
            raise invalid(f"tools.{i}: tool type {t.get('type')!r} is not supported; only custom "
                          "tools ({\"name\", \"description\", \"input_schema\"}) are", "tools")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"tools.{i}.input_schema: field required (a JSON schema object, e.g. "
                          "{\"type\": \"object\", \"properties\": {...}})", "tools")
        fn = {"name": t.get("name"), "parameters": schema}
        if t.get("strict") is not None:
            if not isinstance(t["strict"], bool):
                raise invalid(f"tools.{i}.strict: must be a boolean", "tools")
            fn["strict"] = t["strict"]
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise invalid(f"tools.{i}.description: must be a string", "tools")
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    try:
        validate_tools(out)
    except ValueError as e:
        text = re.sub(r"tools\[(\d+)\]", r"tools.\1", str(e))
        raise invalid(text.replace(".function.parameters", ".input_schema")
                      .replace(".function.name", ".name"), "tools")
    shown = [fn for fn, t in zip(out, tools) if t.get("defer_loading") is not True]
    return shown or None


def _tool_choice(choice: Any, tools: list[dict] | None) -> tuple[ToolChoice, bool]:
    if choice is None:
        return validate_tool_choice(None, tools), True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice: must be {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                      "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}", "tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    openai = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai = {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("any", "tool") and not tools:
        raise invalid(f"tool_choice: type {kind!r} needs at least one tool in 'tools'",
                      "tool_choice")
    if not tools:
        return ToolChoice("none"), parallel
    try:
        return validate_tool_choice(openai, tools), parallel
    except ValueError as e:
        raise invalid(f"tool_choice: {e}", "tool_choice")


def _thinking(thinking: Any, req: MessagesRequest, max_tokens: int | None) -> None:
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in _THINKING_FIELDS:
        raise invalid("thinking: must be {\"type\": \"adaptive\"}, {\"type\": \"enabled\", "
                      "\"budget_tokens\": N}, {\"type\": \"between_tools\"} or "
                      "{\"type\": \"disabled\"}", "thinking")
    _extra_inputs(thinking, _THINKING_FIELDS[kind], f"thinking.{kind}.")
    req.chat_template_kwargs["enable_thinking"] = kind != "disabled"
    display = thinking.get("display")
    if display is not None:
        if display not in _DISPLAYS:
            raise invalid(f"thinking.display: must be one of {', '.join(_DISPLAYS)}, got "
                          f"{display!r:.40}", "thinking")
        req.thinking_display = "omitted" if display == "omitted" else "summarized"
    if kind != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if budget is None:
        raise invalid("thinking.budget_tokens: field required", "thinking")
    if not _is_int(budget) or budget < 1:
        raise invalid("thinking.budget_tokens: must be an integer >= 1", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise invalid(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                      f"({max_tokens})", "thinking")
    req.thinking_budget = budget


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (the text-only content of system / tool_result)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{where}: must be a string or an array of content blocks", where)
    texts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            raise _unsupported(kind, f"{where}.{j}")
        texts.append(_block_text(b, f"{where}.{j}"))
    return "\n".join(texts)


def _block_text(block: dict, where: str) -> str:
    """The `text` of a text block: required, a string."""
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text: field required (a string), got {type_name(text)}", where)
    return text


def _unsupported(kind: Any, where: str) -> APIError:
    if kind in ("image", "document", "search_result"):
        return invalid(f"{where}: content blocks of type {kind!r} are not supported: this model "
                       "reads text only; send the content as text blocks", where)
    return invalid(f"{where}: unsupported content block type {kind!r} here", where)


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    text = _text_of(system, "system")
    return [{"role": "system", "content": text}] if text else []


def convert_messages(messages: Any, system: list[dict] | None = None) -> list[dict]:
    """Anthropic messages -> OpenAI-style chat messages after `system` (the converted
    top-level system prompt), see the module docstring."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: field required (a non-empty array of messages)", "messages")
    out: list[dict] = list(system or [])
    tool_ids: set[str] = set()
    answered: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in _MESSAGE_FIELDS:
            raise invalid(f"{where}.role: must be 'user', 'assistant' or 'system'", where)
        _extra_inputs(m, _MESSAGE_FIELDS[m["role"]], where + ".")
        content = m.get("content")
        if m["role"] == "system":
            _system_turn(out, m, where)
            continue
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content: must be a string or an array of content blocks",
                          where)
        if m["role"] == "assistant":
            out.append(_assistant(content, where, tool_ids))
        else:
            out.extend(_user(content, where, tool_ids, answered))
    return out


def _system_turn(out: list[dict], m: dict, where: str) -> None:
    """A system message inside `messages`: joins the leading system prompt, or the user turn
    (or tool results) it follows; never right after an assistant turn."""
    if _output_config(m.get("output_config"), where + ".output_config") is not None:
        raise invalid(f"{where}.output_config.format: give the output format at the top level "
                      "(output_config.format)", where)
    if m.get("clear_at") not in (None, "next_user_message", "never"):
        raise invalid(f"{where}.clear_at: must be 'next_user_message' or 'never'", where)
    if m.get("content") is None:
        raise invalid(f"{where}.content: field required", where)
    text = _text_of(m["content"], f"{where}.content")
    if not text:
        return
    last = out[-1] if out else None
    if last is None or all(x["role"] == "system" for x in out):
        if last is None:
            out.append({"role": "system", "content": text})
        else:
            last["content"] += "\n\n" + text
    elif last["role"] == "user":
        last["content"] += "\n\n" + text
    elif last["role"] == "tool":
        out.append({"role": "user", "content": text})
    else:
        raise invalid(f"{where}: a system message must follow a user turn, not an assistant "
                      "turn", where)


def _assistant(blocks: list, where: str, tool_ids: set[str]) -> dict:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_block_text(b, at))
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thought = b["thinking"] or thinking_from_signature(b.get("signature"))
            if thought:
                thoughts.append(thought)
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise invalid(f"{at}: a tool_use block needs 'id' and 'name' strings", at)
            try:
                args = validate_replayed_tool_call(b.get("input", {}))
            except ValueError:
                raise invalid(f"{at}.input: must be a JSON object (the tool's arguments), got "
                              f"{type_name(b.get('input'))}", at)
            tool_ids.add(b["id"])
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": args}})
        else:
            raise _unsupported(kind, at)
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list, where: str, tool_ids: set[str], answered: set[str]) -> list[dict]:
    out, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_block_text(b, at))
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if tid not in tool_ids:
                raise invalid(f"{at}: tool_result for tool_use_id {tid!r}, which no earlier "
                              "assistant tool_use block has; each tool_result must answer a "
                              "tool_use of the previous assistant turn", at)
            if tid in answered:
                raise invalid(f"{at}: tool_use_id {tid!r} already has a tool_result", at)
            answered.add(tid)
            content = b.get("content", "")
            text = _text_of(content, f"{at}.content") if content is not None else ""
            out.append({"role": "tool", "tool_call_id": tid, "content": text})
        else:
            raise _unsupported(kind, at)
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


# ---- responses -------------------------------------------------------------------------------

def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic counts cache reads apart: input_tokens is the uncached part of the prompt."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message(mid: str, model: str, content: list[dict], stop_reason: str | None,
            stop_sequence: str | None, use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": use}


def sse(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
