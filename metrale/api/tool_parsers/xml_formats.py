"""Tool-call formats with XML-like function/parameter tags: qwen3_coder (= qwen3_xml), minimax_xml.

These stream arguments progressively: `ToolCallStart` goes out as soon as the function name is
complete (and declared), then each parameter adds its piece of the arguments object as it
arrives, so the concatenated fragments are exactly `json.dumps(arguments)`:

    {"city": "Paris"            <- text parameters stream character by character
    , "days": 3                 <- typed parameters go out when `</parameter>` arrives
    }                           <- at `</function>` (`{}` for a call without parameters)

Parameter values: one leading and one trailing newline are the template's padding and are
removed; the rest is the value. Values are converted by the tool's JSON schema
(integer / number / boolean / null / object / array are parsed; strings, untyped and undeclared
parameters stay text; a value that does not parse as its type stays text). A repeated parameter
keeps its first value. Text between parameters is ignored (the format has no place for it).

End of stream inside a call (e.g. max_tokens): the call is closed with what has arrived; a
parameter cut mid-value keeps the text so far (a cut closing tag is dropped). A block whose
function name is undeclared or unreadable is content, with `malformed` set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from metrale.api.tool_parsers.base import ToolParser, calls_from_json_text, held_prefix_len
from metrale.api.tool_parsers.events import TextDelta, ToolArgsDelta, ToolEvent
from metrale.api.tool_parsers.jsonfix import canonical_json
from metrale.api.tool_parsers.schema import convert_value, declared_types, is_text_param

_MAX_NAME_LEN = 256


@dataclass(frozen=True)
class XmlDialect:
    block_open: str
    block_close: str
    func_open: str
    func_close: str
    param_open: str
    param_close: str = "</parameter>"
    bare_functions: bool = False  # a function may also appear without the block tags
    json_bodies: bool = False  # a block may hold a hermes JSON body instead


QWEN3_XML = XmlDialect(
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
    bare_functions=True, json_bodies=True,
)
MINIMAX_XML = XmlDialect(
    "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name=', "</invoke>", '<parameter name=',
)


def _tag_value(text: str) -> str:
    """`NAME` from `NAME`, ` "NAME" ` or `'NAME'` (the part before `>`)."""
    return text.strip().strip("\"'").strip()


class XmlCallParser(ToolParser):
    dialect: XmlDialect

    @property
    def start_tags(self) -> tuple[str, ...]:  # type: ignore[override]
        d = self.dialect
        return (d.block_open, d.func_open) if d.bare_functions else (d.block_open,)

    def _begin_block(self) -> None:
        self._outer = self._open_tag == self.dialect.block_open
        self._raw = ""
        self._calls_in_block = 0
        self._func_start = 0
        self._state = "between" if self._outer else "head"

    def _take(self, size: int) -> str:
        taken, self._buf = self._buf[:size], self._buf[size:]
        self._raw += taken
        return taken

    def _step_block(self, events: list[ToolEvent], final: bool) -> bool:
        return getattr(self, "_in_" + self._state)(events, final)

    # ---- between functions ----------------------------------------------------------------
    def _in_between(self, events: list[ToolEvent], final: bool) -> bool:
        d = self.dialect
        head = self._buf.lstrip()
        lead = len(self._buf) - len(head)
        expected = (d.func_open, d.block_close)
        if head.startswith(d.func_open):
            self._take(lead)
            self._func_start = len(self._raw)
            self._take(len(d.func_open))
            self._state = "head"
            return True
        if head.startswith(d.block_close):
            self._take(lead + len(d.block_close))
            return self._end_block(events)
        if not head or any(tag.startswith(head) for tag in expected):
            return self._end_block(events) if final else False
        if self._calls_in_block:
            return self._skip_stray(head, lead)
        if d.json_bodies and head[0] in "{[":
            self._state = "json"
            return True
        return self._malformed_block(events, final)

    def _end_block(self, events: list[ToolEvent]) -> bool:
        if not self._calls_in_block:
            return self._malformed_block(events, final=True)
        self._close_block(after_call=True)
        return True

    def _malformed_block(self, events: list[ToolEvent], final: bool) -> bool:
        """Everything read since the start tag goes out as text; the rest is scanned as text."""
        if final:
            self._take(len(self._buf))
        self._emit_raw_block(events, self._raw)
        return True

    def _skip_stray(self, head: str, lead: int) -> bool:
        next_tag = head.find("<", 1)
        self._take(lead + (next_tag if next_tag > 0 else len(head)))
        return True

    # ---- a hermes JSON body inside the block (Qwen3 models may write either) --------------
    def _in_json(self, events: list[ToolEvent], final: bool) -> bool:
        end = self._buf.find(self.dialect.block_close)
        if end < 0 and not final:
            return False
        body = self._buf if end < 0 else self._buf[:end]
        self._take(len(self._buf) if end < 0 else end + len(self.dialect.block_close))
        if self._emit_calls(events, calls_from_json_text(body)):
            self._close_block(after_call=True)
        else:
            self._emit_raw_block(events, self._raw)
        return True

    # ---- function name ----------------------------------------------------------------------
    def _in_head(self, events: list[ToolEvent], final: bool) -> bool:
        end = self._buf.find(">")
        if end < 0 and not final and len(self._buf) <= _MAX_NAME_LEN:
            return False
        name = _tag_value(self._buf[:end]) if end >= 0 else ""
        self._take(end + 1 if end >= 0 else 0)
        if not self._known(name):
            return self._reject_function(events, final)
        self._start_call(events, name)
        self._schema = self.schemas[name]
        self._params_emitted = 0
        self._seen_params: set[str] = set()
        self._state = "params"
        return True

    def _reject_function(self, events: list[ToolEvent], final: bool) -> bool:
        if not self._calls_in_block:
            return self._malformed_block(events, final)
        self._state = "skip_func"
        return True

    def _in_skip_func(self, events: list[ToolEvent], final: bool) -> bool:
        """An undeclared function after good ones in the same block: its text is content."""
        end = self._buf.find(self.dialect.func_close)
        if end < 0 and not final:
            return False
        self._take(len(self._buf) if end < 0 else end + len(self.dialect.func_close))
        events.append(TextDelta(self._raw[self._func_start :]))
        self.malformed = True
        self._state = "between"
        return True

    # ---- parameters -------------------------------------------------------------------------
    def _in_params(self, events: list[ToolEvent], final: bool) -> bool:
        d = self.dialect
        head = self._buf.lstrip()
        lead = len(self._buf) - len(head)
        if head.startswith(d.param_open):
            self._take(lead + len(d.param_open))
            self._state = "param_name"
            return True
        if head.startswith(d.func_close):
            self._take(lead + len(d.func_close))
            return self._close_call(events)
        if not head or any(tag.startswith(head) for tag in (d.param_open, d.func_close)):
            if not final:
                return False
            self._take(len(self._buf))
            return self._close_call(events)
        return self._skip_stray(head, lead)

    def _close_call(self, events: list[ToolEvent]) -> bool:
        events.append(ToolArgsDelta(self._num_calls, "}" if self._params_emitted else "{}"))
        self._end_call(events)
        self._calls_in_block += 1
        if self._outer:
            self._state = "between"
        else:
            self._close_block(after_call=True)
        return True

    def _in_param_name(self, events: list[ToolEvent], final: bool) -> bool:
        end = self._buf.find(">")
        if end < 0:
            if not final:
                return False
            self._take(len(self._buf))
            return self._close_call(events)
        name = _tag_value(self._take(end + 1)[:-1])
        self._param = name
        self._param_types = declared_types(self._schema, name)
        self._param_is_text = is_text_param(self._param_types)
        self._param_skipped = name in self._seen_params
        self._seen_params.add(name)
        self._value_started = False
        self._value_opened = False
        self._value_text = ""
        self._state = "param_value"
        return True

    def _in_param_value(self, events: list[ToolEvent], final: bool) -> bool:
        close = self.dialect.param_close
        cut_close = ("\n" + close, close)
        end = self._buf.find(close)
        if end >= 0:
            chunk = self._take(end + len(close))[: -len(close)]
        else:
            held = held_prefix_len(self._buf, cut_close)
            chunk = self._take(len(self._buf) - held)
            if final:
                self._take(len(self._buf))
        done = end >= 0 or final
        self._value_piece(events, chunk, done)
        if done:
            self._state = "params"
        return done

    def _value_piece(self, events: list[ToolEvent], chunk: str, done: bool) -> None:
        if not self._value_started:
            if not chunk and not done:
                return
            chunk = chunk.removeprefix("\n")
            self._value_started = True
        if done:
            chunk = chunk.removesuffix("\n")
        if self._param_skipped:
            return
        if self._param_is_text:
            self._stream_text_value(events, chunk, done)
        else:
            self._value_text += chunk
            if done:
                value = convert_value(self._value_text, self._param_types)
                self._emit_args(events, self._key_prefix() + canonical_json(value))
                self._params_emitted += 1

    def _stream_text_value(self, events: list[ToolEvent], chunk: str, done: bool) -> None:
        fragment = ""
        if not self._value_opened:
            fragment = self._key_prefix() + '"'
            self._value_opened = True
        fragment += json.dumps(chunk, ensure_ascii=False)[1:-1]
        if done:
            fragment += '"'
            self._params_emitted += 1
        self._emit_args(events, fragment)

    def _key_prefix(self) -> str:
        return ("{" if not self._params_emitted else ", ") + canonical_json(self._param) + ": "

    def _emit_args(self, events: list[ToolEvent], fragment: str) -> None:
        if fragment:
            events.append(ToolArgsDelta(self._num_calls, fragment))


class Qwen3XmlParser(XmlCallParser):
    """`qwen3_coder` / `qwen3_xml` (Qwen3-Coder, Qwen3.5 / Qwen3.6 chat templates).

    Wire format, one block per call (several blocks in a row for parallel calls):

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        <parameter=days>
        3
        </parameter>
        </function>
        </tool_call>

    Also accepted: a `<function=...>...</function>` without the `<tool_call>` wrapper, several
    functions in one block, a call cut off by the end of the stream, and a
    hermes JSON body (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), which is
    what the original Qwen3 (2504) template asks for; Qwen3 models fine-tuned on either form
    are read correctly by this one parser.
    """

    dialect = QWEN3_XML


class MinimaxXmlParser(XmlCallParser):
    """`minimax_xml` (MiniMax-M1 / M2 chat templates).

    Wire format, one block holding one or more invokes:

        <minimax:tool_call>
        <invoke name="get_weather">
        <parameter name="city">Paris</parameter>
        <parameter name="days">3</parameter>
        </invoke>
        </minimax:tool_call>

    Names may be double-, single- or un-quoted.
    """

    dialect = MINIMAX_XML
    marker_tokens = ("<minimax:tool_call>", "</minimax:tool_call>")
