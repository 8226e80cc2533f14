"""OpenAI request validation and response builders (chat completions, legacy completions).

Parsing checks every field the server reads for its type and range and raises `APIError` (400)
naming the field; fields it does not read are ignored, as vLLM does. The result is plain data
(`ChatRequest`, `CompletionRequest`) that the frontend turns into engine submissions: prompt
rendering and tokenization happen there, because they need the model's tokenizer and template.

Builders return dicts ready for orjson; they follow the shapes of the OpenAI API (and vLLM's
extensions: `top_k`, `min_p`, `repetition_penalty`, `prompt_tokens_details.cached_tokens`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from metrale.api.errors import APIError, invalid, model_not_found
from metrale.chat import TEXT_PART_TYPES
from metrale.api.tool_parsers import (ToolChoice, validate_replayed_tool_call,
                                      validate_tool_choice, validate_tools)

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# request field -> SamplingParams field; validated for type here, for range by SamplingParams
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "top_n_sigma")
INT_FIELDS = ("top_k", "min_tokens")
MAX_SEED = 2**64 - 1


@dataclass
class GenerationParams:
    """What both APIs share: everything about how to sample, stop and stream."""
    model: str | None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)   # SamplingParams fields (not n, not max_tokens)
    logprobs: int | None = None                    # top-k per token; None = off
    user: str | None = None
    response_format: dict | None = None            # structured output (metrale.grammar)


@dataclass
class ChatRequest(GenerationParams):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    thinking_budget: int | None = None    # max_thinking_tokens / chat_template_kwargs.thinking_budget


@dataclass
class CompletionRequest(GenerationParams):
    prompts: list[str | list[int]] = field(default_factory=list)  # text, or token ids
    echo: bool = False
    suffix: str | None = None


# ---- field readers -------------------------------------------------------------------------

def type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _opt(body: dict, name: str, check, what: str, default=None):
    """body[name] when present and not null, checked with `check`; else `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise invalid(f"'{name}' must be {what}, got {type_name(value)} {value!r:.80}", name)
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    return _opt(body, name, lambda v: isinstance(v, bool), "a boolean", default)


def _int_range(body: dict, name: str, low: int, high: int | None, default=None):
    value = _opt(body, name, _is_int, "an integer", default)
    if value is not None and (value < low or (high is not None and value > high)):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise invalid(f"'{name}' must be {bound}, got {value}", name)
    return value


def _common(body: Any) -> dict:
    """The fields both APIs share, checked; returns GenerationParams keyword arguments."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}")
    model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    n = _int_range(body, "n", 1, MAX_N, 1)
    stream = _bool(body, "stream")
    options = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if options and not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = _bool(options, "include_usage")
    max_tokens = _int_range(body, "max_completion_tokens", 1, None)
    if max_tokens is None:
        max_tokens = _int_range(body, "max_tokens", 1, None)
    sampling = {}
    for name in NUMBER_FIELDS:
        if (v := _opt(body, name, _is_number, "a number")) is not None:
            sampling[name] = v
    for name in INT_FIELDS:
        if (v := _opt(body, name, _is_int, "an integer")) is not None:
            sampling[name] = v
    if (seed := _seed(body)) is not None:
        sampling["seed"] = seed
    sampling["ignore_eos"] = _bool(body, "ignore_eos")
    stop_ids = _opt(body, "stop_token_ids", lambda v: isinstance(v, list)
                    and all(_is_int(i) and i >= 0 for i in v), "an array of token ids")
    if stop_ids:
        sampling["stop_token_ids"] = stop_ids
    return dict(model=model, n=n, stream=stream, include_usage=include_usage,
                max_tokens=max_tokens, stop=_stop(body), sampling=sampling,
                user=_opt(body, "user", lambda v: isinstance(v, str), "a string"),
                response_format=_opt(body, "response_format", lambda v: isinstance(v, dict),
                                     "an object such as {\"type\": \"json_object\"}"))


def _seed(body: dict) -> int | None:
    """An integer in 0..2**64-1 (JSON integers past 2**64 arrive as floats: out of range too)."""
    value = body.get("seed")
    if isinstance(value, float) and value.is_integer() and abs(value) > MAX_SEED:
        raise invalid(f"'seed' must be between 0 and {MAX_SEED}, got {value:.0f}", "seed")
    return _int_range(body, "seed", 0, MAX_SEED)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("'stop' must be a string or an array of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                      "stop")
    if any(s == "" for s in stop):
        raise invalid("'stop' strings must not be empty", "stop")
    return list(dict.fromkeys(stop))


# ---- chat ----------------------------------------------------------------------------------

def parse_chat_request(body: Any) -> ChatRequest:
    req = ChatRequest(**_common(body))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("'messages' is required and must be an array of messages", "messages")
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages")
    for i, m in enumerate(messages):
        _check_message(m, i)
    req.messages = messages
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise invalid("'logprobs' must be a boolean (use 'top_logprobs' for alternatives)",
                      "logprobs")
    top = _int_range(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if body.get("logprobs"):
        req.logprobs = top or 0
    elif top is not None:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    req.tools = _opt(body, "tools", lambda v: isinstance(v, list)
                     and all(isinstance(t, dict) for t in v), "an array of tool objects") or None
    try:
        if req.tools:
            validate_tools(req.tools)
        req.tool_choice = validate_tool_choice(body.get("tool_choice"), req.tools)
    except ValueError as e:
        raise invalid(str(e), "tools" if str(e).startswith("tools") else "tool_choice")
    req.parallel_tool_calls = _bool(body, "parallel_tool_calls", True)
    req.chat_template_kwargs = _opt(body, "chat_template_kwargs", lambda v: isinstance(v, dict),
                                    "an object", {})
    req.thinking_budget = _int_range(body, "max_thinking_tokens", 0, None)
    if req.thinking_budget is None:
        req.thinking_budget = _int_range(req.chat_template_kwargs, "thinking_budget", 0, None)
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    req.continue_final_message = _bool(body, "continue_final_message")
    if req.continue_final_message and body.get("add_generation_prompt") is None:
        req.add_generation_prompt = False
    return req


def _check_message(m: Any, i: int) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"{where} must be an object with 'role' and 'content', got "
                      f"{type_name(m)}", where)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                      f"{where}.role")
    content = m.get("content")
    if content is None and role != "assistant":
        raise invalid(f"{where}.content is required for role {role!r}", f"{where}.content")
    if content is not None and not isinstance(content, (str, list)):
        raise invalid(f"{where}.content must be a string or an array of content parts, got "
                      f"{type_name(content)}", f"{where}.content")
    if isinstance(content, list):
        _check_parts(content, where)
    calls = m.get("tool_calls")
    if role == "assistant" and calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise invalid(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": "
                              "\"function\", \"function\": {\"name\", \"arguments\"}}",
                              f"{where}.tool_calls")
            try:
                validate_replayed_tool_call(fn.get("arguments", "{}"))
            except ValueError as e:
                raise invalid(f"{where}.tool_calls[{j}]: {e}", f"{where}.tool_calls")


def _check_parts(parts: list, where: str) -> None:
    """Each content part an object with a `type` (or a bare string, as metrale.chat reads);
    text parts with a string `text`."""
    for j, part in enumerate(parts):
        at = f"{where}.content[{j}]"
        if isinstance(part, str):
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{at} must be a content part object with a 'type', e.g. "
                          '{"type": "text", "text": "..."}', f"{where}.content")
        if part["type"] in TEXT_PART_TYPES and not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text is required and must be a string, got "
                          f"{type_name(part.get('text'))}", f"{where}.content")


# ---- completions ---------------------------------------------------------------------------

def parse_completion_request(body: Any) -> CompletionRequest:
    req = CompletionRequest(**_common(body))
    req.prompts = _prompts(body.get("prompt"))
    req.logprobs = _int_range(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    req.echo = _bool(body, "echo")
    req.suffix = _opt(body, "suffix", lambda v: isinstance(v, str), "a string")
    if req.suffix:
        raise invalid("'suffix' is not supported by this model", "suffix")
    if _is_int(body.get("best_of")) and body["best_of"] != req.n:
        raise invalid("'best_of' other than n is not supported", "best_of")
    return req


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, an array of strings, an array of token ids, or an array of those arrays."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [_checked_ids(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [_checked_ids(p) for p in prompt]
    if prompt is None:
        raise invalid("'prompt' is required", "prompt")
    raise invalid("'prompt' must be a string, an array of strings, an array of token ids or an "
                  "array of non-empty token id arrays", "prompt")


def _checked_ids(ids: list[int]) -> list[int]:
    if any(t < 0 for t in ids):
        raise invalid("token ids in 'prompt' must be >= 0", "prompt")
    return list(ids)


# ---- responses -----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_completion(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: list[dict] | None, tool_calls: list[dict] | None = None,
                reasoning: str | None = None) -> dict:
    """`reasoning_content` is vLLM's field for the text of the think block (null when none)."""
    return {"index": index, "message": {"role": "assistant", "content": text,
                                        "reasoning_content": reasoning,
                                        "tool_calls": tool_calls or []},
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason}


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name,
                                                            "arguments": arguments}}


def tool_call_delta(index: int, call_id: str | None = None, name: str | None = None,
                    arguments: str = "") -> dict:
    """One entry of a chunk's delta.tool_calls: the first carries id and name."""
    if call_id is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict],
               use: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, "system_fingerprint": None}
    if use is not None:
        chunk["usage"] = use
    return chunk


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None = None,
                      logprobs: list[dict] | None = None) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason}


def chat_logprob(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    """One entry of choices[].logprobs.content."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                             for t, lp in top]}


def completion(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_logprobs(tokens: list[str], token_logprobs: list[float | None],
                        top: list[dict | None], text_offset: list[int]) -> dict:
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": text_offset}


def model_list(name: str, created: int, max_seq_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "metrale", "root": name, "parent": None,
                                        "max_model_len": max_seq_len}]}


def check_model(requested: str | None, served: str) -> None:
    """A request naming another model is refused (404, as OpenAI does); none means ours."""
    if requested is not None and requested != served:
        raise model_not_found(requested, served)


def sampling_error(e: ValueError) -> APIError:
    """A SamplingParams range error -> 400 naming the field (the message starts with it)."""
    text = str(e)
    param = text.split(" ", 1)[0].strip("'")
    return invalid(text, param if param.isidentifier() else None)
