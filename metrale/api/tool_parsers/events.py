"""Events a streaming tool parser emits, the finished ToolCall, and tool-call ids.

A parser turns detokenized model text into a sequence of events. The concatenated `TextDelta`s
are the message content; for call `i`, `ToolCallStart(i)` comes first, then `ToolArgsDelta(i)`
fragments whose concatenation is the final arguments JSON object, then `ToolCallEnd(i)`. Calls
never interleave: call i ends before call i + 1 starts.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Callable, Iterable, Union

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    index: int
    json_fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


ToolEvent = Union[TextDelta, ToolCallStart, ToolArgsDelta, ToolCallEnd]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str


IdFactory = Callable[[], str]


def new_tool_call_id() -> str:
    """An OpenAI-style id: `call_` + 24 random ASCII letters/digits (the API maps it to `toolu_`)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def new_mistral_call_id() -> str:
    """A Mistral-style id: 9 random ASCII letters/digits (Mistral's chat templates refuse any
    other length in an assistant tool call or a tool result, so a client echoing our id back
    round-trips; vLLM's mistral parser makes the same)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def collect(events: Iterable[ToolEvent]) -> tuple[str, list[ToolCall]]:
    """Fold events into (content, calls): what a non-streaming response carries."""
    content: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            starts[event.index] = event
            args[event.index] = []
        elif isinstance(event, ToolArgsDelta):
            args[event.index].append(event.json_fragment)
    calls = [
        ToolCall(id=start.id, name=start.name, arguments_json="".join(args[index]))
        for index, start in sorted(starts.items())
    ]
    return "".join(content), calls
