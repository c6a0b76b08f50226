"""A small JSON-schema check for tool-call arguments.

Tool schemas from ``@function_tool`` and MCP servers use a narrow slice of JSON Schema
(``type``, ``properties``, ``required``, ``enum``, ``items``, ``additionalProperties``). Checking
that slice here keeps the parser free of a ``jsonschema`` dependency and, more importantly,
returns every problem as plain text the model can read and fix on its next turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _is_type(value: Any, type_name: str) -> bool:
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        # JSON has one number type: 3.0 is a valid integer, True is not.
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "null":
        return value is None
    return True  # a type this check does not know is not the model's fault


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name) and not (name == "integer" and isinstance(value, float)):
            return name
    return type(value).__name__


def _check(value: Any, schema: Any, path: str, problems: list[str], depth: int) -> None:
    if not isinstance(schema, Mapping) or depth > 32:
        return
    expected = schema.get("type")
    if expected is not None:
        types = [expected] if isinstance(expected, str) else list(expected) if isinstance(expected, list) else []
        types = [t for t in types if isinstance(t, str)]
        if schema.get("nullable") is True:
            types.append("null")
        if types and not any(_is_type(value, t) for t in types):
            want = " or ".join(types)
            problems.append(f"{path} must be of type {want}, got {_json_type(value)} {_short(value)}")
            return
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and not any(_equal(value, option) for option in enum):
        options = ", ".join(_short(o) for o in enum[:10])
        problems.append(f"{path} must be one of [{options}], got {_short(value)}")
    if isinstance(value, dict):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        for key in required if isinstance(required, list) else []:
            if isinstance(key, str) and key not in value:
                problems.append(f"{path}.{key} is required but missing")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], f"{path}.{key}", problems, depth + 1)
            elif schema.get("additionalProperties") is False:
                known = ", ".join(sorted(str(k) for k in properties)) or "(none)"
                problems.append(f"{path}.{key} is not an accepted argument; accepted: {known}")
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value[:1000]):
                _check(item, items, f"{path}[{i}]", problems, depth + 1)


def _equal(a: Any, b: Any) -> bool:
    # JSON equality: 1 == 1.0 but True != 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    try:
        return bool(a == b)
    except Exception:
        return False


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_arguments(arguments: Any, parameters: Mapping[str, Any] | None) -> list[str]:
    """Check tool-call arguments against a tool's ``parameters`` JSON schema.

    Args:
        arguments: The decoded ``arguments`` of one call.
        parameters: The tool's parameters schema (an object schema), or None to accept
            any object.

    Returns:
        One readable problem per violation (missing required argument, wrong type, value not
        in ``enum``, unexpected argument when ``additionalProperties`` is false); empty when
        the arguments are valid. Never raises.
    """
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {_json_type(arguments)} {_short(arguments)}"]
    if parameters is None:
        return []
    problems: list[str] = []
    _check(arguments, dict(parameters), "arguments", problems, 0)
    return problems


__all__ = ["check_arguments"]
