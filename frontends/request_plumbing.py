"""What the generating routes of both APIs share (OpenAI chat and completions, Anthropic
messages): the prompt (rendered with the chat template, tokenized off the event loop, refused
early when it cannot fit the context), `prepare_chat` (tools, reasoning, the thinking budget and
the tool_choice prefill: frontends.routes' docstring has the rules), the choice specs sent to
the engine, and `GenerateRoute`, which runs them and answers in JSON or SSE.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import falcon
import orjson

from frontends.generate import ChatPlan, ChoiceDone, ChoiceSpec, Generation, tool_prefill
from frontends.worker import Worker, read_json
from metrale.api import errors
from metrale.api import openai_schema as schema
from metrale.api.errors import APIError
from metrale.api.reasoning_parser import ReasoningDelta
from metrale.api.tool_parsers import PARSERS, ToolChoice, collect, default_tool_parser
from metrale.chat import ChatTemplateError, normalize_messages
from metrale.client import EngineUnavailable
from metrale.grammar import (GrammarError, ToolGrammarPlan, grammar_for_response_format,
                             tool_call_grammar, wants_tool_grammar)
from metrale.request import ContextLengthExceeded, as_token_ids, check_context_length
from metrale.sampling import apply_generation_defaults

DONE = b"data: [DONE]\n\n"


def json_response(resp, data: dict, status: int = 200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = orjson.dumps(data)


def sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class Resource:
    def __init__(self, worker: Worker):
        self.worker = worker

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    async def _object_body(self, req) -> tuple[dict, dict]:
        """(model info, the request's JSON object) for a route that names the served model."""
        info = await self.worker.ready_soon()
        body = await read_json(req, self.worker.settings)
        if not isinstance(body, dict):
            raise errors.invalid("the request body must be a JSON object")
        await self.worker.auto_swap(body, info["name"])
        schema.check_model(body.get("model"), info["name"])
        return info, body

    async def _parsed(self, req, parse):
        """The request body through `parse` (a schema parser), its model checked."""
        info = await self.worker.ready_soon()
        body = await read_json(req, self.worker.settings)
        await self.worker.auto_swap(body, info["name"])
        parsed = parse(body)
        schema.check_model(parsed.model, info["name"])
        return parsed


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



def check_ids(worker: Worker, ids: list[int], param: str) -> None:
    vocab = worker.tokenizer.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise errors.invalid(f"token id {bad[0]} is out of range: this model's vocabulary has "
                             f"{vocab} ids (0..{vocab - 1})", param)


def render_chat(worker: Worker, chat: schema.ChatRequest) -> str:
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
                 continue_final_message: bool = False,
                 response_format: dict | None = None) -> PreparedChat:
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
    think = _think_ids(worker, starts) if reasoning and not plan.prefill else {}
    grammar = chat_grammar(worker, plan, choice, response_format, bool(think))
    if grammar is not None:
        sampling["grammar"] = grammar
        if "think_end_id" not in sampling:
            sampling.update(think)          # the grammar applies after </think>
    ids = encode_prompt(worker, text + plan.prefill, "messages", add_special_tokens=False)
    cap = fs.get("tool_max_tokens") if tools else None
    return PreparedChat(ids, plan, sampling, cap)


def _think_ids(worker: Worker, starts: bool) -> dict:
    end_id = worker.tokenizer.token_to_id(THINK_END)
    if end_id is None:
        return {}
    return {"think_start_id": worker.tokenizer.token_to_id(THINK_START), "think_end_id": end_id,
            "starts_in_thinking": starts}


def chat_grammar(worker: Worker, plan: ChatPlan, choice: ToolChoice,
                 response_format: dict | None, thinks: bool = False) -> str | None:
    """The grammar of a chat request (metrale.grammar): its tool calls under --tool-grammar
    (hermes-style formats), else its response_format; None when unconstrained. 400 naming what
    cannot be enforced."""
    mode = worker.info.get("frontend", {}).get("tool_grammar") or "auto"
    try:
        forcing = choice.mode == "required"
        if plan.tool_parser and wants_tool_grammar(mode, plan.tools, plan.tool_parser, forcing):
            forced = None if choice.mode != "required" else (choice.name or "any")
            return tool_call_grammar(plan.tools, ToolGrammarPlan(forced, plan.parallel),
                                     plan.tool_parser,
                                     *(_tag(worker, t) for t in ("<tool_call>", "</tool_call>")))
        return grammar_for_response_format(response_format, leading_space=thinks)
    except GrammarError as e:
        raise errors.invalid(str(e), e.param) from None


def _tag(worker: Worker, text: str) -> str:
    """How a grammar names a tool-call tag: as the token when the vocabulary adds it as one,
    else as its text."""
    tid = worker.tokenizer.token_to_id(text)
    added = tid is not None and tid in worker.tokenizer.backend.get_added_tokens_decoder()
    return text if added else '"' + text + '"'
def choice_specs(worker: Worker, greq: schema.GenerationParams, prompts: list[list[int]],
           param: str, max_tokens_cap: int | None = None, plan: ChatPlan | None = None,
           extra_sampling: dict | None = None) -> list[ChoiceSpec]:
    """Validated engine submissions: one per (prompt, choice)."""
    info = worker.info
    limit = info["max_seq_len"]
    _check_num_choices(info, len(prompts) * greq.n)
    specs = []
    for p, ids in enumerate(prompts):
        if not len(ids):
            raise errors.invalid("the prompt is empty (0 tokens)", param)
        ids = as_token_ids(ids)     # the type it has from here to the scheduler
        max_tokens = greq.max_tokens if greq.max_tokens is not None else limit - len(ids)
        if max_tokens_cap:
            max_tokens = min(max_tokens, max_tokens_cap)
        try:
            check_context_length(len(ids), limit, max_tokens)
        except ContextLengthExceeded as e:
            raise APIError(400, str(e), param=param if e.param == "prompt" else "max_tokens",
                           code="context_length_exceeded") from None
        fields = dict(greq.sampling, max_tokens=max_tokens, logprobs=greq.logprobs,
                      **(extra_sampling or {}))
        if plan is None and greq.response_format is not None:      # completions
            fields["grammar"] = _response_grammar(greq.response_format)
        try:
            params = apply_generation_defaults(fields, info.get("generation_config"),
                                               info.get("sampling_defaults"))
        except ValueError as e:
            raise schema.sampling_error(e)
        for i in range(greq.n):
            choice = params if params.seed is None else replace(params, seed=params.seed + i)
            specs.append(ChoiceSpec(p * greq.n + i, ids, choice, greq.stop, plan))
    return specs


def _response_grammar(response_format: dict) -> str | None:
    try:
        return grammar_for_response_format(response_format)
    except GrammarError as e:
        raise errors.invalid(str(e), e.param) from None


def _check_num_choices(info: dict, num: int) -> None:
    """n x prompts sequences can never run at once past --max-num-seqs: 400, not a 429."""
    most = info.get("max_num_seqs")
    if most and num > most:
        raise errors.invalid(f"this request asks for {num} sequences (n x prompts) but the "
                             f"server runs at most {most} at once (--max-num-seqs); lower n",
                             "n")


def answer_of(events) -> dict:
    """A choice's parsed events as the assistant message they make (content,
    reasoning_content, tool_calls)."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content, calls = collect(e for e in events if not isinstance(e, ReasoningDelta))
    return {"content": content or None, "reasoning_content": reasoning or None,
            "tool_calls": [schema.tool_call(c.id, c.name, c.arguments_json) for c in calls]}


class GenerateRoute(Resource):
    """What chat and completions share: run the specs, answer in JSON or SSE."""

    async def _run(self, req, resp, greq, specs: list[ChoiceSpec], prompts, fmt,
                   on_done=None) -> None:
        """`on_done(answer)`: awaited with choice 0's assistant message (`answer_of`) before
        the response or the stream's end leaves (a conversation_id appends its turn)."""
        budget = sum(len(s.prompt_ids) + s.params.max_tokens for s in specs)
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
            extra = {"on_done": on_done} if on_done is not None else {}  # (anthropic's _stream)
            resp.stream = self._stream(greq, specs, prompts, fmt, first, events, **extra)
            return
        try:
            result = await self._collect(specs, first, events)
        except ConnectionAbortedError:
            return
        finally:
            await events.aclose()
        if on_done is not None:
            await on_done(answer_of(result[0][3]))
        json_response(resp, fmt.response(result, self._usage(specs, result)))

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

    async def _stream(self, greq, specs, prompts, fmt, first, events, on_done=None):
        done: dict[int, ChoiceDone] = {}
        answer = []                      # choice 0's parsed events, for on_done
        try:
            for chunk in fmt.start_chunks(specs):
                yield sse(chunk)
            event = first
            while True:
                if isinstance(event, APIError):
                    yield sse(event.body())
                    break
                if isinstance(event, ChoiceDone):
                    done[event.index] = event
                if on_done is not None and event.index == 0:
                    answer.extend(event.events or ())
                for chunk in fmt.chunks(event):
                    yield sse(chunk)
                if len(done) == len(specs):
                    if greq.include_usage:
                        yield sse(fmt.usage_chunk(self._usage(specs, done)))
                    if on_done is not None:
                        try:
                            await on_done(answer_of(answer))
                        except APIError as e:
                            yield sse(e.body())
                    break
                event = await events.__anext__()
            yield DONE
        except (ConnectionAbortedError, StopAsyncIteration):
            pass
        finally:
            await events.aclose()

