"""The HTTP routes of a frontend worker (OpenAI-compatible, plus vLLM's helpers).

    GET  /v1/models              the one served model
    POST /v1/chat/completions    chat (SSE when stream: true), tools and reasoning
    POST /v1/completions         legacy completions (SSE when stream: true)
    POST /v1/messages            Anthropic Messages (frontends.anthropic), + /count_tokens
    POST /tokenize, /detokenize  tokenizer round trip (vLLM's shapes)
    GET  /health                 200 serving, 503 loading or engine gone
    GET  /metrics                the engine's Prometheus text

A request is validated (metrale.api.openai_schema), rendered and tokenized here, rate-limited
through the engine, then run as a `Generation` (frontends.generate) whose events become either
one JSON response or an SSE stream.

Chat (both APIs) goes through `prepare_chat`: tools and tool_choice, the tool-call parser
(--tool-call-parser, else the model type's default), reasoning, the thinking budget and the
prefill that enforces tool_choice "required" / named (see frontends.generate.TOOL_PREFILLS):

  * tool_choice "none": tools are not rendered into the prompt and nothing is parsed as a call.
  * "required" / named: the assistant turn is prefilled with the call opening, e.g. hermes
    `<tool_call>\n` or `<tool_call>\n{"name": "NAME", "arguments": ` (after `</think>` when the
    prompt opened a think block: forced calls skip thinking). A model that then writes
    something unreadable gets its text back as content with finish_reason "stop".
  * tools with no parser for the model -> 400 naming --tool-call-parser.
  * reasoning is split off when the template or the vocabulary knows `<think>`; it stays on under
    --disable-thinking / enable_thinking=false (which only reach the template), so a model that
    thinks anyway never leaks its thoughts into the answer.
  * thinking budget: min(request, --max-thinking-budget); the request gives it as OpenAI
    `max_thinking_tokens` (or `chat_template_kwargs.thinking_budget`) or Anthropic
    `thinking.budget_tokens`. The engine forces "\n</think>\n\n" when it is used up
    (metrale.thinking_budget); models without single `<think>`/`</think>` tokens refuse a budget.
  * --tool-max-tokens caps max_tokens whenever tools are present.

Finish reasons (OpenAI routes): "stop", "length" (max_tokens or the context), "tool_calls",
"abort", and the extension "timeout": the request ran past `--request-timeout`; the text made
until then is in the response (or was streamed), and the stream ends normally with `[DONE]`.
The engine counts these in `metrale_request_timeouts_total`.

Request work that costs CPU time (rendering a chat template, tokenizing) runs in a thread, not
on the worker's event loop, so one huge prompt does not stall the worker's other streams; and a
prompt whose UTF-8 size is more than the context could hold (max_seq_len x the longest token's
bytes x 2) is refused with 400 `context_length_exceeded` before it is tokenized.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from frontends.generate import ChoiceDone, Token
from frontends.request_plumbing import (GenerateRoute, Resource, check_ids, choice_specs,
                                        encode_prompt, json_response, prepare_chat,
                                        render_chat)
from frontends.responses_store import ChatConversation
from frontends.worker import PROBE_TIMEOUT_S, Worker
from metrale import wire
from metrale.api import errors
from metrale.api import openai_schema as schema
from metrale.api.reasoning_parser import ReasoningDelta
from metrale.api.tool_parsers import TextDelta, ToolArgsDelta, ToolCallStart, collect
from metrale.client import EngineUnavailable


class Health(Resource):
    async def on_get(self, req, resp):
        info = self.worker.ready()
        try:
            health = await self.worker.client.control(wire.HealthCheck())
        except EngineUnavailable as e:
            self.worker.engine_lost()
            raise errors.engine_unavailable(str(e))
        if health.get("status", "ok") != "ok":      # a hot swap drains or loads
            raise errors.engine_unavailable(health.get("detail") or health["status"])
        json_response(resp, {"status": "ok", "model": info.get("name")})


class Metrics(Resource):
    async def on_get(self, req, resp):
        # whenever the engine answers: during a hot swap too, and before this worker has
        # fetched model_info (a short wait then: the engine may not be up yet)
        wait = None if self.worker.ready_info is not None else PROBE_TIMEOUT_S
        try:
            stats = await self.worker.client.control(wire.StatsQuery(), timeout_s=wait)
        except EngineUnavailable as e:
            raise errors.engine_unavailable(str(e))
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.text = stats["prometheus"]


class Models(Resource):
    async def on_get(self, req, resp):
        info = await self.worker.ready_soon()
        json_response(resp, schema.model_list(info["name"], int(info.get("created", 0)),
                                      info["max_seq_len"]))


# ---- tokenizer helpers ----------------------------------------------------------------------

class Tokenize(Resource):
    async def on_post(self, req, resp):
        info, body = await self._object_body(req)
        ids = await asyncio.to_thread(self._tokenize, body)
        strs = [self.tokenizer.id_to_token(i) for i in ids] if body.get("return_token_strs") \
            else None
        json_response(resp, {"count": len(ids), "max_model_len": info["max_seq_len"], "tokens": ids,
                     "token_strs": strs})

    def _tokenize(self, body: dict) -> list[int]:
        if "messages" in body:
            # vLLM's chat form of /tokenize: the prompt chat completions would render
            fields = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                      "continue_final_message")
            chat = schema.parse_chat_request({k: body[k] for k in fields if k in body})
            text = render_chat(self.worker, chat)
            return encode_prompt(self.worker, text, "messages", bool(
                body.get("add_special_tokens", False)))
        if isinstance(body.get("prompt"), str):
            return encode_prompt(self.worker, body["prompt"], "prompt", bool(
                body.get("add_special_tokens", True)))
        raise errors.invalid("send 'prompt' (a string) or 'messages' (a chat)", "prompt")


class Detokenize(Resource):
    async def on_post(self, req, resp):
        _, body = await self._object_body(req)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in ids):
            raise errors.invalid("'tokens' must be an array of token ids", "tokens")
        check_ids(self.worker, ids, "tokens")
        json_response(resp, {"prompt": self.tokenizer.decode(ids)})


class _Format:
    """Response shapes for one request (chat or completions)."""

    def __init__(self, worker: Worker, greq, prompts):
        self.worker = worker
        self.greq = greq
        self.prompts = prompts
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = worker.info["name"]
        self._include_usage = greq.stream and greq.include_usage

    def token_text(self, token_id: int) -> str:
        return self.worker.tokenizer.decode([token_id])

    def _wrap(self, chunk: dict) -> dict:
        if self._include_usage:
            chunk["usage"] = None
        return chunk


class ChatFormat(_Format):
    prefix = "chatcmpl"

    def _logprobs(self, tokens: list[Token]) -> list[dict] | None:
        if self.greq.logprobs is None:
            return None
        return [schema.chat_logprob(self.token_text(tid), lp.logprob,
                                    [(self.token_text(i), x) for i, x in lp.top_logprobs])
                for tid, lp in tokens if lp is not None]

    def start_chunks(self, specs):
        for s in specs:
            yield self._wrap(schema.chat_chunk(self.id, self.created, self.model, [
                schema.chat_chunk_choice(s.index, {"role": "assistant", "content": ""})]))

    def chunks(self, event) -> list[dict]:
        """The chunks of one event: one per run of reasoning / content / tool-call pieces, then
        (when the choice is done) one with finish_reason."""
        lps = self._logprobs(event.tokens)
        out = []
        for delta in _deltas(event.events or []):
            out.append(self._choice_chunk(event.index, delta, None, lps))
            lps = None
        if isinstance(event, ChoiceDone):
            out.append(self._choice_chunk(event.index, {}, openai_finish(event), lps))
        elif lps:
            out.append(self._choice_chunk(event.index, {}, None, lps))
        return out

    def _choice_chunk(self, index, delta, reason, lps) -> dict:
        return self._wrap(schema.chat_chunk(self.id, self.created, self.model, [
            schema.chat_chunk_choice(index, delta, reason, lps)]))

    def usage_chunk(self, use: dict) -> dict:
        return schema.chat_chunk(self.id, self.created, self.model, [], use)

    def response(self, result: dict, use: dict) -> dict:
        choices = []
        for i, (text, tokens, d, events) in sorted(result.items()):
            reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
            content, calls = collect(e for e in events if not isinstance(e, ReasoningDelta))
            choices.append(schema.chat_choice(
                i, None if calls and not content else content, openai_finish(d),
                self._logprobs(tokens),
                [schema.tool_call(c.id, c.name, c.arguments_json) for c in calls],
                reasoning or None))
        return schema.chat_completion(self.id, self.created, self.model, choices, use)


def openai_finish(done: ChoiceDone) -> str:
    """"tool_calls" only when the choice holds calls and ended by itself."""
    if done.num_calls and done.finish_reason == "stop":
        return "tool_calls"
    return done.finish_reason


def _deltas(events) -> list[dict]:
    """Chat events -> OpenAI chunk deltas, merging runs of reasoning or content text."""
    out: list[dict] = []
    for e in events:
        if isinstance(e, (ReasoningDelta, TextDelta)):
            key = "reasoning_content" if isinstance(e, ReasoningDelta) else "content"
            if out and list(out[-1]) == [key]:
                out[-1][key] += e.text
            elif e.text:
                out.append({key: e.text})
        elif isinstance(e, ToolCallStart):
            out.append({"tool_calls": [schema.tool_call_delta(e.index, e.id, e.name)]})
        elif isinstance(e, ToolArgsDelta):
            out.append({"tool_calls": [schema.tool_call_delta(e.index,
                                                              arguments=e.json_fragment)]})
    return out


class CompletionFormat(_Format):
    prefix = "cmpl"

    def __init__(self, worker, greq, prompts):
        super().__init__(worker, greq, prompts)
        self.offsets: dict[int, int] = {}

    def _echo(self, index: int) -> str:
        if not self.greq.echo:
            return ""
        prompt = self.prompts[index // self.greq.n]
        return prompt if isinstance(prompt, str) else self.worker.tokenizer.decode(prompt)

    def _logprobs(self, index: int, tokens: list[Token], lead: str = "") -> dict | None:
        if self.greq.logprobs is None:
            return None
        offset = self.offsets.get(index, 0) + len(lead)
        out = schema.completion_logprobs([], [], [], [])
        for tid, lp in tokens:
            text = self.token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append({} if lp is None else
                                       {self.token_text(i): x for i, x in lp.top_logprobs})
            out["text_offset"].append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return out

    def start_chunks(self, specs):
        for s in specs:
            echo = self._echo(s.index)
            if echo:
                yield self._wrap(schema.completion(self.id, self.created, self.model, [
                    schema.completion_choice(s.index, echo, None, self._logprobs(
                        s.index, [], echo))], None))

    def chunks(self, event) -> list[dict]:
        reason = event.finish_reason if isinstance(event, ChoiceDone) else None
        chunk = schema.completion(self.id, self.created, self.model, [
            schema.completion_choice(event.index, event.text, reason,
                                     self._logprobs(event.index, event.tokens))], None)
        del chunk["usage"]
        return [self._wrap(chunk)]

    def usage_chunk(self, use: dict) -> dict:
        return schema.completion(self.id, self.created, self.model, [], use)

    def response(self, result: dict, use: dict) -> dict:
        choices = []
        for i, (text, tokens, d, _) in sorted(result.items()):
            echo = self._echo(i)
            choices.append(schema.completion_choice(i, echo + text, d.finish_reason,
                                                    self._logprobs(i, tokens, echo)))
        return schema.completion(self.id, self.created, self.model, choices, use)


class ChatCompletions(GenerateRoute):
    async def on_post(self, req, resp):
        body: dict = {}
        chat = await self._parsed(req, lambda b: _kept(schema.parse_chat_request(b), b, body))
        conv = await ChatConversation.of(self.worker, req, body)   # conversation_id
        messages = conv.messages(chat.messages) if conv else chat.messages
        p = await asyncio.to_thread(
            prepare_chat, self.worker, messages, tools=chat.tools, choice=chat.tool_choice,
            parallel=chat.parallel_tool_calls, kwargs=chat.chat_template_kwargs,
            thinking_budget=chat.thinking_budget,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            response_format=chat.response_format)
        specs = choice_specs(self.worker, chat, [p.ids], "messages", p.max_tokens_cap, p.plan,
                       p.sampling)
        await self._run(req, resp, chat, specs, [p.ids], ChatFormat(self.worker, chat, [p.ids]),
                        conv.append if conv else None)


def _kept(parsed, raw: dict, into: dict):
    """`parsed`, with the raw body kept in `into` (for the extensions read beside it)."""
    into.update(raw)
    return parsed


class Completions(GenerateRoute):
    async def on_post(self, req, resp):
        creq = await self._parsed(req, schema.parse_completion_request)
        token_lists = []
        for p in creq.prompts:
            if isinstance(p, str):
                token_lists.append(await asyncio.to_thread(encode_prompt, self.worker, p,
                                                           "prompt"))
            else:
                check_ids(self.worker, p, "prompt")
                token_lists.append(p)
        specs = choice_specs(self.worker, creq, token_lists, "prompt")
        await self._run(req, resp, creq, specs, creq.prompts,
                        CompletionFormat(self.worker, creq, creq.prompts))


def add_routes(app, worker: Worker) -> None:
    """The OpenAI routes and the helpers (the Anthropic ones: frontends.anthropic)."""
    app.add_route("/health", Health(worker))
    app.add_route("/metrics", Metrics(worker))
    app.add_route("/v1/models", Models(worker))
    app.add_route("/v1/chat/completions", ChatCompletions(worker))
    app.add_route("/v1/completions", Completions(worker))
    app.add_route("/tokenize", Tokenize(worker))
    app.add_route("/detokenize", Detokenize(worker))
