"""Tool-call formats whose calls are JSON: hermes, poolside_v1, mistral, bare_json, deepseek_v3.

Arguments of these formats are emitted once per call, as the canonical JSON of the parsed
object (one `ToolArgsDelta` when the call is complete), so the streamed arguments are the
final ones by construction.
"""

from __future__ import annotations

import re
from typing import Optional

from metrale.api.tool_parsers.base import (
    DelimitedBlockParser,
    ParsedCall,
    ToolParser,
    calls_from_json_text,
    held_prefix_len,
)
from metrale.api.tool_parsers.events import IdFactory, ToolEvent, new_mistral_call_id, new_tool_call_id
from metrale.api.tool_parsers.jsonfix import loads_lenient, scan_json


class HermesParser(DelimitedBlockParser):
    """`hermes` (Hermes 2 Pro, Qwen2.5, Qwen3 and their chat templates).

    Wire format, one block per call, any number of blocks, text allowed around them:

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    The body is one JSON object with `name` and `arguments` (an object, or a string holding
    a JSON object; `parameters` is accepted for `arguments`; missing means `{}`). A JSON list of
    such objects in one block is accepted too. Repairs: see `jsonfix` (missing closing braces,
    trailing commas, single quotes); a missing `</tool_call>` at the end of the stream.
    """

    end_tags = {"<tool_call>": "</tool_call>"}

    def _parse_body(self, body: str) -> Optional[list[ParsedCall]]:
        return calls_from_json_text(body)


class DeepseekV3Parser(DelimitedBlockParser):
    """`deepseek_v3` (DeepSeek-V3 / V3-0324 / R1 and V3.1+ chat templates; their special tokens
    use U+FF5C "｜" and U+2581 "▁").

    Wire format, all calls of a turn in one block, text allowed before it:

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    V3.1 and later drop the type and the fence: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
    {"city": "Paris"}<｜tool▁call▁end｜>`; both are read. The arguments are one JSON object
    (repairs: see `jsonfix`). A block with anything but calls in it is content; a missing
    `<｜tool▁calls▁end｜>` at the end of the stream is repaired.
    """

    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    end_tags = {CALLS_BEGIN: CALLS_END}

    def _parse_body(self, body: str) -> Optional[list[ParsedCall]]:
        calls, rest = [], body.strip()
        while rest:
            if not rest.startswith(self.CALL_BEGIN):
                return None
            end = rest.find(self.CALL_END)
            call = _deepseek_call(rest[len(self.CALL_BEGIN): end if end >= 0 else len(rest)], self.SEP)
            if call is None:
                return None
            calls.append(call)
            rest = "" if end < 0 else rest[end + len(self.CALL_END):].strip()
        return calls or None


def _deepseek_call(text: str, sep: str) -> Optional[ParsedCall]:
    """(name, arguments) of one DeepSeek call body: `function<sep>NAME`, a newline and the
    arguments in a ```json fence (V3), or `NAME<sep>{...}` (V3.1)."""
    head, found, tail = text.partition(sep)
    if not found:
        return None
    if head.strip() == "function":
        name, _, args = tail.partition("\n")
        args = _strip_fence(args.strip())
    else:
        name, args = head, tail
    name = name.strip()
    try:
        value = loads_lenient(args.strip()) if args.strip() else {}
    except ValueError:
        return None
    return (name, value) if name and isinstance(value, dict) else None


class PoolsideV1Parser(HermesParser):
    """`poolside_v1`: an ASSUMED format, to be checked against a Poolside chat template.

    No public Poolside template or parser was available when this was written, so this reads
    the hermes body (`{"name": ..., "arguments": {...}}`, or a list of them) between
    `<tool_call>` and `</tool_call>`, exactly like `hermes`. If Poolside's real tags differ,
    change `end_tags` here; everything else (repairs, holdback, validation) carries over.
    """


class MistralParser(ToolParser):
    """`mistral` (Mistral / Mixtral / Mistral-Small / Devstral chat templates).

    Wire formats after the `[TOOL_CALLS]` marker (text may precede it):

        [TOOL_CALLS][{"name": "a", "arguments": {...}}, {"name": "b", "arguments": {...}}]
        [TOOL_CALLS]{"name": "a", "arguments": {...}}
        [TOOL_CALLS]a[ARGS]{...}                      (tokenizer v11+; repeats per call)
        [TOOL_CALLS]a[CALL_ID]abc123456[ARGS]{...}    (the model's id is replaced by ours)

    Call ids are Mistral's 9 letters/digits (new_mistral_call_id), which its templates require.
    The block ends where the JSON value ends (brackets balanced, strings respected); text after
    it is content. A list is all-or-nothing: one bad entry makes the whole block content.
    At the end of the stream an unbalanced JSON value gets its closing brackets (repair).
    """

    start_tags = ("[TOOL_CALLS]",)
    marker_tokens = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    _NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")

    def __init__(self, tools, new_id: IdFactory = new_mistral_call_id):
        super().__init__(tools, new_id)

    def _step_block(self, events: list[ToolEvent], final: bool) -> bool:
        lead = len(self._buf) - len(self._buf.lstrip())
        head = self._buf[lead:]
        if not head:
            return self._give_up(events) if final else False
        if head[0] in "[{":
            return self._step_json(events, final, lead)
        return self._step_named(events, final)

    def _step_json(self, events: list[ToolEvent], final: bool, start: int) -> bool:
        scan = scan_json(self._buf, start)
        if scan.broken:
            return self._give_up(events)
        if scan.end is None and not final:
            return False
        end = scan.end if scan.end is not None else len(self._buf)
        return self._finish_block(events, calls_from_json_text(self._buf[start:end]), end)

    def _step_named(self, events: list[ToolEvent], final: bool) -> bool:
        marker = self._buf.find("[ARGS]")
        head = self._buf if marker < 0 else self._buf[:marker]
        if marker < 0:
            head = head[: len(head) - held_prefix_len(head, ("[ARGS]", "[CALL_ID]"))]
        name = head.split("[CALL_ID]")[0].strip()
        if not self._NAME_CHARS.fullmatch(name) or len(head) > 256:
            return self._give_up(events)
        if marker < 0:
            return self._give_up(events) if final else False
        start = marker + len("[ARGS]")
        body = self._buf[start:].lstrip()
        if not body:
            return self._give_up(events) if final else False
        start = len(self._buf) - len(body)
        scan = scan_json(self._buf, start) if body[0] == "{" else None
        if scan is None or scan.broken:
            return self._give_up(events)
        if scan.end is None and not final:
            return False
        end = scan.end if scan.end is not None else len(self._buf)
        return self._finish_block(events, self._named_call(name, self._buf[start:end]), end)

    @staticmethod
    def _named_call(name: str, args_text: str) -> Optional[list[ParsedCall]]:
        try:
            args = loads_lenient(args_text)
        except ValueError:
            return None
        return [(name, args)] if isinstance(args, dict) else None

    def _finish_block(self, events: list[ToolEvent], calls, end: int) -> bool:
        raw, self._buf = self._buf[:end], self._buf[end:]
        if self._emit_calls(events, calls):
            self._close_block(after_call=True)
        else:
            self._emit_raw_block(events, raw)
        return True

    def _give_up(self, events: list[ToolEvent]) -> bool:
        """Not a readable call: the marker goes out as text and scanning resumes after it."""
        self._emit_raw_block(events, "")
        return True


class BareJsonParser(ToolParser):
    """`bare_json` (Llama 3.x JSON tool calling, and any model told to answer in JSON).

    The WHOLE output (after optional whitespace, an optional `<|python_tag|>`, and an optional
    ```json ... ``` fence) is either one call object `{"name": ..., "arguments": {...}}`
    (`parameters` accepted for `arguments`) or a JSON list of them. Any output that does not
    start with `{`, `[`, a fence or the python tag streams as plain text immediately; output that
    does is held until the end (it cannot be known to be a call earlier). JSON that is not a
    call is content; something that tries to be a call (has a `"name"` key) but cannot be
    read, or names an undeclared tool, is content and sets `malformed`.
    """

    _CALL_HINT = re.compile(r'^[\[\s]*\{\s*["\']name["\']')

    def __init__(self, tools, new_id: IdFactory = new_tool_call_id):
        super().__init__(tools, new_id)
        self._mode = "undecided"

    def _step_text(self, events: list[ToolEvent], final: bool) -> bool:
        if self._mode == "undecided":
            self._mode = _decide_bare_json(self._buf.lstrip(), final)
        if self._mode == "text":
            self._emit_text(events, self._buf)
            self._buf = ""
        elif self._mode == "json" and final:
            self._finish_json(events)
        return False

    def _finish_json(self, events: list[ToolEvent]) -> None:
        raw, self._buf = self._buf, ""
        body = _strip_fence(raw.strip().removeprefix("<|python_tag|>").strip())
        calls = calls_from_json_text(body)
        if self._emit_calls(events, calls):
            return
        self._emit_text(events, raw)
        self.malformed = calls is not None or bool(self._CALL_HINT.match(body))

    def _step_block(self, events: list[ToolEvent], final: bool) -> bool:
        return False


def _decide_bare_json(head: str, final: bool) -> str:
    """"json" if the output opens like a JSON call, "text" if it cannot, else "undecided"."""
    if head.startswith("<|python_tag|>"):
        return "json"
    if head.startswith("```"):
        after = head[3:]
        rest = after.removeprefix("json").lstrip()
        could_grow = not rest or "json".startswith(after)
    else:
        rest = head
        could_grow = not head or any(o.startswith(head) for o in ("<|python_tag|>", "```"))
    if rest[:1] in ("{", "["):
        return "json"
    return "undecided" if could_grow and not final else "text"


def _strip_fence(text: str) -> str:
    if not text.startswith("```"):
        return text
    first_newline = text.find("\n")
    inner = text[first_newline + 1 :] if first_newline >= 0 else ""
    return inner.strip().removesuffix("```").strip()
