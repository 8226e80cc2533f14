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
    (metrale.thinking); models without single `<think>`/`</think>` tokens refuse a budget.
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
from dataclasses import dataclass

import falcon
import orjson

from frontends.app import Worker, read_json
from frontends.generate import (ChatPlan, ChoiceDone, ChoiceSpec, Generation, TokenInfo,
                                tool_prefill)
from metrale.api import errors
from metrale.api import openai_schema as schema
from metrale.api.errors import APIError
from metrale.api.reasoning import ReasoningDelta
from metrale.api.tool_parsers import (PARSERS, TextDelta, ToolArgsDelta, ToolCallStart,
                                      ToolChoice, collect, default_tool_parser)
from metrale.chat import ChatTemplateError, normalize_messages
from metrale.client import EngineUnavailable
from metrale.sampling import apply_generation_defaults

DONE = b"data: [DONE]\n\n"


def _json(resp, data: dict, status: int = 200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = orjson.dumps(data)


def _sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class _Resource:
    def __init__(self, worker: Worker):
        self.worker = worker

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    async def _object_body(self, req) -> tuple[dict, dict]:
        """(model info, the request's JSON object) for a route that names the served model."""
        info = self.worker.ready()
        body = await read_json(req, self.worker.settings)
        if not isinstance(body, dict):
            raise errors.invalid("the request body must be a JSON object")
        schema.check_model(body.get("model"), info["name"])
        return info, body

    async def _parsed(self, req, parse):
        """The request body through `parse` (a schema parser), its model checked."""
        info = self.worker.ready()
        parsed = parse(await read_json(req, self.worker.settings))
        schema.check_model(parsed.model, info["name"])
        return parsed


class Health(_Resource):
    async def on_get(self, req, resp):
        info = self.worker.ready()
        try:
            await self.worker.client.control("health")
        except EngineUnavailable as e:
            self.worker.engine_lost()
            raise errors.engine_unavailable(str(e))
        _json(resp, {"status": "ok", "model": info.get("name")})


class Metrics(_Resource):
    async def on_get(self, req, resp):
        self.worker.ready()
        try:
            stats = await self.worker.client.control("stats")
        except EngineUnavailable as e:
            raise errors.engine_unavailable(str(e))
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.text = stats["prometheus"]


class Models(_Resource):
    async def on_get(self, req, resp):
        info = self.worker.ready()
        _json(resp, schema.model_list(info["name"], int(info.get("created", 0)),
                                      info["max_seq_len"]))


# ---- tokenizer helpers ----------------------------------------------------------------------

class Tokenize(_Resource):
    async def on_post(self, req, resp):
        info, body = await self._object_body(req)
        ids = await asyncio.to_thread(self._tokenize, body)
        strs = [self.tokenizer.id_to_token(i) for i in ids] if body.get("return_token_strs") \
            else None
        _json(resp, {"count": len(ids), "max_model_len": info["max_seq_len"], "tokens": ids,
                     "token_strs": strs})

    def _tokenize(self, body: dict) -> list[int]:
        if "messages" in body:
            chat = schema.parse_chat_request({"messages": body["messages"],
                                              "add_generation_prompt":
                                                  body.get("add_generation_prompt", True)})
            text = _render_chat(self.worker, chat)
            return encode_prompt(self.worker, text, "messages", bool(
                body.get("add_special_tokens", False)))
        if isinstance(body.get("prompt"), str):
            return encode_prompt(self.worker, body["prompt"], "prompt", bool(
                body.get("add_special_tokens", True)))
        raise errors.invalid("send 'prompt' (a string) or 'messages' (a chat)", "prompt")


def encode_prompt(worker: Worker, text: str, param: str,
                  add_special_tokens: bool = True) -> list[int]:
    """`text` as token ids, refused (400) first when it is too big for the context to hold:
    tokenizing megabytes costs seconds that no answer but a 400 can come of. Call it off the
    event loop (asyncio.to_thread)."""
    limit = worker.max_prompt_bytes
    if len(text) > limit or (4 * len(text) > limit and
                             len(text.encode("utf-8", "surrogatepass")) > limit):
        raise APIError(400, f"the prompt is larger than this model's context can hold: more "
                       f"than {limit} bytes of text for {worker.info['max_seq_len']} tokens; "
                       "shorten it", param=param, code="context_length_exceeded")
    return worker.tokenizer.encode(text, add_special_tokens=add_special_tokens)


class Detokenize(_Resource):
    async def on_post(self, req, resp):
        _, body = await self._object_body(req)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in ids):
            raise errors.invalid("'tokens' must be an array of token ids", "tokens")
        _check_ids(self.worker, ids, "tokens")
        _json(resp, {"prompt": self.tokenizer.decode(ids)})


def _check_ids(worker: Worker, ids: list[int], param: str) -> None:
    vocab = worker.tokenizer.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise errors.invalid(f"token id {bad[0]} is out of range: this model's vocabulary has "
                             f"{vocab} ids (0..{vocab - 1})", param)


def _render_chat(worker: Worker, chat: schema.ChatRequest) -> str:
    return render_prompt(worker, chat.messages, chat.tools, chat.chat_template_kwargs,
                         chat.add_generation_prompt, chat.continue_final_message)


def render_prompt(worker: Worker, messages: list[dict], tools: list[dict] | None,
                  kwargs: dict, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
    template = worker.template
    if template is None:
        raise errors.invalid("this model has no chat template; use /v1/completions", "messages")
    kwargs = dict(kwargs)
    if worker.info.get("frontend", {}).get("disable_thinking"):
        kwargs["enable_thinking"] = False
    try:
        messages = normalize_messages(messages, template.content_format)
        return template.render(messages, tools=tools,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=kwargs)
    except ChatTemplateError as e:
        raise errors.invalid(str(e), "messages")


THINK_START, THINK_END, FORCED_CLOSE = "<think>", "</think>", "\n</think>\n\n"


def tool_parser_name(worker: Worker) -> str | None:
    info = worker.info
    return info.get("frontend", {}).get("tool_call_parser") or \
        default_tool_parser(info.get("model_type") or "")


def knows_reasoning(worker: Worker) -> bool:
    template = worker.template
    return any(THINK_START in src for src in template.sources.values()) or \
        worker.tokenizer.token_to_id(THINK_END) is not None


@dataclass
class PreparedChat:
    ids: list[int]             # the prompt (prefill included)
    plan: ChatPlan
    sampling: dict             # extra SamplingParams fields (thinking budget)
    max_tokens_cap: int | None


def prepare_chat(worker: Worker, messages: list[dict], *, tools: list[dict] | None,
                 choice: ToolChoice, parallel: bool = True, kwargs: dict | None = None,
                 thinking_budget: int | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> PreparedChat:
    """Render, decide how the output is read, and tokenize one chat request (both APIs)."""
    fs = worker.info.get("frontend", {})
    kwargs = dict(kwargs or {})
    parser = None
    if tools and choice.mode != "none":
        parser = tool_parser_name(worker)
        if parser is None:
            raise errors.invalid(
                f"tool calling is not configured for this model (model_type "
                f"{worker.info.get('model_type')!r} has no default tool-call format); restart "
                f"the server with --tool-call-parser ({', '.join(PARSERS)})", "tools")
    rendered_tools = tools if choice.mode != "none" else None
    text = render_prompt(worker, messages, rendered_tools, kwargs, add_generation_prompt,
                         continue_final_message)
    reasoning = knows_reasoning(worker)
    starts = reasoning and add_generation_prompt and text.rstrip().endswith(THINK_START)
    plan = ChatPlan(parser, rendered_tools, reasoning, starts, "", parallel)
    if parser and choice.mode == "required":
        plan.prefill = (THINK_END + "\n\n" if starts else "") + tool_prefill(parser, choice.name)
    sampling = {}
    budgets = [b for b in (thinking_budget, fs.get("max_thinking_budget")) if b is not None]
    if budgets and reasoning and not (plan.prefill and starts):
        end_id = worker.tokenizer.token_to_id(THINK_END)
        start_id = worker.tokenizer.token_to_id(THINK_START)
        if end_id is None or start_id is None:
            if thinking_budget is not None:
                raise errors.invalid("this model has no single <think> / </think> tokens, so a "
                                     "thinking budget cannot be enforced; drop the budget",
                                     "thinking")
        else:
            sampling = {"thinking_budget": min(budgets), "think_start_id": start_id,
                        "think_end_id": end_id, "starts_in_thinking": starts,
                        "forced_close_ids": worker.tokenizer.encode(
                            FORCED_CLOSE, add_special_tokens=False)}
    ids = encode_prompt(worker, text + plan.prefill, "messages", add_special_tokens=False)
    cap = fs.get("tool_max_tokens") if tools else None
    return PreparedChat(ids, plan, sampling, cap)
# ---- generation -----------------------------------------------------------------------------

def _specs(worker: Worker, greq: schema.GenerationParams, prompts: list[list[int]],
           param: str, max_tokens_cap: int | None = None, plan: ChatPlan | None = None,
           extra_sampling: dict | None = None) -> list[ChoiceSpec]:
    """Validated engine submissions: one per (prompt, choice)."""
    info = worker.info
    limit = info["max_seq_len"]
    _check_num_choices(info, len(prompts) * greq.n)
    specs = []
    for p, ids in enumerate(prompts):
        if not ids:
            raise errors.invalid("the prompt is empty (0 tokens)", param)
        if len(ids) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {len(ids)} tokens; shorten it", param=param,
                           code="context_length_exceeded")
        max_tokens = greq.max_tokens if greq.max_tokens is not None else limit - len(ids)
        if max_tokens_cap:
            max_tokens = min(max_tokens, max_tokens_cap)
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you "
                           f"asked for {len(ids) + max_tokens} ({len(ids)} in the prompt, "
                           f"{max_tokens} in the completion); lower max_tokens",
                           param="max_tokens", code="context_length_exceeded")
        fields = dict(greq.sampling, max_tokens=max_tokens, logprobs=greq.logprobs,
                      **(extra_sampling or {}))
        try:
            params = apply_generation_defaults(fields, info.get("generation_config"),
                                               info.get("sampling_defaults"))
        except ValueError as e:
            raise schema.sampling_error(e)
        for i in range(greq.n):
            d = params.to_dict()
            if params.seed is not None:
                d["seed"] = params.seed + i
            specs.append(ChoiceSpec(p * greq.n + i, ids, d, greq.stop, plan))
    return specs


def _check_num_choices(info: dict, num: int) -> None:
    """n x prompts sequences can never run at once past --max-num-seqs: 400, not a 429."""
    most = info.get("max_num_seqs")
    if most and num > most:
        raise errors.invalid(f"this request asks for {num} sequences (n x prompts) but the "
                             f"server runs at most {most} at once (--max-num-seqs); lower n",
                             "n")


class _Generate(_Resource):
    """What chat and completions share: run the specs, answer in JSON or SSE."""

    async def _run(self, req, resp, greq, specs: list[ChoiceSpec], prompts, fmt) -> None:
        budget = sum(len(s.prompt_ids) + s.params["max_tokens"] for s in specs)
        try:
            await self.worker.rate_limit(req, resp, budget)
        except EngineUnavailable as e:
            raise errors.engine_unavailable(str(e))
        gen = Generation(self.worker.client, self.tokenizer, specs,
                         req.scope.get("metrale.disconnected"))
        events = gen.events()
        try:
            first = await events.__anext__()
        except ConnectionAbortedError:
            await events.aclose()
            return
        if isinstance(first, APIError):
            await events.aclose()
            if first.status == 503:
                self.worker.engine_lost()
            raise first
        if greq.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = self._stream(greq, specs, prompts, fmt, first, events)
            return
        try:
            result = await self._collect(specs, first, events)
        except ConnectionAbortedError:
            return
        finally:
            await events.aclose()
        _json(resp, fmt.response(result, self._usage(specs, result)))

    async def _collect(self, specs, first, events) -> dict:
        texts = {s.index: [] for s in specs}
        tokens = {s.index: [] for s in specs}
        parsed = {s.index: [] for s in specs}
        done: dict[int, ChoiceDone] = {}
        event = first
        while True:
            if isinstance(event, APIError):
                raise event
            texts[event.index].append(event.text)
            tokens[event.index].extend(event.tokens)
            parsed[event.index].extend(event.events or ())
            if isinstance(event, ChoiceDone):
                done[event.index] = event
                if len(done) == len(specs):
                    break
            event = await events.__anext__()
        return {i: ("".join(texts[i]), tokens[i], done[i], parsed[i]) for i in texts}

    @staticmethod
    def _usage(specs, done_by_index) -> dict:
        prompt = cached = completion = 0
        seen = set()
        for s in specs:
            d = done_by_index[s.index][2] if isinstance(done_by_index[s.index], tuple) \
                else done_by_index[s.index]
            completion += d.num_output_tokens
            group = id(s.prompt_ids)
            if group not in seen:
                seen.add(group)
                prompt += d.num_prompt_tokens
                cached += d.num_cached_tokens
        return schema.usage(prompt, completion, cached)

    async def _stream(self, greq, specs, prompts, fmt, first, events):
        done: dict[int, ChoiceDone] = {}
        try:
            for chunk in fmt.start_chunks(specs):
                yield _sse(chunk)
            event = first
            while True:
                if isinstance(event, APIError):
                    yield _sse(event.body())
                    break
                if isinstance(event, ChoiceDone):
                    done[event.index] = event
                for chunk in fmt.chunks(event):
                    yield _sse(chunk)
                if len(done) == len(specs):
                    if greq.include_usage:
                        yield _sse(fmt.usage_chunk(self._usage(specs, done)))
                    break
                event = await events.__anext__()
            yield DONE
        except (ConnectionAbortedError, StopAsyncIteration):
            pass
        finally:
            await events.aclose()


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

    def _logprobs(self, tokens: list[TokenInfo]) -> list[dict] | None:
        if self.greq.logprobs is None:
            return None
        return [schema.chat_logprob(self.token_text(t.token_id), t.logprob,
                                    [(self.token_text(i), lp) for i, lp in t.top])
                for t in tokens if t.logprob is not None]

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

    def _logprobs(self, index: int, tokens: list[TokenInfo], lead: str = "") -> dict | None:
        if self.greq.logprobs is None:
            return None
        offset = self.offsets.get(index, 0) + len(lead)
        out = schema.completion_logprobs([], [], [], [])
        for t in tokens:
            text = self.token_text(t.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self.token_text(i): lp for i, lp in t.top})
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


class ChatCompletions(_Generate):
    async def on_post(self, req, resp):
        chat = await self._parsed(req, schema.parse_chat_request)
        p = await asyncio.to_thread(
            prepare_chat, self.worker, chat.messages, tools=chat.tools, choice=chat.tool_choice,
            parallel=chat.parallel_tool_calls, kwargs=chat.chat_template_kwargs,
            thinking_budget=chat.thinking_budget,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message)
        specs = _specs(self.worker, chat, [p.ids], "messages", p.max_tokens_cap, p.plan,
                       p.sampling)
        await self._run(req, resp, chat, specs, [p.ids], ChatFormat(self.worker, chat, [p.ids]))


class Completions(_Generate):
    async def on_post(self, req, resp):
        creq = await self._parsed(req, schema.parse_completion_request)
        token_lists = []
        for p in creq.prompts:
            if isinstance(p, str):
                token_lists.append(await asyncio.to_thread(encode_prompt, self.worker, p,
                                                           "prompt"))
            else:
                _check_ids(self.worker, p, "prompt")
                token_lists.append(p)
        specs = _specs(self.worker, creq, token_lists, "prompt")
        await self._run(req, resp, creq, specs, creq.prompts,
                        CompletionFormat(self.worker, creq, creq.prompts))


def add_routes(app, worker: Worker) -> None:
    from frontends import anthropic

    app.add_route("/health", Health(worker))
    app.add_route("/metrics", Metrics(worker))
    app.add_route("/v1/models", Models(worker))
    app.add_route("/v1/chat/completions", ChatCompletions(worker))
    app.add_route("/v1/completions", Completions(worker))
    app.add_route("/tokenize", Tokenize(worker))
    app.add_route("/detokenize", Detokenize(worker))
    anthropic.add_routes(app, worker)
