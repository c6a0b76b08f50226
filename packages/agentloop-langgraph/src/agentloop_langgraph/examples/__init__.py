"""Example graphs, importable by path from a config (``graph_factory: "pkg.module:function"``)."""

from agentloop_langgraph.examples.summarising_agent import SUMMARY_NAME, summarising_agent

__all__ = ["SUMMARY_NAME", "summarising_agent"]
