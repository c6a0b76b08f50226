"""agentloop-tools: tools, tool-call parsers and the multi-turn tool agent loop.

MCP support (``agentloop_tools.mcp``) needs the ``[mcp]`` extra and is imported on use.
"""

from importlib.metadata import version as _distribution_version

from agentloop_core.parsers import (
    ParseResult,
    ToolCall,
    ToolCallError,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from agentloop_tools.agent_loop import AgentState, ToolAgentLoop
from agentloop_tools.base import BaseTool, ToolKwargsError
from agentloop_tools.builtin import (
    Gsm8kTool,
    ImageZoomInTool,
    PythonSandboxTool,
    calculator,
    evaluate_expression,
)
from agentloop_tools.function_tool import FunctionTool, function_tool
from agentloop_tools.interaction import (
    BaseInteraction,
    Gsm8kInteraction,
    load_interaction,
    load_interaction_config,
    load_interactions,
)
from agentloop_tools.load_tools import load_tools
from agentloop_tools.loop_config import (
    ToolAgentConfig,
    ToolLoopConfig,
    check_loop_config_keys,
    loop_setting,
)
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse
from agentloop_tools.sync_pool import SyncToolPool, SyncToolPoolFullError
from agentloop_tools.truncation import cut_tool_response, truncate_text, truncate_tokens

__version__ = _distribution_version("agentloop-tools")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
    "AgentState",
    "BaseInteraction",
    "BaseTool",
    "FunctionTool",
    "Gsm8kInteraction",
    "Gsm8kTool",
    "ImageZoomInTool",
    "OpenAIFunctionToolSchema",
    "ParseResult",
    "PythonSandboxTool",
    "SyncToolPool",
    "SyncToolPoolFullError",
    "ToolAgentConfig",
    "ToolAgentLoop",
    "ToolCall",
    "ToolCallError",
    "ToolKwargsError",
    "ToolLoopConfig",
    "ToolParser",
    "ToolResponse",
    "calculator",
    "check_loop_config_keys",
    "cut_tool_response",
    "evaluate_expression",
    "function_tool",
    "get_tool_parser",
    "load_interaction",
    "load_interaction_config",
    "load_interactions",
    "load_tools",
    "loop_setting",
    "register_tool_parser",
    "tool_parser_names",
    "truncate_text",
    "truncate_tokens",
]
