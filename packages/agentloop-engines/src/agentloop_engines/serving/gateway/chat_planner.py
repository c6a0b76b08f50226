"""``ChatPlanner``: the prompt of each session chat call, continued token-exactly when it can be.

The rules (which request continues which call, and how messages compare) are
:mod:`~agentloop_engines.serving.gateway.continuation`'s; this module holds the state they act on: the
delta renderers (one per tools and template variables, least recently used dropped past
``max_renderers``), the lock that guards them and the sessions' chat states, and the counts of
continued and restarted calls. The gateway calls :meth:`ChatPlanner.plan` before a session chat
call generates and :meth:`ChatPlanner.advance` after, both on its render thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import StopReason, TokenOutput
from agentloop_core.tokenization import ChatRenderer, Trajectory, renders_tools
from agentloop_core.tokenization.template_errors import raised_by_template
from agentloop_engines.serving.gateway.continuation import (
    ChatState,
    ContinuationPlan,
    extension,
    normalize_message,
    renderer_key,
)
from agentloop_engines.serving.gateway.images import GatewayImages, count_images
from agentloop_engines.serving.gateway.openai_request import ChatRequest
from agentloop_engines.serving.gateway.recorder import SessionRecorder

logger = logging.getLogger(__name__)

__all__ = ["ChatPlanner"]

RenderWhole = Callable[..., list[int]]
"""``(messages, tools, chat_template_kwargs, images=()) -> prompt ids``: the gateway's whole
render (image parts in core's kept form, ``images`` theirs), whose errors are the ones a client
should see."""


class ChatPlanner:
    """Plans session chat calls' prompts and keeps each session's last call for the next one.

    Args:
        processor: The tokenizer or processor the gateway renders with.
        chat_template: The gateway's template replacing the tokenizer's own, or None.
        chat_template_kwargs: The gateway's template variables for every render (its own mapping,
            not a copy).
        recorder: Where the sessions' chat states are kept.
        render_whole: The gateway's render of a whole request (see :data:`RenderWhole`).
        images: The gateway's images (vision processor, limits, decoded images).
        max_renderers: Most delta renderers kept (one per tools and template variables).
        allow_special_tokens_in_content: The gateway's setting of that name (see ``Gateway``),
            given to every delta renderer.
    """

    def __init__(self, processor: Any, chat_template: str | None, chat_template_kwargs: Mapping[str, Any],
                 recorder: SessionRecorder, render_whole: RenderWhole, images: GatewayImages, *,
                 max_renderers: int = 64, allow_special_tokens_in_content: bool = False) -> None:
        self.processor = processor
        self.allow_special_tokens_in_content = allow_special_tokens_in_content
        self.images = images
        self.chat_template = chat_template
        self.chat_template_kwargs = chat_template_kwargs
        self.recorder = recorder
        self.render_whole = render_whole
        self.max_renderers = max_renderers
        # Renderers by tools and template variables (None: the template cannot be split into
        # turns); the lock guards them and the sessions' chat states.
        self._renderers: OrderedDict[tuple[str, str], ChatRenderer | None] = OrderedDict()
        self._lock = threading.Lock()
        self.continued_calls = 0
        """Session chat calls whose prompt extended the previous chat call's ids (monotonic)."""
        self.restarted_calls = 0
        """Session chat calls after the first whose messages did not extend the previous call's
        (the agent edited its context, or changed tools): rendered whole, so they start a new
        segment (monotonic)."""

    def _renderer(self, key: tuple[str, str], tools: list[dict[str, Any]] | None,
                  kwargs: Mapping[str, Any]) -> ChatRenderer | None:
        """The delta renderer for these tools and template variables; None when the template
        cannot be split into turns (or renders nothing without them)."""
        with self._lock:
            if key in self._renderers:
                self._renderers.move_to_end(key)
                return self._renderers[key]
        try:
            renderer: ChatRenderer | None = ChatRenderer(
                self.processor, tools=tools, chat_template=self.chat_template, apply_chat_template_kwargs=kwargs,
                vision=self.images.vision, allow_special_tokens_in_content=self.allow_special_tokens_in_content)
        except Exception as exc:
            if not (isinstance(exc, ValueError) or raised_by_template(exc)):
                raise
            renderer = None
            if getattr(self.processor, "chat_template", None) or self.chat_template is not None:
                logger.warning("session chat calls are rendered whole, not continued token-exactly, for these tools "
                               "and template variables: %s: %s. Recorded calls then start a new segment whenever "
                               "the engine's ids are not what the template re-encodes", type(exc).__name__, exc)
        with self._lock:
            self._renderers[key] = renderer
            while len(self._renderers) > self.max_renderers:
                self._renderers.popitem(last=False)
        return renderer

    def check_renders_tools(self, chat_template_kwargs: Mapping[str, Any]) -> None:
        """Refuse ``tools`` the chat template would drop without a word (the model would answer
        as if it had none); decided once per template and variables (core caches it)."""
        if self.chat_template is None and not getattr(self.processor, "chat_template", None):
            return  # the gateway's render says there is no chat template at all
        kwargs = {**self.chat_template_kwargs, **chat_template_kwargs}
        if not renders_tools(self.processor, chat_template=self.chat_template, apply_chat_template_kwargs=kwargs):
            raise ValueError(
                "this server's chat template ignores tools= (a prompt renders the same with and without them), so "
                "the model would never see the tools; start it with a tool-aware template: `agentloop serve "
                "CHECKPOINT --chat-template chatml-hermes` (a built-in, or a Jinja file's path), or "
                "Gateway(..., chat_template=agentloop_core.tokenization.resolve_chat_template('chatml-hermes')); "
                "or send the request without tools")

    def plan(self, req: ChatRequest, session_id: str) -> ContinuationPlan:
        """The prompt of a session chat call (and its images): the previous chat call continued
        when the request only appends messages to it, else the whole request rendered.

        Raises:
            ValueError: images the gateway cannot serve (see :meth:`GatewayImages.admit`), or
                the render's own errors.
            ImageError: a refused, corrupt or oversized image.
        """
        kwargs = {**self.chat_template_kwargs, **req.chat_template_kwargs}
        key = renderer_key(req.tools, kwargs)
        if req.num_images:
            self.images.admit(req.messages)
        with self._lock:
            state = self.recorder.chat_state(session_id)
            new = extension(state, key, req.messages) if isinstance(state, ChatState) else None
            if new is not None:
                assert state is not None
                assert state.trajectory is not None
                plan = self._continue(state, key, new, len(req.messages) - len(new), session_id)
                if plan is not None:
                    return plan
        trajectory, images = None, ()
        renderer = self._renderer(key, req.tools, kwargs)
        # Decoded outside the render's try: a bad image is the client's error, never a template's.
        messages = self.images.sources(req.messages, session_id) if req.num_images else req.messages
        if renderer is not None:
            try:
                trajectory = Trajectory(renderer, messages, image_limits=self.images.limits)
            except Exception as exc:
                if not raised_by_template(exc):
                    raise
                trajectory = None  # render_whole raises the gateway's error for it
        if trajectory is not None:
            prompt_ids, images = list(trajectory.prompt_ids), tuple(trajectory.image_items)
        elif req.num_images:
            refs, images = self.images.take(req.messages, session_id)
            prompt_ids = self.render_whole(refs, req.tools, req.chat_template_kwargs, images=images)
        else:
            prompt_ids = self.render_whole(req.messages, req.tools, req.chat_template_kwargs)
        return ContinuationPlan(prompt_ids, key, trajectory=trajectory, had_previous=state is not None, images=images)

    def _continue(self, state: ChatState, key: tuple[str, str], new: list[dict[str, Any]], first: int,
                  session_id: str) -> ContinuationPlan | None:
        """The plan that continues ``state``'s call with ``new`` messages (their images decoded
        and taken into its trajectory, not yet counted); None when the template's delta fails."""
        trajectory = state.trajectory
        assert trajectory is not None
        if count_images(new):
            new = trajectory.images.take(self.images.sources(new, session_id, first=first), where="message",
                                         count=False)
        try:
            delta = trajectory.preview_messages(new)
        except Exception as exc:
            if not (isinstance(exc, ValueError) or raised_by_template(exc)):
                raise
            logger.info("session %r: the template's delta for the new messages failed (%s: %s); "
                        "rendering the whole request", session_id, type(exc).__name__, exc)
            return None
        images = tuple(trajectory.image_items) + tuple(trajectory.images.in_messages(new))
        return ContinuationPlan(trajectory.context_ids + delta, key, base=state, new_messages=new,
                                had_previous=True, images=images)

    def advance(self, session_id: str, plan: ContinuationPlan, req: ChatRequest, prompt_ids: Sequence[int],
                token_ids: Sequence[int], stop_reason: StopReason, message: Mapping[str, Any]) -> None:
        """Keep this call (its prompt, the engine's ids, the message returned) as the session's
        last chat call, for the next one to continue."""
        expected = (*(normalize_message(m) for m in req.messages), normalize_message(message))
        out = TokenOutput(token_ids=list(token_ids), log_probs=None, stop_reason=stop_reason)
        calls = message.get("tool_calls")
        with self._lock:
            if plan.extends_previous:
                self.continued_calls += 1
            elif plan.had_previous:
                self.restarted_calls += 1
            trajectory = plan.trajectory
            try:
                if plan.base is not None:
                    if self.recorder.chat_state(session_id) is not plan.base:
                        return  # a concurrent call of the session continued it first; that one stays
                    trajectory = plan.base.trajectory
                    assert trajectory is not None
                    assert plan.new_messages is not None
                    trajectory.append_messages(plan.new_messages)
                    if trajectory.context_ids != list(prompt_ids):
                        raise RuntimeError("the template's delta changed between the call and its recording")
                if trajectory is not None:
                    trajectory.append_generated(out)
                    if calls:
                        trajectory.attach_tool_calls(calls)
            except Exception as exc:  # noqa: BLE001 - never fail an answered call; the next one renders whole
                logger.warning("session %r: cannot continue this chat call token-exactly (%s: %s); the next call "
                               "is rendered whole", session_id, type(exc).__name__, exc)
                trajectory = None
            self.recorder.set_chat_state(session_id, ChatState(plan.key, trajectory, expected))
