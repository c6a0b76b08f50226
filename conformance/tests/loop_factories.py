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


def _calculator_env() -> type:
    from agentloop_core.environment import Environment, StepResult
    from agentloop_tools import calculator
    from agentloop_tools.builtin.calculator import CalculatorError, evaluate_expression, format_number

    class CalculatorEnv(Environment):
        """Answers ``calculator`` calls (errors as text); the first turn without calls gets a
        user turn asking to check, the second ends it."""

        def __init__(self) -> None:
            self.answers = 0

        def tool_schemas(self):
            return [calculator.tool_schema.model_dump(exclude_none=True)]

        async def step(self, turn):
            if not (turn.tool_calls or turn.tool_call_errors):
                self.answers += 1
                if self.answers == 1:
                    return StepResult([{"role": "user", "content": "Check your answer."}], 0.0, False, {})
                return StepResult([], float("5" in turn.content), True, {})
            out = []
            for call, call_id in zip(turn.tool_calls, turn.tool_call_ids, strict=True):
                try:
                    text = format_number(evaluate_expression(str(call.arguments.get("expression", ""))))
                except CalculatorError as exc:
                    text = f"Error: {exc}"
                out.append({"role": "tool", "name": call.name, "tool_call_id": call_id, "content": text})
            for error, call_id in zip(turn.tool_call_errors, turn.error_call_ids, strict=True):
                out.append({"role": "tool", "name": error.name or "", "tool_call_id": call_id,
                            "content": f"Error: {error.reason}"})
            return StepResult(out, 0.0, False, {})

    return CalculatorEnv


def __getattr__(name: str) -> Any:
    if name == "CalculatorEnv":
        cls = _calculator_env()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def env_config() -> dict[str, Any]:
    """``env_agent``'s config: the calculator environment above, by import path."""
    return {"environment": "loop_factories:CalculatorEnv", "response_length": RESPONSE_LENGTH}


def env_agent(server: Any, tokenizer: Any = None) -> Any:
    """``env_agent`` running a calculator environment (tool calls answered by the environment, a
    first answer by a user turn), with arguments that make its calculator fail (the suite's
    ``tool_error`` turn)."""
    from agentloop_tools.env_agent import EnvAgentLoop

    class CalculatorEnvLoop(EnvAgentLoop):
        def conformance_profile(self) -> dict[str, Any]:
            return {**super().conformance_profile(), "interaction": True,
                    "failing_arguments": {"calculator": {"expression": "1 / 0"}}}

    return CalculatorEnvLoop(server, tokenizer or load_tiny_tokenizer(), env_config())
