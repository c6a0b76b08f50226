"""Whether a chat template renders ``tools=``: asked once per tokenizer and template by every
part that would otherwise pass tools a template drops without a word (the tool loops before a
rollout, the trainer at start-up, the gateway before answering a request with ``tools``).

Many instruct checkpoints ship a plain template that never reads ``tools`` (SmolLM2's ChatML,
Llama 3.0's): rendering with tools gives the text rendering without them gives, so the model
never sees the schemas. :mod:`agentloop_core.tokenization.builtin_templates` has tool-aware
replacements.

Answers are cached per tokenizer (held weakly: the entry goes with its tokenizer, and a new
tokenizer allocated where a freed one lived never hits it) and per template text and template
variables, so a tokenizer whose template is changed in place is asked again.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from typing import Any

from agentloop_core.tokenization.template_errors import raised_by_template

__all__ = ["PROBE_TOOL_NAME", "renders_tools"]

PROBE_TOOL_NAME = "agentloop_probe_tool"
"""The name of the tool the probe renders; a template that renders tools writes it."""

_PROBE_TOOLS = [{
    "type": "function",
    "function": {"name": PROBE_TOOL_NAME, "description": "Probe.",
                 "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}},
}]
_PROBE_MESSAGES = [{"role": "user", "content": "Hi."}]

_ANSWERS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], bool]] = weakref.WeakKeyDictionary()


def renders_tools(processor: Any, *, chat_template: str | None = None,
                  apply_chat_template_kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether the chat template shows the model the tools it is given.

    It does when a one-message prompt rendered with a probe tool holds the tool's name and
    differs from the prompt rendered without tools. A template that fails without tools (it
    needs them) renders them; one that fails with the probe tool does not.

    Args:
        processor: A Hugging Face tokenizer or processor (its ``apply_chat_template``).
        chat_template: A template replacing the processor's own (as ``ChatRenderer`` takes it).
        apply_chat_template_kwargs: Template variables (``enable_thinking``...).

    Returns:
        The answer, worked out once per processor, template and variables.

    Raises:
        Exception: whatever ``apply_chat_template`` raises that is not a failure of the
            template itself (a bug in the caller's tokenizer object).
    """
    kwargs = dict(apply_chat_template_kwargs or {})
    template = chat_template if chat_template is not None else getattr(processor, "chat_template", None)
    key = (repr(template), json.dumps(kwargs, sort_keys=True, default=str))
    try:
        known = _ANSWERS.get(processor)
        if known is None:
            known = _ANSWERS[processor] = {}
    except TypeError:  # no __weakref__ slot, or unhashable: answer without caching
        known = {}
    answer = known.get(key)
    if answer is None:
        answer = known[key] = _probe(processor, chat_template, kwargs)
    return answer


def _probe(processor: Any, chat_template: str | None, kwargs: dict[str, Any]) -> bool:
    def render(tools: list[dict] | None) -> str:
        text = processor.apply_chat_template([dict(m) for m in _PROBE_MESSAGES], tools=tools,
                                             chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False, **kwargs)
        return text if isinstance(text, str) else text[0]  # some processors return a one-element batch

    try:
        with_tools = render(_PROBE_TOOLS)
    except Exception as exc:
        if not raised_by_template(exc):
            raise
        return False
    try:
        without = render(None)
    except Exception as exc:
        if not raised_by_template(exc):
            raise
        return True  # a template that cannot render without tools certainly reads them
    return PROBE_TOOL_NAME in with_tools and with_tools != without
