"""Incremental tool-call parsers: detokenized model text in, content and tool-call events out.

    parser = make_tool_parser("hermes", tools)
    events = parser.feed(text_delta)      # as tokens arrive
    events += parser.finish()             # once, at the end
    content, calls = parse_complete("hermes", tools, text)   # the same, all at once

`parse_complete` IS the streaming parser run over the whole text, so streamed and
non-streamed results cannot disagree. `parser.malformed` is True when tool-call syntax could
not be read as a call (it went out as content): the API then finishes with "stop".

Formats (`--tool-call-parser`): hermes, qwen3_coder, qwen3_xml, mistral, gemma4, minimax_xml,
bare_json, poolside_v1, deepseek_v3; each class docstring gives the exact wire format it reads.
"""

from __future__ import annotations

from typing import Iterable, Optional

from metrale.api.tool_parsers.base import ToolParser
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
from metrale.api.tool_parsers.gemma4 import Gemma4Parser
from metrale.api.tool_parsers.json_formats import (
    BareJsonParser,
    DeepseekV3Parser,
    HermesParser,
    MistralParser,
    PoolsideV1Parser,
)
from metrale.api.tool_parsers.validation import (
    ToolChoice,
    validate_replayed_tool_call,
    validate_tool_choice,
    validate_tools,
)
from metrale.api.tool_parsers.xml_formats import MinimaxXmlParser, Qwen3XmlParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3XmlParser,
    "qwen3_xml": Qwen3XmlParser,
    "mistral": MistralParser,
    "gemma4": Gemma4Parser,
    "minimax_xml": MinimaxXmlParser,
    "bare_json": BareJsonParser,
    "poolside_v1": PoolsideV1Parser,
    "deepseek_v3": DeepseekV3Parser,
}

_DEFAULTS_BY_MODEL_TYPE = {
    "qwen3_5": "qwen3_coder",
    "qwen3_5_moe": "qwen3_coder",
    "qwen3_next": "qwen3_coder",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "llama": "bare_json",
    "mistral": "mistral",
    "mistral3": "mistral",
    "ministral": "mistral",
    "ministral3": "mistral",
    "mixtral": "mistral",
    "deepseek_v3": "deepseek_v3",
    "nemotron_h": "qwen3_coder",     # the Nemotron 3 releases' chat template writes Qwen3-Coder XML calls
}
_DEFAULTS_BY_PREFIX = {"gemma": "gemma4", "minimax": "minimax_xml"}


def make_tool_parser(
    name: str, tools: Optional[Iterable[dict]], new_id: Optional[IdFactory] = None
) -> ToolParser:
    """A fresh parser for one model output. `tools` are the request's declared tools (calls to
    any other name are content); `new_id` makes tool-call ids (inject a fixed one in tests;
    None: the format's own, `call_` + 24 characters except mistral's 9)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(PARSERS)}")
    return PARSERS[name](tools) if new_id is None else PARSERS[name](tools, new_id)


def marker_tokens(name: str) -> tuple[str, ...]:
    """The words of parser `name`'s format that a tokenizer may hold as special tokens."""
    return PARSERS[name].marker_tokens


def parse_complete(
    name: str, tools: Optional[Iterable[dict]], text: str, new_id: Optional[IdFactory] = None
) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the streaming parser fed the text in one piece."""
    return make_tool_parser(name, tools, new_id).parse_complete(text)


def default_tool_parser(model_type: str) -> Optional[str]:
    """The tool-call parser a checkpoint's config.json `model_type` gets by default, or None
    when we know no format for it (then tool calls are not parsed unless configured)."""
    if model_type in _DEFAULTS_BY_MODEL_TYPE:
        return _DEFAULTS_BY_MODEL_TYPE[model_type]
    for prefix, parser in _DEFAULTS_BY_PREFIX.items():
        if model_type.startswith(prefix):
            return parser
    return None


__all__ = [
    "PARSERS",
    "BareJsonParser",
    "DeepseekV3Parser",
    "Gemma4Parser",
    "HermesParser",
    "IdFactory",
    "MinimaxXmlParser",
    "MistralParser",
    "PoolsideV1Parser",
    "Qwen3XmlParser",
    "TextDelta",
    "ToolArgsDelta",
    "ToolCall",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolChoice",
    "ToolEvent",
    "ToolParser",
    "collect",
    "default_tool_parser",
    "make_tool_parser",
    "marker_tokens",
    "new_tool_call_id",
    "parse_complete",
    "validate_replayed_tool_call",
    "validate_tool_choice",
    "validate_tools",
]
