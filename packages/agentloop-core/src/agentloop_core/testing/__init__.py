"""Helpers for tests and demos: the tiny tokenizer and a scripted engine."""

from agentloop_core.testing.scripted import ScriptedCall, ScriptedServer
from agentloop_core.testing.templates import (
    COUNTING_TOOL_RESULTS_TEMPLATE,
    CountingProcessor,
    TemplateTurnError,
    one_render_holds,
    template_turn_text,
    tiny_tokenizer_for_template,
)
from agentloop_core.testing.tiny_tokenizer import (
    chat_template,
    load_tiny_tokenizer,
    tiny_tokenizer_path,
)

__all__ = [
    "COUNTING_TOOL_RESULTS_TEMPLATE",
    "CountingProcessor",
    "ScriptedCall",
    "ScriptedServer",
    "TemplateTurnError",
    "chat_template",
    "load_tiny_tokenizer",
    "one_render_holds",
    "template_turn_text",
    "tiny_tokenizer_for_template",
    "tiny_tokenizer_path",
]
