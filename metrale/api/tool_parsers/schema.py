"""The declared tools, as the parsers need them: name -> JSON schema of the parameters.

Accepts OpenAI tools (`{"type": "function", "function": {"name", "parameters"}}`), bare
function objects (`{"name", "parameters"}`) and Anthropic tools (`{"name", "input_schema"}`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from metrale.api.tool_parsers.jsonfix import loads_lenient, strict_loads

_CONVERTED_TYPES = ("null", "boolean", "integer", "number", "object", "array")


def tool_schemas(tools: Optional[Iterable[dict]]) -> dict[str, dict]:
    """Map each declared tool name to its parameters schema ({} when none is given)."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        params = function.get("parameters", function.get("input_schema")) or {}
        schemas[function["name"]] = params if isinstance(params, dict) else {}
    return schemas


def declared_types(parameters_schema: dict, param: str) -> Optional[frozenset[str]]:
    """JSON types a parameter accepts (from `type`, a list of types, or anyOf/oneOf members).

    None when the parameter is not declared at all.
    """
    properties = parameters_schema.get("properties") or {}
    if param not in properties or not isinstance(properties[param], dict):
        return None
    return frozenset(_types_of(properties[param]))


def _types_of(schema: dict) -> set[str]:
    declared = schema.get("type")
    types = set(declared if isinstance(declared, list) else [declared] if declared else [])
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            if isinstance(member, dict):
                types |= _types_of(member)
    if not types and "enum" in schema:
        types = {_json_type(v) for v in schema["enum"]}
    return types


def _json_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "number" if isinstance(value, (int, float)) else "object"


def is_text_param(types: Optional[frozenset[str]]) -> bool:
    """A parameter whose raw text is its value, so it can stream as it arrives: undeclared,
    untyped, or a (non-nullable) string."""
    if not types or not (types & set(_CONVERTED_TYPES)):
        return True
    return "string" in types and "null" not in types


def convert_value(text: str, types: Optional[frozenset[str]]) -> Any:
    """Turn a parameter's raw text into the value its schema asks for; keep text if it fails.

    `null` is None for nullable parameters; strings win over the other types."""
    if is_text_param(types):
        return text
    if "null" in types and text.strip() == "null":
        return None
    if "string" in types:
        return text
    for json_type in _CONVERTED_TYPES[1:]:
        if json_type in types:
            converted = _try_convert(text.strip(), json_type)
            if converted is not _FAILED:
                return converted
    return text


_FAILED = object()


def _try_convert(text: str, json_type: str) -> Any:
    if json_type == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _FAILED)
    try:
        value = loads_lenient(text) if json_type in ("object", "array") else strict_loads(text)
    except ValueError:
        return _FAILED
    if json_type == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)
    expected = {"integer": int, "number": (int, float), "object": dict, "array": list}[json_type]
    if isinstance(value, bool) or not isinstance(value, expected):
        return _FAILED
    return value
