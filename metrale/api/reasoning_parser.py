"""Reasoning (`<think>`) separation and its composition with tool parsing, frontend side (the
thinking budget the engine enforces: metrale.thinking_budget).

Wire format (Qwen3 / Qwen3.5 / DeepSeek-R1 style; tags configurable, e.g. Gemma 4's
`<|channel>thought` ... `<channel|>`):

    <think>
    reasoning text
    </think>

    answer text

`starts_in_reasoning=True` when the PROMPT already opened the block (templates that end the
generation prompt with `<think>\\n`): the output begins inside reasoning and only `</think>`
is expected. With `starts_in_reasoning=False` (e.g. Qwen3 with enable_thinking=False, whose
template inserts an empty `<think>\\n\\n</think>\\n\\n`) the output is content, except that
an output which itself BEGINS with `<think>` (after whitespace) opens reasoning (the original
Qwen3 template lets the model write the tag). A `<think>` later in the answer is content.
The padding newlines are not text: whitespace at the start and end of the reasoning and at
the start of the answer is dropped. A stream that ends inside reasoning is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from metrale.api.tool_parsers import TextDelta, ToolCall, ToolEvent, ToolParser, collect
from metrale.api.tool_parsers.base import held_prefix_len


class ReasoningParser:
    """`feed(delta) -> (reasoning_delta, content_delta)`; `finish()` the same, once."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False):
        self.start, self.end = start, end
        self._state = "open" if starts_in_reasoning else "maybe_open"
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while getattr(self, "_in_" + self._state)(reasoning, content, final):
            pass
        return "".join(reasoning), "".join(content)

    def _in_maybe_open(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Start of a content-first output: does it open with the start tag?"""
        head = self._buf.lstrip()
        if head.startswith(self.start):
            self._buf = head[len(self.start) :]
            self._state = "open"
            return True
        if not final and (not head or self.start.startswith(head)):
            return False
        self._state = "content"
        return True

    def _in_open(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Right after the start tag (or prompt): skip padding and a repeated start tag."""
        head = self._buf.lstrip()
        if head.startswith(self.start):
            self._buf = head[len(self.start) :]
            return True
        if not final and (not head or self.start.startswith(head)):
            return False
        self._buf = head
        self._state = "reasoning"
        return True

    def _in_reasoning(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        index = self._buf.find(self.end)
        if index >= 0:
            reasoning.append(self._buf[:index].rstrip())
            self._buf = self._buf[index + len(self.end) :]
            self._state = "after_end"
            return True
        if final:
            reasoning.append(self._buf.rstrip())
            self._buf = ""
            return False
        held = held_prefix_len(self._buf, (self.end,))
        safe = self._buf[: len(self._buf) - held].rstrip()
        reasoning.append(safe)
        self._buf = self._buf[len(safe) :]
        return False

    def _in_after_end(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        self._state = "content"
        return True

    def _in_content(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        content.append(self._buf)
        self._buf = ""
        return False


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


ChatEvent = Union[ReasoningDelta, ToolEvent]


class ChatOutputParser:
    """One object for the API layer: reasoning first, then tool parsing of the content only,
    so tool syntax inside `<think>` is never a call. Either part may be None (no reasoning
    parser: all text is content; no tool parser: content is passed through as TextDelta)."""

    def __init__(self, reasoning: Optional[ReasoningParser], tool_parser: Optional[ToolParser]):
        self.reasoning, self.tool_parser = reasoning, tool_parser

    @property
    def malformed(self) -> bool:
        return bool(self.tool_parser and self.tool_parser.malformed)

    def feed(self, delta: str) -> list[ChatEvent]:
        thought, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        return self._route(thought, content, final=False)

    def finish(self) -> list[ChatEvent]:
        thought, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(thought, content, final=True)

    def parse_complete(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, calls) of a whole output, by streaming it in one piece."""
        events = self.feed(text) + self.finish()
        thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        content, calls = collect(e for e in events if not isinstance(e, ReasoningDelta))
        return thought, content, calls

    def _route(self, thought: str, content: str, final: bool) -> list[ChatEvent]:
        events: list[ChatEvent] = [ReasoningDelta(thought)] if thought else []
        if self.tool_parser is None:
            return events + ([TextDelta(content)] if content else [])
        if content:
            events += self.tool_parser.feed(content)
        if final:
            events += self.tool_parser.finish()
        return events
