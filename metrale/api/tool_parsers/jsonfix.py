"""Lenient-but-conservative JSON reading and the one canonical JSON writer.

Repairs applied, in order, only when strict `json.loads` fails:
  1. trailing commas before `}` / `]` are removed (outside strings);
  2. brackets left open at the end of the text are closed (only when the text does not end
     inside a string: a truncated string value is never invented);
  3. a Python-literal dict/list with single-quoted strings (`{'a': 'b'}`) is read with
     `ast.literal_eval` (no code runs) when the result is plain JSON data.
NaN / Infinity are rejected: they are not JSON.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any, Optional

_CLOSER = {"{": "}", "[": "]"}


@dataclass(frozen=True)
class JsonScan:
    """Where a JSON value that starts with `{` or `[` ends, or why it has not ended yet."""

    end: Optional[int]  # index just past the balanced value, None if not reached
    open_brackets: str  # brackets still open at the end of the text
    in_string: bool
    broken: bool  # a closer that does not match its opener


class _Structural:
    """Iterates (index, char) over the characters of `text` from `start` that lie outside JSON
    strings (string contents and their quotes are skipped); `in_string` tells afterwards
    whether the text ended inside a string."""

    def __init__(self, text: str, start: int = 0):
        self.text, self.start, self.in_string = text, start, False

    def __iter__(self):
        escaped = False
        text = self.text
        for i in range(self.start, len(text)):
            ch = text[i]
            if self.in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            else:
                yield i, ch


def scan_json(text: str, start: int = 0) -> JsonScan:
    """Scan from text[start] (an opener) until brackets balance, tracking strings."""
    stack: list[str] = []
    chars = _Structural(text, start)
    for i, ch in chars:
        if ch in _CLOSER:
            stack.append(ch)
        elif ch in "}]":
            if not stack or _CLOSER[stack[-1]] != ch:
                return JsonScan(None, "".join(stack), False, True)
            stack.pop()
            if not stack:
                return JsonScan(i + 1, "", False, False)
    return JsonScan(None, "".join(stack), chars.in_string, False)


def canonical_json(value: Any) -> str:
    """The one serialisation of arguments: `json.dumps` defaults, UTF-8 kept (no \\u escapes)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_loads(text: str) -> Any:
    """`json.loads` that refuses NaN, Infinity and numbers that overflow to infinity."""
    value = json.loads(text, parse_constant=_reject_constant)
    if not _is_plain_json_data(value):
        raise ValueError("number out of range")
    return value


def _drop_trailing_commas(text: str) -> str:
    drop = {i for i, ch in _Structural(text)
            if ch == "," and text[i + 1:].lstrip()[:1] in ("}", "]")}
    return "".join(ch for i, ch in enumerate(text) if i not in drop)


def _close_open_brackets(text: str) -> Optional[str]:
    stripped = text.strip()
    if not stripped or stripped[0] not in _CLOSER:
        return None
    scan = scan_json(stripped)
    if scan.broken or scan.in_string or scan.end is not None:
        return None
    return stripped + "".join(_CLOSER[b] for b in reversed(scan.open_brackets))


def _is_plain_json_data(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain_json_data(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_plain_json_data(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))


def _python_literal(text: str) -> Any:
    if "'" not in text:
        raise ValueError("not a single-quoted literal")
    value = ast.literal_eval(text.strip())
    if not isinstance(value, (dict, list)) or not _is_plain_json_data(value):
        raise ValueError("not plain JSON data")
    return value


def loads_lenient(text: str) -> Any:
    """Parse JSON, applying the conservative repairs above; raise ValueError if none works."""
    candidates = [text]
    no_commas = _drop_trailing_commas(text)
    candidates.append(no_commas)
    closed = _close_open_brackets(no_commas)
    if closed is not None:
        candidates.append(closed)
    for candidate in candidates:
        try:
            return strict_loads(candidate)
        except ValueError:
            continue
    try:
        return _python_literal(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError("not JSON, even after repair") from None
