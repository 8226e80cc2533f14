"""One API request's generations: n choices (times prompts), each an engine request, turned
into text events with stop strings applied.

    gen = Generation(client, choices, disconnected)
    async for event in gen.events():     # ChoiceText / ChoiceDone / APIError, in arrival order
        ...

Each choice runs as its own task reading `AsyncEngineClient.generate`; their events meet in one
queue. Closing the iterator (the response finished, a stop string matched, the client went
away) cancels the tasks, which closes their engine generators, which aborts the requests in the
engine: no slot is held for output nobody will read.

Stop strings are matched here, on detokenized text (the engine sees only token ids). Text that
could still be the start of a stop string is held back; the stop string itself is never sent.

Chat choices carry a `ChatPlan`: their text (after stop strings) also runs through one
`ChatOutputParser` per choice (reasoning split first, then the tool-call parser on the content
only), and every ChoiceText / ChoiceDone carries the parsed `events`. The non-streamed response
is the fold of the same events the stream sends, so the two cannot disagree. A `prefill` (text
the frontend appended to the prompt to force a tool call) is fed to the parser before the output.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import numpy as np

from metrale.api import errors
from metrale.api.errors import APIError
from metrale.api.reasoning_parser import ChatOutputParser, ReasoningParser
from metrale.api.tool_parsers import (ToolArgsDelta, ToolCallEnd, ToolCallStart,
                                      make_tool_parser, marker_tokens)
from metrale.client import AsyncEngineClient, EngineUnavailable
from metrale.sampling import SamplingParams
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer
from metrale.wire import TokenDelta, TokenLogprob


# How `tool_choice` "required" / a named function is enforced: the assistant turn is prefilled
# with the format's call opening (appended to the rendered prompt after the generation prompt),
# so the model can only continue inside a call; the prefill is parsed together with the output.
# parser -> (any call, one named call: "{name}" is replaced)
TOOL_PREFILLS = {
    "hermes": ("<tool_call>\n", '<tool_call>\n{{"name": "{name}", "arguments": '),
    "poolside_v1": ("<tool_call>\n", '<tool_call>\n{{"name": "{name}", "arguments": '),
    "qwen3_coder": ("<tool_call>\n", "<tool_call>\n<function={name}>\n"),
    "qwen3_xml": ("<tool_call>\n", "<tool_call>\n<function={name}>\n"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{{"name": "{name}", "arguments": '),
    "minimax_xml": ("<minimax:tool_call>\n", '<minimax:tool_call>\n<invoke name="{name}">\n'),
    "bare_json": ('{"name": "', '{{"name": "{name}", "arguments": '),
    "gemma4": ("<|tool_call>call:", "<|tool_call>call:{name}{{"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"),
}


def tool_prefill(parser: str, name: str | None) -> str:
    """The assistant text that forces a call (any declared one, or `name`)."""
    any_call, named = TOOL_PREFILLS[parser]
    return named.format(name=name) if name else any_call


@dataclass
class ChatPlan:
    """How a chat choice's text is read (see the module docstring)."""
    tool_parser: str | None = None     # a metrale.api.tool_parsers name; None = no tool parsing
    tools: list[dict] | None = None    # OpenAI-shaped declared tools
    reasoning: bool = False            # split <think> ... </think> off the answer
    starts_in_reasoning: bool = False  # the prompt opened the think block
    prefill: str = ""                  # assistant text appended to the prompt, parsed first
    parallel: bool = True              # False: calls after the first are dropped

    def parser(self) -> ChatOutputParser:
        reasoning = ReasoningParser(starts_in_reasoning=self.starts_in_reasoning) \
            if self.reasoning else None
        tools = make_tool_parser(self.tool_parser, self.tools) \
            if self.tool_parser and self.tools else None
        return ChatOutputParser(reasoning, tools)


@dataclass
class ChoiceSpec:
    index: int
    prompt_ids: np.ndarray             # int32 (metrale.request.as_token_ids), sent as is
    params: SamplingParams             # validated, n = 1 (what the engine is sent)
    stop: list[str] = field(default_factory=list)
    plan: ChatPlan | None = None


# a token of a piece of text: (token id, its wire.TokenLogprob from the engine's TokenDelta, or
# None when the request asked for no logprobs)
Token = tuple[int, TokenLogprob | None]


@dataclass
class ChoiceText:
    index: int
    text: str
    tokens: list[Token]
    events: list | None = None         # parsed ChatEvents (chat plans only)


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    text: str = ""                     # the final piece (flushed / cut at a stop string)
    tokens: list[Token] = field(default_factory=list)
    events: list | None = None         # the final parsed ChatEvents (chat plans only)
    stop_string: str | None = None     # the stop string that ended the output, if one did
    num_calls: int = 0                 # tool calls in the whole choice


class StopMatcher:
    """Text in, text out: holds back the longest tail that may still begin a stop string and
    reports the first stop string that matches (the output ends just before it)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.buf = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text that is final, whether a stop string matched)."""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [(i, s) for i, s in ((self.buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            out, self.buf = self.buf[:at], ""
            return out, True
        keep = self._held()
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, False

    def _held(self) -> int:
        for k in range(min(len(self.buf), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def _marker_ids(tokenizer: Tokenizer, plan: ChatPlan | None) -> list[int]:
    """The special tokens the tool parser reads (kept in the text although specials are not)."""
    if plan is None or not plan.tool_parser or not plan.tools:
        return []
    ids = (tokenizer.token_to_id(m) for m in marker_tokens(plan.tool_parser))
    return [i for i in ids if i is not None and i in tokenizer.special_token_ids]


class _Choice:
    """Engine deltas -> ChoiceText events, for one choice."""

    def __init__(self, spec: ChoiceSpec, tokenizer: Tokenizer):
        self.spec = spec
        self.detok = IncrementalDetokenizer(tokenizer, spec.prompt_ids,
                                            keep_special=_marker_ids(tokenizer, spec.plan))
        self.stops = StopMatcher(spec.stop)
        self.pending: list[tuple[Token, int]] = []   # tokens whose text is held back
        self.produced = 0      # chars out of the detokenizer
        self.emitted = 0       # chars released to the client
        self.num_tokens = 0    # tokens consumed (usage counts these)
        plan = spec.plan
        self.parser = plan.parser() if plan else None
        self.parallel = plan.parallel if plan else True
        self.num_calls = 0
        self._pending_events = self.parser.feed(plan.prefill) if plan and plan.prefill else []

    def events(self, text: str, final: bool = False) -> list | None:
        """The parsed events of the next piece of text (None without a chat plan)."""
        if self.parser is None:
            return None
        events, self._pending_events = self._pending_events, []
        if text:
            events += self.parser.feed(text)
        if final:
            events += self.parser.finish()
        if not self.parallel:
            events = [e for e in events if not isinstance(
                e, (ToolCallStart, ToolArgsDelta, ToolCallEnd)) or e.index == 0]
        self.num_calls += sum(isinstance(e, ToolCallStart) for e in events)
        return events

    def feed(self, delta: TokenDelta) -> tuple[str, list[Token], bool]:
        text, stopped = "", False
        lps = delta.logprobs
        for i, tid in enumerate(delta.token_ids):
            self.num_tokens += 1
            piece = self.detok.add(tid)
            self.produced += len(piece)
            self.pending.append(((tid, lps[i] if i < len(lps) else None), self.produced))
            out, stopped = self.stops.feed(piece)
            text += out
            self.emitted += len(out)
            if stopped:
                break
        return text, self._release(everything=stopped), stopped

    def finish(self) -> tuple[str, list[Token], bool]:
        out, stopped = self.stops.feed(self.detok.flush())
        if not stopped:
            out += self.stops.flush()
        return out, self._release(everything=True), stopped

    def _release(self, everything: bool) -> list[Token]:
        if everything:
            done, self.pending = self.pending, []
        else:
            done = [p for p in self.pending if p[1] <= self.emitted]
            self.pending = self.pending[len(done):]
        return [info for info, _ in done]


_GONE = object()   # queued by Generation._watch_disconnect

# the engine's finish reasons as the frontends report them: "timeout" (--request-timeout) stays
# distinct from "length" (max_tokens / the context), see frontends.routes
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "timeout": "timeout"}


class Generation:
    def __init__(self, client: AsyncEngineClient, tokenizer: Tokenizer, specs: list[ChoiceSpec],
                 disconnected: asyncio.Event | None = None, request_id: str | None = None):
        self.client = client
        self.request_id = request_id or uuid.uuid4().hex   # engine ids: f"{request_id}-{index}"
        self.tokenizer = tokenizer
        self.specs = specs
        self.disconnected = disconnected or asyncio.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    async def events(self):
        """ChoiceText / ChoiceDone / APIError events until every choice is done (an APIError
        ends the iteration). Raises ConnectionAbortedError when the client disconnects.

        One `queue.get()` per event (a disconnect puts a sentinel in the queue): the per-event
        task + `asyncio.wait` this replaced cost ~50 us per streamed token, half the frontend's
        work per token. A lost engine needs no polling here: the engine client ends every open
        request with a 503 error delta at once (metrale.client)."""
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._run(spec)) for spec in self.specs]
        gone = loop.create_task(self._watch_disconnect())
        remaining = len(self.specs)
        try:
            while remaining:
                if self.disconnected.is_set():
                    raise ConnectionAbortedError("the client disconnected")
                event = await self.queue.get()
                if event is _GONE:
                    raise ConnectionAbortedError("the client disconnected")
                if isinstance(event, ChoiceDone):
                    remaining -= 1
                yield event
                if isinstance(event, APIError):
                    return
        finally:
            gone.cancel()
            await self.cancel()

    async def _watch_disconnect(self) -> None:
        await self.disconnected.wait()
        self.queue.put_nowait(_GONE)

    async def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled or already reported
                pass

    async def _run(self, spec: ChoiceSpec) -> None:
        choice = _Choice(spec, self.tokenizer)
        request_id = f"{self.request_id}-{spec.index}"
        stream = self.client.generate(request_id, spec.prompt_ids, spec.params)
        try:
            async for delta in stream:
                if delta.error:
                    self.queue.put_nowait(errors.engine_unavailable(delta.error)
                                          if delta.error_status == 503 else
                                          errors.from_engine(delta.error_status, delta.error))
                    return
                text, tokens, stopped = choice.feed(delta)
                if stopped or delta.finish_reason is not None:
                    await stream.aclose()
                    self._done(spec, choice, delta, text, tokens, stopped)
                    return
                if text or tokens:
                    self.queue.put_nowait(ChoiceText(spec.index, text, tokens,
                                                     choice.events(text)))
        except EngineUnavailable as e:
            self.queue.put_nowait(errors.engine_unavailable(str(e)))
        finally:
            await stream.aclose()

    def _done(self, spec, choice: _Choice, delta, text, tokens, stopped) -> None:
        if not stopped:
            more, more_tokens, stopped = choice.finish()
            text, tokens = text + more, tokens + more_tokens
        reason = "stop" if stopped else _FINISH_REASONS.get(delta.finish_reason,
                                                            delta.finish_reason)
        num_output = choice.num_tokens if stopped else max(delta.num_output_tokens,
                                                           choice.num_tokens)
        events = choice.events(text, final=True)
        self.queue.put_nowait(ChoiceDone(
            spec.index, reason, delta.num_prompt_tokens or len(spec.prompt_ids), num_output,
            delta.num_cached_tokens, text, tokens, events,
            choice.stops.matched if stopped else None, choice.num_calls))
