"""Tool-call parsers by name: ``get_tool_parser("hermes")``, ``"llama3_json"``, ``"gpt_oss"``
(alias ``"harmony"``), ``"mistral"``, ``"qwen3_coder"``. Pure text in, calls out, so the tool
loops (agentloop-tools), the gateway (agentloop-engines) and LangGraph's chat model share them.
Installed packages add their own through the ``agentloop.tool_parsers`` entry-point group
(:mod:`agentloop_core.parsers.registry`)."""

from agentloop_core.parsers.base import (
    ParseResult,
    ParseStats,
    ToolCall,
    ToolCallError,
    ToolParser,
    json_error,
    tool_function,
    tool_parameters,
)
from agentloop_core.parsers.registry import (
    DEFAULT_TOOL_PARSER,
    UnknownToolParserError,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from agentloop_core.parsers.schema_check import check_arguments

# Importing the modules registers the built-in parsers.
from agentloop_core.parsers.hermes import HermesToolParser  # noqa: E402  isort: skip
from agentloop_core.parsers.llama3_json import Llama3JsonToolParser  # noqa: E402  isort: skip
from agentloop_core.parsers.harmony import GptOssToolParser  # noqa: E402  isort: skip
from agentloop_core.parsers.mistral import MistralToolParser  # noqa: E402  isort: skip
from agentloop_core.parsers.qwen3_coder import Qwen3CoderToolParser  # noqa: E402  isort: skip

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "GptOssToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParseResult",
    "Qwen3CoderToolParser",
    "ParseStats",
    "ToolCall",
    "ToolCallError",
    "ToolParser",
    "UnknownToolParserError",
    "check_arguments",
    "get_tool_parser",
    "json_error",
    "register_tool_parser",
    "tool_function",
    "tool_parameters",
    "tool_parser_names",
]
