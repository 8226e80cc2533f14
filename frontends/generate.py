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
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from metrale.api import errors
from metrale.api.errors import APIError
from metrale.client import AsyncEngineClient, EngineUnavailable
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer

LIVENESS_CHECK_S = 5.0


@dataclass
class ChoiceSpec:
    index: int
    prompt_ids: list[int]
    params: dict                       # SamplingParams.to_dict(), n = 1
    stop: list[str] = field(default_factory=list)


@dataclass
class TokenInfo:
    token_id: int
    logprob: float | None
    top: tuple                         # ((token_id, logprob), ...)


@dataclass
class ChoiceText:
    index: int
    text: str
    tokens: list[TokenInfo]


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    text: str = ""                     # the final piece (flushed / cut at a stop string)
    tokens: list[TokenInfo] = field(default_factory=list)


class StopMatcher:
    """Text in, text out: holds back the longest tail that may still begin a stop string and
    reports the first stop string that matches (the output ends just before it)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text that is final, whether a stop string matched)."""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
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


class _Choice:
    """Engine deltas -> ChoiceText events, for one choice."""

    def __init__(self, spec: ChoiceSpec, tokenizer: Tokenizer):
        self.spec = spec
        self.detok = IncrementalDetokenizer(tokenizer, spec.prompt_ids)
        self.stops = StopMatcher(spec.stop)
        self.pending: list[tuple[TokenInfo, int]] = []   # tokens whose text is held back
        self.produced = 0      # chars out of the detokenizer
        self.emitted = 0       # chars released to the client
        self.num_tokens = 0    # tokens consumed (usage counts these)

    def feed(self, delta) -> tuple[str, list[TokenInfo], bool]:
        text, stopped = "", False
        lps = delta.logprobs
        for i, tid in enumerate(delta.token_ids):
            lp = lps[i] if i < len(lps) else None
            info = TokenInfo(tid, lp[0] if lp else None, tuple(lp[1]) if lp else ())
            self.num_tokens += 1
            piece = self.detok.add(tid)
            self.produced += len(piece)
            self.pending.append((info, self.produced))
            out, stopped = self.stops.feed(piece)
            text += out
            self.emitted += len(out)
            if stopped:
                break
        return text, self._release(everything=stopped), stopped

    def finish(self) -> tuple[str, list[TokenInfo], bool]:
        out, stopped = self.stops.feed(self.detok.flush())
        if not stopped:
            out += self.stops.flush()
        return out, self._release(everything=True), stopped

    def _release(self, everything: bool) -> list[TokenInfo]:
        if everything:
            done, self.pending = self.pending, []
        else:
            done = [p for p in self.pending if p[1] <= self.emitted]
            self.pending = self.pending[len(done):]
        return [info for info, _ in done]


_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "timeout": "length"}


class Generation:
    def __init__(self, client: AsyncEngineClient, tokenizer: Tokenizer, specs: list[ChoiceSpec],
                 disconnected: asyncio.Event | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.specs = specs
        self.disconnected = disconnected or asyncio.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    async def events(self):
        """ChoiceText / ChoiceDone / APIError events until every choice is done (an APIError
        ends the iteration). Raises ConnectionAbortedError when the client disconnects."""
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._run(spec)) for spec in self.specs]
        gone = loop.create_task(self.disconnected.wait())
        remaining = len(self.specs)
        try:
            while remaining:
                if gone.done():
                    raise ConnectionAbortedError("the client disconnected")
                getter = loop.create_task(self.queue.get())
                await asyncio.wait({getter, gone}, timeout=LIVENESS_CHECK_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    if gone.done():
                        raise ConnectionAbortedError("the client disconnected")
                    event = await self._check_engine()
                    if event is None:
                        continue
                else:
                    event = getter.result()
                if isinstance(event, ChoiceDone):
                    remaining -= 1
                yield event
                if isinstance(event, APIError):
                    return
        finally:
            gone.cancel()
            await self.cancel()

    async def _check_engine(self) -> APIError | None:
        """Nothing came for a while: is the engine still there? (A submit to an engine that is
        gone may block in ZeroMQ; the client must get a 503, never a hang.)"""
        try:
            await self.client.control("health")
        except EngineUnavailable as e:
            return errors.engine_unavailable(str(e))
        return None

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
        request_id = f"{uuid.uuid4().hex}-{spec.index}"
        stream = self.client.generate(request_id, spec.prompt_ids, spec.params)
        try:
            async for delta in stream:
                if delta.error:
                    self.queue.put_nowait(errors.from_engine(delta.error_status, delta.error))
                    return
                text, tokens, stopped = choice.feed(delta)
                if stopped or delta.finish_reason is not None:
                    await stream.aclose()
                    self._done(spec, choice, delta, text, tokens, stopped)
                    return
                if text or tokens:
                    self.queue.put_nowait(ChoiceText(spec.index, text, tokens))
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
        self.queue.put_nowait(ChoiceDone(
            spec.index, reason, delta.num_prompt_tokens or len(spec.prompt_ids), num_output,
            delta.num_cached_tokens, text, tokens))
