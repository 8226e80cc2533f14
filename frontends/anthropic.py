"""The Anthropic Messages API of a frontend worker (Claude Code through ANTHROPIC_BASE_URL).

    POST /v1/messages                 a message (SSE when stream: true)
    POST /v1/messages/count_tokens    {"input_tokens": N} of the rendered prompt

Requests are validated and converted by metrale.api.anthropic_schema, then share the chat path
of the OpenAI API (frontends.request_plumbing.prepare_chat, frontends.generate): the same parsers turn the
output into thinking / text / tool_use blocks. `Blocks` folds the parsed events into content
blocks and, while streaming, into the exact Anthropic event sequence:

    message_start, ping,
    (content_block_start, content_block_delta (text_delta | thinking_delta | input_json_delta)*,
     [content_block_delta signature_delta: thinking blocks], content_block_stop)*,
    message_delta {stop_reason, stop_sequence, usage.output_tokens}, message_stop

stop_reason: tool_use (the message holds calls and ended by itself), stop_sequence (with the
matched string), max_tokens, else end_turn; a request ended by --request-timeout is a
timeout_error (504, or an `error` event once streaming). Thinking blocks end with their signature
(anthropic_schema.thinking_signature); with `thinking.display: "omitted"` their text is left
out (no thinking_delta) and only the signature is sent. Errors use Anthropic's shape on these
paths, also for auth failures and engine outages (see `on_api_error`); an error after the
stream started is an `error` event.
"""
from __future__ import annotations

import asyncio
import json

import falcon

from frontends.generate import ChoiceDone
from frontends.request_plumbing import GenerateRoute, choice_specs, json_response, prepare_chat
from frontends.worker import Worker, read_json, write_error
from metrale.api import anthropic_schema as schema
from metrale.api.errors import APIError
from metrale.api.reasoning_parser import ReasoningDelta
from metrale.api.tool_parsers import TextDelta, ToolArgsDelta, ToolCallEnd, ToolCallStart

PATH_PREFIX = "/v1/messages"


class Blocks:
    """Parsed chat events -> Anthropic content blocks and stream events."""

    def __init__(self, display: str = "summarized"):
        self.content: list[dict] = []
        self._open: str | None = None        # kind of the open block
        self._args: list[str] = []
        self._thought: list[str] = []        # text of the open thinking block
        self._show_thinking = display != "omitted"

    def feed(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, ReasoningDelta) and e.text:
                self._ensure(out, "thinking")
                self._thought.append(e.text)
                if self._show_thinking:
                    self.content[-1]["thinking"] += e.text
                    out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, TextDelta) and e.text:
                self._ensure(out, "text")
                self.content[-1]["text"] += e.text
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallStart):
                self._close(out)
                self._start(out, {"type": "tool_use", "id": schema.tool_use_id(e.id),
                                  "name": e.name, "input": {}})
                self._args = []
            elif isinstance(e, ToolArgsDelta):
                self._args.append(e.json_fragment)
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": e.json_fragment}))
            elif isinstance(e, ToolCallEnd):
                self._close(out)
        return out

    def close(self) -> list[dict]:
        out: list[dict] = []
        self._close(out)
        return out

    @property
    def num_calls(self) -> int:
        return sum(b["type"] == "tool_use" for b in self.content)

    def _ensure(self, out: list, kind: str) -> None:
        if self._open != kind:
            self._close(out)
            self._start(out, {"type": "text", "text": ""} if kind == "text" else
                        {"type": "thinking", "thinking": "", "signature": ""})

    def _start(self, out: list, block: dict) -> None:
        self._thought = []
        self.content.append(block)
        self._open = block["type"]
        out.append({"type": "content_block_start", "index": len(self.content) - 1,
                    "content_block": dict(block)})

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self, out: list) -> None:
        if self._open is None:
            return
        if self._open == "tool_use":
            self.content[-1]["input"] = json.loads("".join(self._args) or "{}")
        elif self._open == "thinking":
            signature = schema.thinking_signature("".join(self._thought))
            self.content[-1]["signature"] = signature
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
        out.append({"type": "content_block_stop", "index": len(self.content) - 1})
        self._open = None


def timed_out(done: ChoiceDone) -> APIError | None:
    """A request ended by --request-timeout: Anthropic's timeout_error (a 504, or the stream's
    `error` event after the blocks so far), never a max_tokens stop it did not reach."""
    if done.finish_reason != "timeout":
        return None
    return APIError(504, "the request ran past the server's --request-timeout before it "
                    "finished; retry, or ask for fewer tokens", type="timeout_error")


def stop_reason(done: ChoiceDone, num_calls: int) -> tuple[str, str | None]:
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    if num_calls:
        return "tool_use", None
    return "end_turn", None


class _Format:
    """What GenerateRoute._run needs for the non-streamed answer."""

    def __init__(self, model: str, display: str):
        self.id = schema.message_id()
        self.model = model
        self.display = display

    def response(self, result: dict, use: dict) -> dict:
        _, _, done, events = result[0]
        if (error := timed_out(done)) is not None:
            raise error
        blocks = Blocks(self.display)
        blocks.feed(events)
        blocks.close()
        reason, seq = stop_reason(done, blocks.num_calls)
        return schema.message(self.id, self.model, blocks.content, reason, seq, _usage(use))


def _usage(openai_usage: dict) -> dict:
    cached = openai_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return schema.usage(openai_usage["prompt_tokens"], openai_usage["completion_tokens"], cached)


class Messages(GenerateRoute):
    async def on_post(self, req, resp):
        info = await self.worker.ready_soon()
        body = await read_json(req, self.worker.settings)
        await self.worker.auto_swap(body, info["name"])
        mreq = schema.parse_messages_request(body, served=info["name"])
        p = await asyncio.to_thread(_prepare, self.worker, mreq)     # templating + tokenizing
        specs = choice_specs(self.worker, mreq, [p.ids], "messages", p.max_tokens_cap, p.plan,
                       p.sampling)
        await self._run(req, resp, mreq, specs, [p.ids],
                        _Format(info["name"], mreq.thinking_display))

    async def _stream(self, greq, specs, prompts, fmt, first, events):
        blocks = Blocks(fmt.display)
        num_prompt = len(specs[0].prompt_ids)
        start = schema.message(fmt.id, fmt.model, [], None, None, schema.usage(num_prompt, 0))
        try:
            yield schema.sse({"type": "message_start", "message": start})
            yield schema.sse({"type": "ping"})
            event = first
            while True:
                if isinstance(event, APIError):
                    yield schema.sse(schema.error_body(event))
                    break
                for e in blocks.feed(event.events or []):
                    yield schema.sse(e)
                if isinstance(event, ChoiceDone):
                    for e in blocks.close():
                        yield schema.sse(e)
                    if (error := timed_out(event)) is not None:
                        yield schema.sse(schema.error_body(error))
                        break
                    reason, seq = stop_reason(event, blocks.num_calls)
                    use = self._usage(specs, {event.index: event})
                    yield schema.sse({"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": _usage(use)})
                    yield schema.sse({"type": "message_stop"})
                    break
                event = await events.__anext__()
        except (ConnectionAbortedError, StopAsyncIteration):
            pass
        finally:
            await events.aclose()


class CountTokens(GenerateRoute):
    async def on_post(self, req, resp):
        info = await self.worker.ready_soon()
        body = await read_json(req, self.worker.settings)
        await self.worker.auto_swap(body, info["name"])
        mreq = schema.parse_messages_request(body, count_only=True, served=info["name"])
        p = await asyncio.to_thread(_prepare, self.worker, mreq)
        json_response(resp, {"input_tokens": len(p.ids)})


def _prepare(worker: Worker, mreq: schema.MessagesRequest):
    return prepare_chat(worker, mreq.messages, tools=mreq.tools, choice=mreq.tool_choice,
                        parallel=mreq.parallel_tool_calls, kwargs=mreq.chat_template_kwargs,
                        thinking_budget=mreq.thinking_budget,
                        response_format=mreq.response_format)


async def on_api_error(req, resp, e: APIError, params, **kwargs):
    """APIError -> the Anthropic shape on /v1/messages*, else the app's own (OpenAI) shape."""
    if not req.path.startswith(PATH_PREFIX):
        return write_error(req, resp, e)
    resp.status = schema.error_status(e)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = schema.error_json(e)
    resp.set_headers(e.headers)
    resp.stream = None


def add_routes(app, worker: Worker) -> None:
    app.add_route(PATH_PREFIX, Messages(worker))
    app.add_route(PATH_PREFIX + "/count_tokens", CountTokens(worker))
    app.add_error_handler(APIError, on_api_error)
