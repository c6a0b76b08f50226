"""One :class:`~agentloop_core.tokenization.renderer.ChatRenderer` per tokenizer and settings,
shared by every trajectory that renders with them.

Agent loops are built per sample (4096 concurrent trajectories build 4096 loops). Building a
renderer copies and marks its tool schemas, dumps them as JSON for its cache keys and collects
the tokenizer's special tokens: at that scale it was ~15% of the framework's time per
trajectory and a few KB per trajectory held until it returned (``bench/bench_scale.py``). A
renderer keeps no state of any conversation (its caches are per template, shared already), so
one serves them all.

The cache holds its tokenizer weakly, as :mod:`agentloop_tools.per_tokenizer` does: an entry
goes away with its tokenizer, and a new tokenizer allocated where a freed one lived never hits
it; it holds each renderer weakly too, so a renderer lives as long as some loop uses it. The key holds every setting (tools, template, template variables, strategy...) as JSON in
order, the vision processor by identity, and what a renderer reads from the tokenizer at
construction that is changed in place in practice (its chat template, its length, which grows
with added tokens, and its bos/eos tokens), so a changed tokenizer gets a new renderer that
probes it again. Settings that are not JSON are not shared: each call builds its own renderer.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from typing import Any

from agentloop_core.tokenization.renderer import ChatRenderer, DeltaStrategy
from agentloop_core.vision.processor import VisionProcessor

__all__ = ["shared_renderer"]

# Renderers are held weakly too: one lives while a loop (or anything) holds it, so the cache
# never keeps a tokenizer alive through its renderer, and a renderer is freed with its last user
# as it was before it was shared.
_SHARED: weakref.WeakKeyDictionary[Any, weakref.WeakValueDictionary[tuple, ChatRenderer]] = (
    weakref.WeakKeyDictionary())


def shared_renderer(
    tokenizer: Any,
    *,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    use_inference_chat_template: bool = False,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
    delta_strategy: DeltaStrategy = "auto",
    vision: VisionProcessor | None = None,
    allow_special_tokens_in_content: bool = False,
) -> ChatRenderer:
    """A :class:`ChatRenderer` built with these arguments (see its docstring for each), the one
    an earlier call with the same tokenizer and settings built when there is one.

    Treat the renderer as read-only: it is shared by every caller with these settings.

    Raises:
        ChatTemplateError, TokenizationMismatchError, ValueError: as ``ChatRenderer``; a renderer
            that fails to build is not kept, so every call fails with its message.
    """
    settings: dict[str, Any] = {
        "tools": tools, "chat_template": chat_template, "use_inference_chat_template": use_inference_chat_template,
        "apply_chat_template_kwargs": apply_chat_template_kwargs, "delta_strategy": delta_strategy,
        "vision": vision, "allow_special_tokens_in_content": allow_special_tokens_in_content}
    try:
        key = (json.dumps([tools, chat_template, use_inference_chat_template, apply_chat_template_kwargs,
                           delta_strategy, allow_special_tokens_in_content], ensure_ascii=False),
               id(vision), *_tokenizer_state(tokenizer))
        known = _SHARED.get(tokenizer)
        if known is None:
            known = _SHARED[tokenizer] = weakref.WeakValueDictionary()
    except (TypeError, ValueError):  # settings that are not JSON, a tokenizer that cannot be a weak key
        return ChatRenderer(tokenizer, **settings)
    renderer = known.get(key)
    if renderer is None or renderer.vision is not vision:
        renderer = known[key] = ChatRenderer(tokenizer, **settings)
    return renderer


def _tokenizer_state(tokenizer: Any) -> tuple:
    """What a renderer reads from ``tokenizer`` at construction that is changed in place."""
    inner = getattr(tokenizer, "tokenizer", None)
    encoder = inner if inner is not None and hasattr(inner, "encode") else tokenizer
    try:
        size = len(encoder)
    except TypeError:
        size = None
    return (getattr(tokenizer, "chat_template", None), size, getattr(encoder, "bos_token", None),
            getattr(encoder, "eos_token", None))
