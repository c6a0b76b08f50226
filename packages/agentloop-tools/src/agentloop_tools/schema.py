"""Tool records: what a tool returns (:class:`ToolResponse`) and how it is described to the model
(:class:`OpenAIFunctionToolSchema`, the OpenAI function-calling format that chat templates take
through ``apply_chat_template(tools=[schema.model_dump(exclude_none=True)])``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "schema_dict",
]


@dataclass
class ToolResponse:
    """What one tool call returns to the loop; the loop renders it as a ``tool`` message."""

    text: str | None = None
    """Text shown to the model (already JSON-encoded when the tool returned structured data)."""
    image: list | None = None
    """Images shown to a vision-language model, in order: PIL images, encoded bytes,
    ``{"bytes": ...}`` cells or ``data:image/...`` URLs (see :mod:`agentloop_tools.tool_media`)."""
    video: list | None = None
    """Videos: not supported; the loops refuse them with error text for the model."""

    def __post_init__(self) -> None:
        if self.text is not None and not isinstance(self.text, str):
            raise TypeError(
                f"ToolResponse.text must be a str or None, got {type(self.text).__name__}; "
                "encode structured results first (e.g. json.dumps)"
            )
        for name in ("image", "video"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise TypeError(f"ToolResponse.{name} must be a list or None, got {type(value).__name__}")

    def is_empty(self) -> bool:
        """True when the response carries no text, image or video."""
        return not self.text and not self.image and not self.video


class OpenAIFunctionParametersSchema(BaseModel):
    """JSON schema of a function's arguments. Extra JSON-schema keys (``$defs``,
    ``additionalProperties``...) are kept, because MCP servers send them."""

    model_config = ConfigDict(extra="allow")

    type: Literal["object"] = "object"
    """Arguments are always a JSON object."""
    properties: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """JSON schema of each argument, by name."""
    required: list[str] = Field(default_factory=list)
    """Names of the arguments without a default."""

    @field_validator("required")
    @classmethod
    def _required_unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"'required' lists an argument twice: {value}")
        return value


class OpenAIFunctionSchema(BaseModel):
    """The ``function`` part of an OpenAI tool: name, description, argument schema."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    """Name the model calls the tool by."""
    description: str = ""
    """What the tool does; the model reads it to decide when to call the tool."""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    """JSON schema of the arguments."""
    strict: bool | None = None
    """OpenAI structured-outputs flag; None leaves it out of the rendered schema."""

    @field_validator("name")
    @classmethod
    def _name_is_identifier_like(cls, value: str) -> str:
        # Tool-call parsers match names as plain tokens; spaces or quotes would break them.
        if any(ch.isspace() or ch in "\"'`" for ch in value):
            raise ValueError(f"tool name {value!r} must not contain spaces or quotes")
        return value


class OpenAIFunctionToolSchema(BaseModel):
    """One tool as chat templates expect it: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    """Always ``function``."""
    function: OpenAIFunctionSchema
    """Name, description and argument schema."""

    @property
    def name(self) -> str:
        """The tool's name (``function.name``)."""
        return self.function.name


_LAST_DUMP: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Per tool object (held weakly): the last dump of its schema, the one every equal dump shares."""


def schema_dict(tool: Any) -> dict[str, Any]:
    """``tool.tool_schema.model_dump(exclude_none=True)``: the schema as chat templates take it,
    read afresh at every call (a schema changed in place is seen), but the same dict object as
    the previous call's when the two are equal, so the loops built per sample (thousands in
    flight) hold one dict per tool instead of one each (0.86 KB a trajectory for the
    calculator). Treat it as read-only: loops share it."""
    dump = tool.tool_schema.model_dump(exclude_none=True)
    try:
        last = _LAST_DUMP.get(tool)
        if last is not None and last == dump:
            return last
        _LAST_DUMP[tool] = dump
    except TypeError:  # a tool object that cannot be a weak key (unhashable): not shared
        pass
    return dump
