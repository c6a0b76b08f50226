"""Delta multi-turn tokenization: render chat messages with the model's template, append
engine-generated ids verbatim (mask 1) and everything else as template deltas (mask 0), and
check the result against a full re-tokenization. Built-in tool-aware templates by name
(:mod:`~agentloop_core.tokenization.builtin_templates`) and whether a template renders ``tools=``
(:func:`renders_tools`). Special-token strings inside message content are encoded as text,
never as control tokens (:mod:`~agentloop_core.tokenization.content_marks`)."""

from agentloop_core.tokenization.builtin_templates import (
    chat_template_names,
    resolve_chat_template,
    set_chat_template,
)
from agentloop_core.tokenization.content_marks import ContentMarks, content_marks
from agentloop_core.tokenization.opaque import BASE_CONVERSATION
from agentloop_core.tokenization.renderer import ChatRenderer, DeltaResult, TokenizationMismatchError
from agentloop_core.tokenization.sanity import SANITY_CHECK_MODES, SanityCheckMode, SanityCheckReport
from agentloop_core.tokenization.template_errors import ChatTemplateError
from agentloop_core.tokenization.tool_support import renders_tools
from agentloop_core.tokenization.trajectory import Trajectory

__all__ = [
    "BASE_CONVERSATION",
    "SANITY_CHECK_MODES",
    "ChatRenderer",
    "ChatTemplateError",
    "ContentMarks",
    "DeltaResult",
    "SanityCheckMode",
    "SanityCheckReport",
    "TokenizationMismatchError",
    "Trajectory",
    "chat_template_names",
    "content_marks",
    "renders_tools",
    "resolve_chat_template",
    "set_chat_template",
]
