"""`gemma4`: Gemma 4 native function calls (and the FunctionGemma form they grew from).

Wire format (Gemma 4 chat template; `<|"|>` is the string-delimiter token):

    <|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,metric:true}<tool_call|>

FunctionGemma (Gemma 3 270M) writes the same body with other tokens:

    <start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>

Body grammar, one call per block, any number of blocks, text allowed around them:

    body   := "call:" NAME object
    object := "{" [ key ":" value { "," key ":" value } [","] ] "}"
    key    := bare word (letters, digits, _ - .) | quoted string
    value  := QSTR | JSON string | object | "[" [ value { "," value } [","] ] "]" | scalar
    QSTR   := DELIM any text DELIM   (braces, commas and quotes inside are literal)
    scalar := true | false | null | JSON number, else (repair) an unquoted string up to , } ]

Repairs: trailing commas; objects/arrays left open when the block (or stream) ends are closed.
Anything else that does not fit is content, with `malformed` set.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from metrale.api.tool_parsers.base import DelimitedBlockParser, ParsedCall
from metrale.api.tool_parsers.jsonfix import strict_loads

_QUOTES = {"<|tool_call>": '<|"|>', "<start_function_call>": "<escape>"}
_HEAD = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\s*\{")
_KEY = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*:")
_SCALAR_END = re.compile(r"[,}\]]")


class _Malformed(Exception):
    pass


class _BodyReader:
    """Recursive-descent reader over one call body; positions index into `text`."""

    def __init__(self, text: str, quote: str):
        self.text, self.quote, self.pos = text, quote, 0

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def at_end(self) -> bool:
        self.skip_ws()
        return self.pos >= len(self.text)

    def peek(self, token: str) -> bool:
        self.skip_ws()
        return self.text.startswith(token, self.pos)

    def object(self) -> dict:
        """Read after the opening brace, through the closing one (or the end: repair)."""
        result: dict[str, Any] = {}
        while not self.at_end() and not self.peek("}"):
            key = self.key()
            result[key] = self.value()
            if self.peek(","):
                self.pos += 1
            elif not self.at_end() and not self.peek("}"):
                raise _Malformed("expected , or }")
        self.pos += 1
        return result

    def array(self) -> list:
        items: list[Any] = []
        while not self.at_end() and not self.peek("]"):
            items.append(self.value())
            if self.peek(","):
                self.pos += 1
            elif not self.at_end() and not self.peek("]"):
                raise _Malformed("expected , or ]")
        self.pos += 1
        return items

    def key(self) -> str:
        if self.peek(self.quote) or self.peek('"'):
            key = self.value()
            if not isinstance(key, str) or not self.peek(":"):
                raise _Malformed("bad key")
            self.pos += 1
            return key
        match = _KEY.match(self.text, self.pos)
        if not match:
            raise _Malformed("bad key")
        self.pos = match.end()
        return match.group(1)

    def value(self) -> Any:
        self.skip_ws()
        if self.at_end():
            raise _Malformed("missing value")
        if self.peek(self.quote):
            return self.quoted()
        if self.peek('"'):
            value, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
            return value
        if self.peek("{"):
            self.pos += 1
            return self.object()
        if self.peek("["):
            self.pos += 1
            return self.array()
        return self.scalar()

    def quoted(self) -> str:
        start = self.pos + len(self.quote)
        end = self.text.find(self.quote, start)
        if end < 0:
            raise _Malformed("unterminated string")
        self.pos = end + len(self.quote)
        return self.text[start:end]

    def scalar(self) -> Any:
        match = _SCALAR_END.search(self.text, self.pos)
        end = match.start() if match else len(self.text)
        raw, self.pos = self.text[self.pos : end].strip(), end
        if not raw:
            raise _Malformed("missing value")
        try:
            return strict_loads(raw)
        except ValueError:
            return raw


def parse_gemma_call(body: str, quote: str) -> Optional[ParsedCall]:
    """Read `call:NAME{...}`; None when the body does not fit the grammar."""
    head = _HEAD.match(body)
    if not head:
        return None
    reader = _BodyReader(body, quote)
    reader.pos = head.end()
    try:
        args = reader.object()
    except (_Malformed, ValueError):
        return None
    return (head.group(1), args) if reader.at_end() else None


class Gemma4Parser(DelimitedBlockParser):
    """`gemma4`: the wire formats and grammar are in this module's docstring."""

    end_tags = {"<|tool_call>": "<tool_call|>", "<start_function_call>": "<end_function_call>"}
    marker_tokens = ("<|tool_call>", "<tool_call|>", '<|"|>', "<start_function_call>", "<end_function_call>",
                     "<escape>")

    def _parse_body(self, body: str) -> Optional[list[ParsedCall]]:
        call = parse_gemma_call(body, _QUOTES[self._open_tag])
        return [call] if call else None
