"""The streaming machinery every tool-call format shares.

Outside a tool block the parser passes text through, except that
  * a suffix that could still become a start tag (`<tool` at a chunk end) is held back until
    it cannot, and released as text at `finish()` if the tag never completes;
  * whitespace right before a tool block and right after a tool call is the template's
    separator, not content: it is held back and dropped when a call follows or precedes it.
    (If the block turns out malformed, the held whitespace goes out with its raw text.)
Inside a block the format subclass decides (`_step_block`). A block that cannot be read as
calls is emitted verbatim as text and sets `malformed`; a call naming an undeclared tool is
malformed too. Once `ToolCallStart` is out the call is committed: it always ends with a
`ToolCallEnd` and arguments that form one JSON object.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from metrale.api.tool_parsers.events import (
    IdFactory,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    ToolEvent,
    collect,
    new_tool_call_id,
)
from metrale.api.tool_parsers.jsonfix import canonical_json, loads_lenient
from metrale.api.tool_parsers.schema import tool_schemas

ParsedCall = tuple[str, dict]


def held_prefix_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:size]):
                best = size
                break
    return best


def find_first(text: str, tags: Iterable[str]) -> tuple[int, str]:
    """(index, tag) of the earliest occurrence of any tag, (-1, "") if none."""
    hits = [(text.find(tag), tag) for tag in tags]
    hits = [(i, tag) for i, tag in hits if i >= 0]
    return min(hits, key=lambda hit: (hit[0], -len(hit[1]))) if hits else (-1, "")


def call_from_object(obj: Any) -> Optional[ParsedCall]:
    """Read `{"name": str, "arguments": {...}}` (or `"parameters"`; arguments may be a JSON
    string holding an object; missing arguments mean `{}`)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_lenient(args) if args.strip() else {}
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def calls_from_json_text(text: str) -> Optional[list[ParsedCall]]:
    """One call object or a non-empty list of them, as JSON text (repairs allowed)."""
    try:
        value = loads_lenient(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(item) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls


class ToolParser:
    """Base streaming parser: `feed(delta) -> events`, then `finish() -> events` once."""

    start_tags: tuple[str, ...] = ()
    # the format's words a tokenizer may hold as special tokens (Mistral's [TOOL_CALLS], Gemma
    # 4's <|tool_call>): the chat detokenizer keeps them although it skips special tokens
    marker_tokens: tuple[str, ...] = ()

    def __init__(self, tools: Optional[Iterable[dict]], new_id: IdFactory = new_tool_call_id):
        self.schemas = tool_schemas(tools)
        self.malformed = False
        self._new_id = new_id
        self._buf = ""
        self._in_block = False
        self._open_tag = ""
        self._separator = ""
        self._after_call = False
        self._num_calls = 0
        self._finished = False

    # ---- public interface -------------------------------------------------------------
    def feed(self, delta: str) -> list[ToolEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish(): a parser reads exactly one output")
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> list[ToolEvent]:
        if self._finished:
            return []
        self._finished = True
        return self._advance(final=True)

    def parse_complete(self, text: str) -> tuple[str, list[ToolCall]]:
        """Non-streaming parse, defined as streaming the whole text through this parser."""
        return collect(self.feed(text) + self.finish())

    # ---- driving ------------------------------------------------------------------------
    def _advance(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self._step_block(events, final) if self._in_block else self._step_text(events, final):
            pass
        return events

    def _step_text(self, events: list[ToolEvent], final: bool) -> bool:
        """Pass text through until a start tag; True when a block was entered."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        index, tag = find_first(self._buf, self.start_tags)
        if index >= 0:
            before = self._buf[:index]
            text = before.rstrip()
            self._emit_text(events, text)
            self._separator = before[len(text) :]
            self._open_tag = tag
            self._buf = self._buf[index + len(tag) :]
            self._in_block = True
            self._begin_block()
            return True
        if final:
            self._emit_text(events, self._buf)
            self._buf = ""
            return False
        held = held_prefix_len(self._buf, self.start_tags)
        safe = self._buf[: len(self._buf) - held].rstrip()
        self._emit_text(events, safe)
        self._buf = self._buf[len(safe) :]
        return False

    # ---- hooks for formats --------------------------------------------------------------
    def _begin_block(self) -> None:
        """Called once a start tag has been consumed."""

    def _step_block(self, events: list[ToolEvent], final: bool) -> bool:
        raise NotImplementedError

    # ---- emitting -----------------------------------------------------------------------
    @staticmethod
    def _emit_text(events: list[ToolEvent], text: str) -> None:
        if text:
            events.append(TextDelta(text))

    def _emit_raw_block(self, events: list[ToolEvent], raw_body: str) -> None:
        """The block was not a valid call: its exact text becomes content."""
        self._emit_text(events, self._separator + self._open_tag + raw_body)
        self.malformed = True
        self._close_block(after_call=False)

    def _close_block(self, after_call: bool) -> None:
        self._in_block = False
        self._separator = ""
        self._open_tag = ""
        self._after_call = after_call

    def _known(self, name: str) -> bool:
        return name in self.schemas

    def _emit_calls(self, events: list[ToolEvent], calls: Optional[list[ParsedCall]]) -> bool:
        """Emit whole calls (all or nothing); False if any is unknown or not serialisable."""
        if not calls or not all(self._known(name) for name, _ in calls):
            return False
        try:
            rendered = [(name, canonical_json(args)) for name, args in calls]
        except ValueError:
            return False
        for name, args_json in rendered:
            index = self._start_call(events, name)
            events.append(ToolArgsDelta(index, args_json))
            self._end_call(events)
        return True

    def _start_call(self, events: list[ToolEvent], name: str) -> int:
        index = self._num_calls
        events.append(ToolCallStart(index, self._new_id(), name))
        return index

    def _end_call(self, events: list[ToolEvent]) -> None:
        events.append(ToolCallEnd(self._num_calls))
        self._num_calls += 1


class DelimitedBlockParser(ToolParser):
    """Formats whose calls sit between a start tag and its end tag, read when the block ends.

    Subclasses set `end_tags` (start tag -> end tag) and `_parse_body`. An unterminated block
    at the end of the stream is parsed as if the end tag had come (repair); if that fails its
    text is content.
    """

    end_tags: dict[str, str] = {}

    @property
    def start_tags(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.end_tags)

    def _step_block(self, events: list[ToolEvent], final: bool) -> bool:
        end_tag = self.end_tags[self._open_tag]
        index = self._buf.find(end_tag)
        if index < 0 and not final:
            return False
        body = self._buf if index < 0 else self._buf[:index]
        raw = self._buf if index < 0 else self._buf[: index + len(end_tag)]
        self._buf = self._buf[len(raw) :]
        if self._emit_calls(events, self._parse_body(body)):
            self._close_block(after_call=True)
        else:
            self._emit_raw_block(events, raw)
        return True

    def _parse_body(self, body: str) -> Optional[list[ParsedCall]]:
        raise NotImplementedError
