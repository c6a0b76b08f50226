"""Reasoning parsers by name: ``get_reasoning_parser("qwen3")`` (alias ``"qwq"``),
``"deepseek_r1"``, ``"gpt_oss"`` (alias ``"harmony"``). Pure text in, reasoning and content out,
so the tool loops (agentloop-tools) and the gateway (agentloop-engines) share them. Installed
packages add their own through the ``agentloop.reasoning_parsers`` entry-point group
(:mod:`agentloop_core.reasoning.registry`)."""

from agentloop_core.reasoning.base import PROMPT_TAIL_TOKENS, ReasoningParser, ReasoningSplit
from agentloop_core.reasoning.registry import (
    UnknownReasoningParserError,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

# Importing the modules registers the built-in parsers.
from agentloop_core.reasoning.think import (  # noqa: E402  isort: skip
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
)
from agentloop_core.reasoning.harmony import GptOssReasoningParser  # noqa: E402  isort: skip

__all__ = [
    "PROMPT_TAIL_TOKENS",
    "DeepSeekR1ReasoningParser",
    "GptOssReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningSplit",
    "ThinkReasoningParser",
    "UnknownReasoningParserError",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
