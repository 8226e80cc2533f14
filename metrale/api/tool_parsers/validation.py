"""Request-side checks for tools: declared tools, tool_choice, replayed assistant tool calls.

Each raises ValueError with a message that says what was wrong and what to send instead; the
API layer wraps it in its own error shape (HTTP 400).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolChoice:
    """`mode` is "auto", "none" or "required"; `name` is set when one function is forced
    (mode "required")."""

    mode: str
    name: Optional[str] = None


def validate_tools(tools: Any) -> None:
    """OpenAI tools: `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`.

    Names match ^[a-zA-Z0-9_-]{1,64}$ and are unique; `parameters`, when given, is a JSON
    schema object (a dict whose `type`, if present, is "object") that is valid against its
    metaschema (`$schema`, else draft 2020-12) and whose `$ref`s all resolve inside it.
    """
    if not isinstance(tools, list):
        raise ValueError("`tools` must be a list of {\"type\": \"function\", \"function\": {...}}")
    seen: set[str] = set()
    for position, tool in enumerate(tools):
        name = _validate_tool(tool, f"tools[{position}]")
        if name in seen:
            raise ValueError(f"tools[{position}]: function name {name!r} is declared twice")
        seen.add(name)


def _validate_tool(tool: Any, where: str) -> str:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValueError(f'{where}: expected {{"type": "function", "function": {{...}}}}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function: expected an object with a `name`")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"{where}.function.name: {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$ "
            "(letters, digits, _ and -, at most 64)"
        )
    params = function.get("parameters")
    if params is not None and (
        not isinstance(params, dict) or params.get("type", "object") != "object"
    ):
        raise ValueError(
            f"{where}.function.parameters: must be a JSON schema object, "
            'e.g. {"type": "object", "properties": {...}}'
        )
    if params is not None:
        problem = schema_problem(json.dumps(params, sort_keys=True))
        if problem:
            raise ValueError(f"{where}.function.parameters: tool {name!r} has an invalid JSON "
                             f"schema: {problem}")
    return name


@lru_cache(maxsize=512)
def schema_problem(schema_json: str) -> Optional[str]:
    """What is wrong with a JSON schema (given as JSON text, so results can be cached: clients
    such as Claude Code send the same tools on every request), or None."""
    schema = json.loads(schema_json)
    validator = jsonschema.validators.validator_for(schema,
                                                    default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.path)
        return f"{e.message}" + (f" (at {at})" if at else "")
    return _unresolved_ref(schema)


def _unresolved_ref(schema: dict) -> Optional[str]:
    """The first `$ref` that does not resolve inside the schema itself (none are fetched)."""
    resource = referencing.jsonschema.DRAFT202012.create_resource(schema)
    resolver = referencing.Registry().with_resource("urn:tool", resource).resolver("urn:tool")
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                if not ref.startswith("#"):
                    return (f"$ref {ref!r} points outside the schema; only local refs "
                            "(#/...) are read")
                try:
                    resolver.lookup(ref)
                except referencing.exceptions.Unresolvable:
                    return f"$ref {ref!r} does not resolve inside the schema"
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default",
                                                                   "examples"))
    return None


def validate_tool_choice(tool_choice: Any, tools: Optional[list]) -> ToolChoice:
    """Accepts None (= "auto" with tools, "none" without), "auto", "none", "required", or
    `{"type": "function", "function": {"name": NAME}}` naming a declared tool."""
    names = [t["function"]["name"] for t in tools or () if isinstance(t.get("function"), dict)]
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not names:
            raise ValueError('tool_choice "required" needs at least one tool in `tools`')
        return ToolChoice(tool_choice)
    name = _forced_name(tool_choice)
    if name not in names:
        declared = ", ".join(names) or "none"
        raise ValueError(
            f"tool_choice names function {name!r}, which is not in `tools` (declared: {declared})"
        )
    return ToolChoice("required", name)


def _forced_name(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise ValueError(
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": "..."}}'
        )
    return function["name"]


def validate_replayed_tool_call(arguments: Any) -> dict:
    """Arguments of a tool call the client sends back in an assistant message: a JSON object,
    given as a string (OpenAI) or an object (Anthropic `input`). Returns it as a dict."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError(
                f"assistant tool_calls[].function.arguments is not valid JSON: {arguments[:80]!r}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(
            "assistant tool_calls[].function.arguments must be a JSON object, "
            f"got {type(value).__name__}"
        )
    return value
