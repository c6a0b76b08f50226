"""Infer an OpenAI function schema from a Python function's type hints and Google docstring.

Kept dependency-free (no transformers import) so ``agentloop-tools`` stays light. Nullable
arguments use standard JSON Schema (``"type": ["string", "null"]``) rather than OpenAPI's
``nullable: true``, so any JSON-Schema validator accepts ``null`` for them.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

from agentloop_tools.schema import OpenAIFunctionToolSchema

__all__ = ["json_schema_for_type", "parse_google_docstring", "schema_from_function"]

_SIMPLE: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|Attributes)\s*:\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def json_schema_for_type(tp: Any, *, where: str = "argument") -> dict[str, Any]:
    """JSON schema for one Python type annotation.

    Covers str/int/float/bool/None, ``Any``, ``list[T]``, ``tuple[T, ...]``, ``set[T]``,
    ``dict[str, V]``, ``Optional[T]`` / ``T | None`` (nullable), unions
    (``int | float`` -> ``["integer", "number"]``), ``Literal[...]`` and ``Enum`` (enum).

    Args:
        tp: The annotation.
        where: Named in error messages (e.g. ``"argument 'x' of f"``).

    Raises:
        TypeError: The annotation has no JSON-schema equivalent.
    """
    if tp is Any or tp is inspect.Parameter.empty:
        return {}
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        return {**_common_type(values), "enum": values}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return {**_common_type(list(args)), "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        return _union_schema(args, where)
    if origin is typing.Annotated:
        return json_schema_for_type(args[0], where=where)
    if tp in (list, tuple, set, frozenset) or origin in (list, set, frozenset, Sequence):
        schema: dict[str, Any] = {"type": "array"}
        if args:
            schema["items"] = json_schema_for_type(args[0], where=where)
        return schema
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": json_schema_for_type(args[0], where=where)}
        items = [json_schema_for_type(a, where=where) for a in args]
        return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
    if tp is dict or origin in (dict, Mapping):
        schema = {"type": "object"}
        if args:
            if args[0] not in (str, Any):
                raise TypeError(f"{where}: dict keys must be str in JSON, got {args[0]!r}; use dict[str, ...]")
            schema["additionalProperties"] = json_schema_for_type(args[1], where=where)
        return schema
    raise TypeError(
        f"{where}: type {tp!r} has no JSON-schema equivalent; use str/int/float/bool, list[T], "
        "dict[str, V], Literal, Enum, Optional or a union of those, or pass schema= explicitly"
    )


def _common_type(values: list[Any]) -> dict[str, Any]:
    kinds = {_SIMPLE.get(type(v)) for v in values}
    return {"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}


def _union_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    parts = [json_schema_for_type(a, where=where) for a in args]
    # Unions of plain types collapse to a type list, which every validator and template reads.
    if all(set(p) == {"type"} for p in parts):
        names: list[str] = []
        for p in parts:
            for t in p["type"] if isinstance(p["type"], list) else [p["type"]]:
                if t not in names:
                    names.append(t)
        return {"type": names[0] if len(names) == 1 else names}
    if any(p == {} for p in parts):
        return {}
    return {"anyOf": parts}


def parse_google_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its description and per-argument descriptions.

    Args:
        doc: The docstring (None or empty gives ``("", {})``).

    Returns:
        ``(description, {arg_name: description})``; continuation lines are joined with spaces.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        match = _SECTION.match(line)
        if match:
            section, current, arg_indent = match.group(1).lower(), None, None
            continue
        if section is None:
            summary.append(line)
        elif section in ("args", "arguments", "parameters", "params"):
            stripped = line.strip()
            if not stripped:
                continue
            indent = len(line) - len(line.lstrip())
            arg = _ARG_LINE.match(stripped)
            # A new argument starts at the section's argument indent; deeper lines continue it.
            if arg and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = name = arg.group(1).lstrip("*")
                args[name] = arg.group(3).strip()
            elif current is not None:
                args[current] = f"{args[current]} {stripped}".strip()
    return " ".join(" ".join(summary).split()), args


def schema_from_function(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> OpenAIFunctionToolSchema:
    """Build a tool schema from a function's signature, type hints and Google docstring.

    A parameter without a default is required. A parameter with no docstring entry gets no
    ``description`` (allowed); the function itself must have a docstring or ``description=``,
    because the model decides when to call a tool from that text.

    Args:
        fn: The function (sync or async).
        name: Tool name; defaults to ``fn.__name__``.
        description: Overrides the docstring summary.

    Raises:
        TypeError: ``*args``/``**kwargs`` or positional-only parameters, or an unsupported hint.
        ValueError: No description available, or the docstring documents an unknown argument.
    """
    fn_name = name or getattr(fn, "__name__", None) or type(fn).__name__
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # unresolved forward refs: name the function, not just the type
        raise TypeError(f"function tool {fn_name!r}: cannot resolve type hints: {exc}") from exc
    doc_description, doc_args = parse_google_docstring(inspect.getdoc(fn))
    description = description if description is not None else doc_description
    if not description:
        raise ValueError(
            f"function tool {fn_name!r} has no description: add a docstring (first line says what "
            "the tool does) or pass @function_tool(description=...)"
        )
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []
    for pname, param in sig.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            star = "*" if param.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            raise TypeError(
                f"function tool {fn_name!r}: {star}{pname} is not allowed; a model calls tools with "
                "named JSON arguments, so declare each argument explicitly"
            )
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(
                f"function tool {fn_name!r}: positional-only parameter {pname!r} cannot be passed by "
                "name; remove the '/' from the signature"
            )
        prop = json_schema_for_type(hints.get(pname, Any), where=f"argument {pname!r} of {fn_name!r}")
        if pname in doc_args and doc_args[pname]:
            prop["description"] = doc_args[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        elif _json_default(param.default):
            prop["default"] = param.default
        properties[pname] = prop
    unknown = sorted(set(doc_args) - set(properties))
    if unknown:
        raise ValueError(
            f"function tool {fn_name!r}: docstring documents {unknown} which are not parameters "
            f"(parameters: {list(properties)}); fix the Args: section"
        )
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": fn_name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required},
            },
        }
    )


def _json_default(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) and not isinstance(value, enum.Enum)
