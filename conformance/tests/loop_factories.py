"""Loop factories for the no-code option (``--agentloop-loop=loop_factories:tool_agent``) and for
test_loops.py: the real tool_agent and react_agent with the calculator on the tiny tokenizer
(imported by module name; pytest puts tests/ on sys.path)."""

from __future__ import annotations

from typing import Any

from agentloop_core.testing import load_tiny_tokenizer

GIVEN_TOKENIZERS: list[Any] = []
"""Tokenizers the factories were given (``--agentloop-tokenizer``), for the tests to check."""

RESPONSE_LENGTH = 1024
"""Room for every scripted turn of the suite's tool scenario (single-character ids)."""


def _config(**extra: Any) -> dict[str, Any]:
    from agentloop_tools import calculator

    return {"tools": {"calculator": calculator}, "response_length": RESPONSE_LENGTH, **extra}


def tool_agent(server: Any, tokenizer: Any = None) -> Any:
    """``tool_agent`` with the calculator; takes ``--agentloop-tokenizer`` when given."""
    from agentloop_tools import ToolAgentLoop

    if tokenizer is not None:
        GIVEN_TOKENIZERS.append(tokenizer)
    return ToolAgentLoop(server, tokenizer or load_tiny_tokenizer(), _config())


def react_agent(server: Any, tokenizer: Any = None) -> Any:
    """``react_agent`` (the default ReAct graph) with the calculator."""
    from agentloop_langgraph import ReactAgentLoop

    return ReactAgentLoop(server, tokenizer or load_tiny_tokenizer(), _config())


def tiny_tokenizer() -> Any:
    """The tiny tokenizer, for ``--agentloop-tokenizer=loop_factories:tiny_tokenizer``."""
    return load_tiny_tokenizer()


def _ask_once() -> Any:
    from agentloop_tools.interaction import BaseInteraction

    class AskOnce(BaseInteraction):
        """A user who asks "Are you sure?" after the model's first plain answer, then ends."""

        async def generate_response(self, instance_id, messages, **kwargs):
            state = self.state(instance_id)
            state["asked"] = state.get("asked", 0) + 1
            return state["asked"] > 1, "Are you sure?", 0.0, {}

    return AskOnce()


def tool_agent_with_user(server: Any, tokenizer: Any = None) -> Any:
    """``tool_agent`` with the calculator and a simulated user (an interaction)."""
    from agentloop_tools import ToolAgentLoop

    return ToolAgentLoop(server, tokenizer or load_tiny_tokenizer(), _config(interaction=_ask_once()))
