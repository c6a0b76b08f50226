"""Helpers for tests and demos: the tiny tokenizer and a scripted engine."""

from agentloop_core.testing.scripted import ScriptedCall, ScriptedServer
from agentloop_core.testing.tiny_tokenizer import (
    chat_template,
    load_tiny_tokenizer,
    tiny_tokenizer_path,
)

__all__ = ["ScriptedCall", "ScriptedServer", "chat_template", "load_tiny_tokenizer", "tiny_tokenizer_path"]
