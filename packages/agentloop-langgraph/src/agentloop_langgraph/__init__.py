"""agentloop-langgraph: train LangGraph agents on the exact tokens the engine generated.

``ChatModel`` is a LangChain chat model over an agentloop engine that records every turn as
token ids; ``ReactAgentLoop`` (registered as ``react_agent``) runs a LangGraph graph per sample
and returns those ids as an ``AgentLoopOutput``, or as the trajectory's segments when the graph
rewrote its history (``on_history_rewrite``). ``agentloop_langgraph.examples`` holds example
graphs a config can name by import path.
"""

from importlib.metadata import version as _distribution_version

from agentloop_langgraph.chat_model import REQUEST_ID_KEY, ChatModel, TrajectorySession
from agentloop_langgraph.graph import GraphFactory, default_graph_factory, load_graph_factory
from agentloop_langgraph.loop import ReactAgentConfig, ReactAgentLoop
from agentloop_langgraph.messages import (
    METADATA_KEY,
    HistoryRewrite,
    HistoryRewrittenError,
    RolloutLimitReachedError,
    to_chat_dict,
)
from agentloop_langgraph.tools import AgentLoopTool, to_langchain_tool

__version__ = _distribution_version("agentloop-langgraph")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
    "METADATA_KEY",
    "REQUEST_ID_KEY",
    "AgentLoopTool",
    "ChatModel",
    "GraphFactory",
    "HistoryRewrite",
    "HistoryRewrittenError",
    "ReactAgentConfig",
    "ReactAgentLoop",
    "RolloutLimitReachedError",
    "TrajectorySession",
    "default_graph_factory",
    "load_graph_factory",
    "to_chat_dict",
    "to_langchain_tool",
]

