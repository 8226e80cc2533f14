"""POST /v1/responses: the OpenAI Responses API on the chat path.

A request (metrale.api.responses_schema) becomes a chat request: the context (the stored chain
of `previous_response_id`, or the items of `conversation`) and the input become chat messages,
and it runs through prepare_chat / choice_specs / Generation like /v1/chat/completions, so tool
parsing, reasoning, the thinking budget and `text.format` (chat's `response_format`) behave
the same. The parsed chat events become output items (`OutputBuilder`):

    reasoning   <think> text: a `reasoning` item, content [{"type": "reasoning_text"}]
    message     the answer: a `message` item, content [{"type": "output_text"}]
    calls       a `function_call` item per call (`custom_tool_call` for a custom tool)

One async generator (`_Run.events`) makes the whole event sequence, created -> in_progress ->
per item output_item.added, content_part.added, the deltas, the .done events, output_item.done
-> completed / incomplete (max_output_tokens) / failed; the stream sends it, a plain request
answers its last event's response and a background one stores it, so a stream and the final
object cannot disagree. The response is stored (`store`, default true) and its turn appended
to the conversation before the terminal event leaves: what a client was told is durable.

`truncation: "auto"` drops the oldest context messages until the prompt fits; "disabled"
(the default) answers 400 context_length_exceeded. `background: true` answers at once with
status "queued" and runs in this worker; POST /v1/responses/{id}/cancel (any worker: the
engine's store aborts the engine requests) ends it as "cancelled".
"""
from __future__ import annotations

import asyncio
import logging
import time

import orjson

from frontends import responses_store
from frontends.generate import ChoiceDone, Generation
from frontends.request_plumbing import Resource, choice_specs, json_response, prepare_chat
from frontends.responses_store import conversation_items, store
from frontends.worker import Worker, read_json
from metrale.api import errors
from metrale.api import openai_schema as schema
from metrale.api import responses_schema as rs
from metrale.api.errors import APIError
from metrale.api.reasoning_parser import ReasoningDelta
from metrale.api.tool_parsers import TextDelta, ToolArgsDelta, ToolCallEnd, ToolCallStart
from metrale.client import EngineUnavailable

log = logging.getLogger("metrale.frontend")
_BACKGROUND: set[asyncio.Task] = set()      # background responses running in this worker


def _copy(obj):
    return orjson.loads(orjson.dumps(obj))


class OutputBuilder:
    """Parsed chat events -> output items and the stream events that build them."""

    def __init__(self, custom_tools=frozenset(), encrypted: bool = False):
        self.custom_tools = custom_tools
        self.encrypted = encrypted
        self.seq = 0
        self.output: list[dict] = []
        self.item: dict | None = None     # the item being built (the last of output)
        self.pending = ""                 # whitespace not yet given to a message

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output) - 1}

    def feed(self, chat_events) -> list[dict]:
        out: list[dict] = []
        for e in chat_events:
            if isinstance(e, ReasoningDelta):
                out += self._reasoning(e.text)
            elif isinstance(e, TextDelta):
                out += self._text(e.text)
            elif isinstance(e, ToolCallStart):
                out += self.close() + self._call(e)
            elif isinstance(e, ToolArgsDelta) and self.item is not None:
                out += self._args(e.json_fragment)
            elif isinstance(e, ToolCallEnd):
                out += self.close()
        return out

    def _open(self, item: dict, part: dict | None) -> list[dict]:
        self.output.append(item)
        self.item = item
        out = [self.event("response.output_item.added", output_index=len(self.output) - 1,
                          item=_copy(item))]
        if part is not None:
            item["content"].append(part)
            out.append(self.event("response.content_part.added", **self._at(), content_index=0,
                                  part=_copy(part)))
        return out

    def _kind(self) -> str | None:
        return None if self.item is None else self.item["type"]

    def _reasoning(self, text: str) -> list[dict]:
        if not text:
            return []
        out = []
        if self._kind() != "reasoning":
            out = self.close() + self._open(
                {"id": rs.new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                 "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self.item["content"][0]["text"] += text
        return out + [self.event("response.reasoning_text.delta", **self._at(), content_index=0,
                                 delta=text)]

    def _text(self, text: str) -> list[dict]:
        out = []
        if self._kind() != "message":
            text, self.pending = self.pending + text, ""
            if not text.strip():
                self.pending = text         # whitespace between blocks opens no message
                return []
            text = text.lstrip()
            out = self.close() + self._open(
                {"id": rs.new_id("msg"), "type": "message", "role": "assistant",
                 "status": "in_progress", "content": []},
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.item["content"][0]["text"] += text
        return out + [self.event("response.output_text.delta", **self._at(), content_index=0,
                                 delta=text, logprobs=[])]

    def _call(self, e: ToolCallStart) -> list[dict]:
        if e.name in self.custom_tools:
            item = {"id": rs.new_id("ctc"), "type": "custom_tool_call", "call_id": e.id,
                    "name": e.name, "input": "", "status": "in_progress"}
        else:
            item = {"id": rs.new_id("fc"), "type": "function_call", "call_id": e.id,
                    "name": e.name, "arguments": "", "status": "in_progress"}
        self._args_text = ""
        return self._open(item, None)

    def _args(self, fragment: str) -> list[dict]:
        self._args_text += fragment
        if self._kind() != "function_call":
            return []                    # a custom tool's input is sent whole at its end
        self.item["arguments"] += fragment
        return [self.event("response.function_call_arguments.delta", **self._at(),
                           delta=fragment)]

    def close(self, status: str = "completed") -> list[dict]:
        """The .done events of the item being built, if any."""
        item, kind = self.item, self._kind()
        if item is None:
            return []
        at = self._at()
        out = []
        if kind in ("message", "reasoning"):
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else \
                "response.reasoning_text.done"
            extra = {"logprobs": _copy(part["logprobs"])} if kind == "message" else {}
            out += [self.event(done, **at, content_index=0, text=part["text"], **extra),
                    self.event("response.content_part.done", **at, content_index=0,
                               part=_copy(part))]
            if kind == "reasoning" and self.encrypted:
                item["encrypted_content"] = rs.encrypt_reasoning(part["text"])
        elif kind == "function_call":
            out.append(self.event("response.function_call_arguments.done", **at,
                                  arguments=item["arguments"]))
        else:
            item["input"] = _custom_input(self._args_text)
            out += [self.event("response.custom_tool_call_input.delta", **at,
                               delta=item["input"]),
                    self.event("response.custom_tool_call_input.done", **at,
                               input=item["input"])]
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=at["output_index"],
                              item=_copy(item)))
        self.item = None
        return out


def _custom_input(arguments: str) -> str:
    """A custom tool's free-form input from the {"input": ...} it was offered as."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


class _Run:
    """One response being made: its request, ids, the prompt's specs and the output so far."""

    def __init__(self, worker: Worker, req, r: rs.ResponsesRequest, specs, context_len: int):
        self.worker, self.req, self.r, self.specs = worker, req, r, specs
        self.id = rs.new_id("resp")
        self.created_at = int(time.time())
        self.model = worker.info["name"]
        self.engine_id = self.id.split("_", 1)[1]       # engine request ids: f"{engine_id}-0"
        self.builder = OutputBuilder(r.custom_tools, rs.ENCRYPTED in r.include)
        self.context_len = context_len
        self.logprobs = rs.LOGPROBS in r.include or r.top_logprobs is not None

    def response(self, status: str, **extra) -> dict:
        r = self.r
        obj = {"id": self.id, "object": "response", "created_at": self.created_at,
               "status": status, "background": r.background, "error": None,
               "incomplete_details": None, "instructions": r.instructions,
               "max_output_tokens": r.max_output_tokens, "model": self.model,
               "output": _copy(self.builder.output), "parallel_tool_calls": r.parallel_tool_calls,
               "previous_response_id": r.previous_response_id,
               "conversation": {"id": r.conversation_id} if r.conversation_id else None,
               "reasoning": r.reasoning or {"effort": None, "summary": None},
               "store": r.store, "temperature": r.temperature, "text": r.text,
               "tool_choice": r.tool_choice, "tools": r.tools, "top_p": r.top_p,
               "top_logprobs": r.top_logprobs, "truncation": r.truncation, "usage": None,
               "user": r.user, "metadata": r.metadata, "completed_at": None}
        obj.update(extra)
        return obj

    async def save(self, response: dict) -> dict:
        """Store the response and append its turn to the conversation (durable when this
        returns); the stored record wins over ours when a cancel came first."""
        if not self.r.store and not self.r.conversation_id:
            return response
        data = await store(self.worker, self.req, "response.put", response=response,
                           input_items=self.r.input_items, store=self.r.store,
                           conversation_id=self.r.conversation_id,
                           conversation_items=self.r.input_items + response["output"],
                           request_ids=[f"{self.engine_id}-0"])
        return data["response"]

    def _attach_logprobs(self, out: list[dict], tokens) -> None:
        """The tokens of a piece of output, on its text delta and its output_text part (the
        tokens of a piece that held reasoning too are all given to the text)."""
        deltas = [e for e in out if e["type"] == "response.output_text.delta"]
        if not deltas or not tokens:
            return
        text = self.worker.tokenizer.decode
        lps = [schema.chat_logprob(text([tid]), lp.logprob,
                                   [(text([i]), x) for i, x in lp.top_logprobs])
               for tid, lp in tokens if lp is not None]
        deltas[-1]["logprobs"] = lps
        item = next(i for i in self.builder.output if i["id"] == deltas[-1]["item_id"])
        item["content"][0]["logprobs"] += _copy(lps)

    def _usage(self, done: ChoiceDone) -> dict:
        reasoning = "".join(i["content"][0]["text"] for i in self.builder.output
                            if i["type"] == "reasoning")
        n_reasoning = len(self.worker.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        return {"input_tokens": done.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": done.num_cached_tokens},
                "output_tokens": done.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": min(n_reasoning,
                                                                  done.num_output_tokens)},
                "total_tokens": done.num_prompt_tokens + done.num_output_tokens}

    def _final(self, done: ChoiceDone) -> tuple[str, str, dict]:
        """(the terminal event type, the status, the final response's fields) of a finished
        choice."""
        extra = {"usage": self._usage(done), "completed_at": int(time.time())}
        reason = done.finish_reason
        if reason == "length":
            return "response.incomplete", "incomplete", {
                **extra, "incomplete_details": {"reason": "max_output_tokens"}}
        if reason == "abort":
            return "response.failed", "cancelled", extra
        if reason == "timeout":
            return "response.failed", "failed", {**extra, "error": {
                "code": "server_error", "message": "the response ran past the server's "
                "--request-timeout"}}
        return "response.completed", "completed", extra

    async def events(self, first, events):
        """The whole event sequence (see the module docstring); an APIError from the engine
        ends it with response.failed (the error rides along as `_error`)."""
        b = self.builder
        yield b.event("response.created", response=self.response("in_progress"))
        yield b.event("response.in_progress", response=self.response("in_progress"))
        event = first
        while True:
            if isinstance(event, APIError):
                for e in b.close("incomplete"):
                    yield e
                failed = self.response("failed", error={"code": "server_error",
                                                        "message": event.message})
                yield {**b.event("response.failed", response=await self.save(failed)),
                       "_error": event}
                return
            out = b.feed(event.events or ())
            if self.logprobs:
                self._attach_logprobs(out, event.tokens)
            for e in out:
                yield e
            if isinstance(event, ChoiceDone):
                break
            event = await events.__anext__()
        kind, status, extra = self._final(event)
        for e in b.close("incomplete" if status == "incomplete" else "completed"):
            yield e
        final = await self.save(self.response(status, **extra))
        yield b.event("response.failed" if final["status"] == "cancelled" else kind,
                      response=final)


class Responses(Resource):
    async def on_post(self, req, resp):
        info = await self.worker.ready_soon()
        body = await read_json(req, self.worker.settings)
        r = rs.parse_request(body)
        schema.check_model(r.model, info["name"])
        context = await self._context(req, r)
        specs = await asyncio.to_thread(self._specs, r, context)
        run = _Run(self.worker, req, r, specs, len(context))
        budget = sum(len(s.prompt_ids) + s.params.max_tokens for s in specs)
        try:
            await self.worker.rate_limit(req, resp, budget)
        except EngineUnavailable as e:
            raise errors.engine_unavailable(str(e))
        if r.background:
            return await self._background(resp, run)

        gen = Generation(self.worker.client, self.tokenizer, specs,
                         req.scope.get("metrale.disconnected"), request_id=run.engine_id)
        events = gen.events()
        first = await _first(self.worker, events)
        if first is None:
            return
        flow = run.events(first, events)
        if r.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = _sse(flow, events, run.builder)
            return
        try:
            last = None
            async for last in flow:
                pass
        except ConnectionAbortedError:
            return
        finally:
            await events.aclose()
        if "_error" in last:
            raise last["_error"]
        json_response(resp, last["response"])

    async def _context(self, req, r: rs.ResponsesRequest) -> list[dict]:
        if r.previous_response_id:
            try:
                data = await store(self.worker, req, "response.context",
                                   id=r.previous_response_id)
            except APIError as e:
                if e.status == 404:
                    e.param = "previous_response_id"
                raise
            return data["items"]
        if r.conversation_id:
            return await conversation_items(self.worker, req, r.conversation_id)
        return []

    def _specs(self, r: rs.ResponsesRequest, context: list[dict]):
        """The engine submissions of the request; with truncation "auto" the oldest context
        messages are dropped until the prompt fits."""
        head = [{"role": "system", "content": r.instructions}] if r.instructions else []
        messages = rs.merge_system(head + rs.items_to_messages(context + r.input_items))
        head = messages[:1] if messages and messages[0]["role"] == "system" else []
        messages = messages[len(head):]         # what truncation may drop
        while True:
            try:
                chat = schema.parse_chat_request(rs.chat_body(r, head + messages))
                p = prepare_chat(self.worker, chat.messages, tools=chat.tools,
                                 choice=chat.tool_choice, parallel=chat.parallel_tool_calls,
                                 kwargs=chat.chat_template_kwargs,
                                 thinking_budget=chat.thinking_budget,
                                 response_format=chat.response_format)   # text.format
                return choice_specs(self.worker, chat, [p.ids], "input", p.max_tokens_cap,
                                    p.plan, p.sampling)
            except APIError as e:
                if e.code != "context_length_exceeded" or r.truncation != "auto" \
                        or len(messages) <= 1:
                    if e.param and e.param.startswith("messages"):
                        e.param = "input"
                    elif e.param and e.param.startswith("response_format"):
                        e.param = "text.format" + e.param[len("response_format"):]
                    raise
                messages = _drop_oldest(messages)

    async def _background(self, resp, run: _Run) -> None:
        """Stored as "queued", answered at once (or streamed: the stream follows the run, and
        the run goes on when the client leaves)."""
        queued = await run.save(run.response("queued"))
        follow = asyncio.Queue() if run.r.stream else None
        task = asyncio.get_running_loop().create_task(self._finish_background(run, follow))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        if follow is None:
            json_response(resp, queued)
            return
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.stream = _followed(follow)

    async def _finish_background(self, run: _Run, follow: asyncio.Queue | None) -> None:
        gen = Generation(self.worker.client, self.tokenizer, run.specs, None,
                         request_id=run.engine_id)
        events = gen.events()
        try:
            first = await events.__anext__()
            async for event in run.events(first, events):
                if follow is not None:
                    follow.put_nowait(event)
        except Exception:       # noqa: BLE001 - logged; the stored record says "failed"
            log.exception("background response %s failed", run.id)
            try:
                await run.save(run.response("failed", error={
                    "code": "server_error", "message": "the server failed while making this "
                    "response (logged by the frontend)"}))
            except Exception:   # noqa: BLE001 - the engine is gone too: nothing to store in
                log.exception("could not store the failure of %s", run.id)
        finally:
            await events.aclose()
            if follow is not None:
                follow.put_nowait(None)


async def _followed(follow: asyncio.Queue):
    """A background run's events as SSE, until its end (None)."""
    while (event := await follow.get()) is not None:
        yield _sse_bytes(event)


def _drop_oldest(messages: list[dict]) -> list[dict]:
    """Without the oldest message (and the tool results it leaves without their call)."""
    rest = messages[1:]
    while len(rest) > 1 and rest[0]["role"] == "tool":
        rest = rest[1:]
    return rest


async def _first(worker: Worker, events):
    """The generation's first event; an APIError is raised (an HTTP error, not a stream), None
    when the client went away."""
    try:
        first = await events.__anext__()
    except ConnectionAbortedError:
        await events.aclose()
        return None
    if isinstance(first, APIError):
        await events.aclose()
        if first.status == 503:
            worker.engine_lost()
        raise first
    return first


def _sse_bytes(event: dict) -> bytes:
    event = {k: v for k, v in event.items() if k != "_error"}
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _sse(flow, events, builder: OutputBuilder):
    try:
        async for event in flow:
            yield _sse_bytes(event)
    except (ConnectionAbortedError, StopAsyncIteration):
        pass
    except APIError as e:          # the store refused or the engine went away at the end
        body = builder.event("error", code=e.code or e.type, message=e.message, param=e.param)
        yield b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
    finally:
        await events.aclose()


def add_routes(app, worker: Worker) -> None:
    """/v1/responses and the stored objects' routes (frontends.responses_store)."""
    app.add_route("/v1/responses", Responses(worker))
    responses_store.add_routes(app, worker)
