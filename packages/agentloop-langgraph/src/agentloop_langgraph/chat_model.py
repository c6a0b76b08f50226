"""``ChatModel``: a LangChain chat model over an agentloop engine that keeps the exact tokens.

A LangGraph graph calls the model with LangChain messages. Instead of rendering them afresh on
each call (which would re-encode the model's earlier turns), the model keeps one
:class:`~agentloop_core.tokenization.Trajectory` per request id: the first call renders the
prompt, each later call appends only the new (tool/user) messages as a template delta, and each
generation is appended verbatim. The ids, log-probs and request id of every turn are kept on the
returned ``AIMessage.response_metadata["agentloop"]``.

A graph that edits its context (summarises, trims, edits earlier messages) makes a call whose
messages do not extend the trajectory. By default (``on_history_rewrite="segment"``) the
trajectory then gets a new segment: a new ``Trajectory`` rendered from that call's messages,
earlier AI messages included as ordinary mask-0 text, while every generated id stays in the
segment it was generated in (see :mod:`agentloop_core.segments`).

Images: with a vision processor (``vision=``), image blocks of user, tool and system messages
(see :func:`~agentloop_langgraph.messages.content_parts`) are decoded within ``image_limits``,
rendered through the processor (their tokens are mask 0) and passed to every later ``generate``
call in ``multi_modal_data``; each segment keeps its own images, in token order.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables.config import ensure_config
from pydantic import ConfigDict, Field, PrivateAttr

from agentloop_core.parsers import DEFAULT_TOOL_PARSER
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.runtime.pacing import turn_slot
from agentloop_core.vision import ImageLimits, multi_modal_kwargs
from agentloop_langgraph.messages import (
    METADATA_KEY,
    REWRITE_FIX,
    HistoryRewrite,
    HistoryRewrittenError,
    Recorded,
    RolloutLimitReachedError,
    calls_signature,
    check_extension,
    content_text,
    generation_info,
    to_chat_dict,
)
from agentloop_langgraph.session import TrajectorySession
from agentloop_tools.per_tokenizer import stop_token_ids
from agentloop_tools.tool_media import MEDIA_COUNTERS, MediaScreen, check_processor, tool_limits

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "agentloop_request_id"
"""``config["configurable"]`` key that overrides the model's ``request_id`` for one graph run."""

# BaseChatModel.ainvoke does not hand ``configurable`` down to _agenerate, so ainvoke parks the
# run's request id here for the duration of the call.
_CALL_REQUEST_ID: ContextVar[str | None] = ContextVar("agentloop_call_request_id", default=None)


def _tool_schema(tool: Any) -> dict[str, Any]:
    # Our adapter carries the exact schema the tool declared, so the rendered prompt is the same
    # one the tool_agent loop renders (convert_to_openai_tool would rewrite it).
    schema = getattr(tool, "openai_schema", None)
    if isinstance(schema, dict):
        return json.loads(json.dumps(schema))
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(tool)


class ChatModel(BaseChatModel):
    """A LangChain chat model whose every turn is recorded as engine token ids.

    Use one request id per trajectory: by default the model's own ``request_id`` (so one
    ``ChatModel`` is one trajectory), or ``config={"configurable": {"agentloop_request_id": ...}}``
    per graph run. The model is async only (``ainvoke``/``astream``, ``graph.ainvoke``).

    Each call must extend the trajectory: its recorded messages, in order, plus new tool, user
    or system messages. A call that does not (the graph trimmed, summarised or edited earlier
    messages, changed the bound tools, or added an AI message the engine did not generate for
    this trajectory) starts a new segment (``on_history_rewrite="segment"``) or raises
    :class:`~agentloop_langgraph.messages.HistoryRewrittenError` (``"error"``).

    Attributes:
        server: An ``AsyncServer`` (an engine or ``LLMServerClient``).
        tokenizer: The model's Hugging Face tokenizer, with its chat template.
        sampling_params: Sampling parameters for every turn (see ``SamplingParams``).
        tool_parser: Name of the tool-call parser (``hermes`` first).
        request_id: Default request id; a fresh one if not given.
        response_length: Token budget for everything after the prompt, or None.
        prompt_length: Longest accepted rendered prompt, in tokens, or None.
        max_assistant_turns: Most model turns per trajectory, or None.
        apply_chat_template_kwargs: Extra chat template variables.
        use_inference_chat_template: See ``ChatRenderer``.
        delta_strategy: See ``ChatRenderer(delta_strategy=)``.
        allow_special_tokens_in_content: See ``ChatRenderer(allow_special_tokens_in_content=)``.
        max_parallel_calls: Most tool calls of one turn that may run, or None.
        on_history_rewrite: ``segment`` (start a new segment) or ``error`` (raise
            ``HistoryRewrittenError``) when a call does not extend the trajectory.
        vision: The model's ``VisionProcessor`` (``load_vision_processor``), or None for a
            text-only model (then an image in a message is a ``ValueError`` naming the fix).
        image_limits: ``ImageLimits`` of each segment (pixels, bytes, images), or None for
            the defaults.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    server: Any = Field(exclude=True)
    """The engine or client (``generate(request_id, prompt_ids, sampling_params)``)."""
    tokenizer: Any = Field(exclude=True)
    """Hugging Face tokenizer with a chat template."""
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    """Sampling parameters for every turn; ``max_tokens`` caps each turn."""
    tool_parser: str = DEFAULT_TOOL_PARSER
    """Tool-call parser name (``agentloop_core.parsers.tool_parser_names()``)."""
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """Request id used when the run config does not name one."""
    response_length: int | None = None
    """Token budget after the prompt (generated + tool tokens) of each segment, since each
    segment is one training row of that width; None: no budget."""
    prompt_length: int | None = None
    """Longest accepted rendered prompt in tokens, of the first segment (a longer one is an
    error) and of later ones (a longer one ends the episode: ``RolloutLimitReachedError``); None:
    no limit."""
    max_assistant_turns: int | None = None
    """Most generations per trajectory, all segments together (so a graph that keeps
    summarising still ends); None: no limit."""
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the chat template."""
    use_inference_chat_template: bool = False
    """See :class:`~agentloop_core.tokenization.ChatRenderer`."""
    delta_strategy: Literal["auto", "history", "short"] = "auto"
    """How tool and user messages are tokenized after a generated turn; see
    ``ChatRenderer(delta_strategy=)``."""
    allow_special_tokens_in_content: bool = False
    """Encode special-token strings inside messages (tool results, user turns) as control tokens;
    False: as text. See ``ChatRenderer(allow_special_tokens_in_content=)``."""
    max_parallel_calls: int | None = None
    """Most tool calls of one turn that may run; None: no limit. Later calls stay in the
    ``AIMessage`` (so the graph answers every call), and :meth:`is_call_over_limit` names them:
    the agentloop tool adapters answer them with an error instead of running them, as the
    ``tool_agent`` loop does."""
    on_history_rewrite: HistoryRewrite = "segment"
    """What a call that does not extend the trajectory does: ``segment`` closes the current
    segment and starts a new one rendered from the call's messages (earlier AI messages become
    mask-0 prompt text; every mask-1 id stays in the segment it was generated in); ``error``
    raises :class:`~agentloop_langgraph.messages.HistoryRewrittenError`, so the trajectory is
    always one sequence."""

    vision: Any = Field(default=None, exclude=True)
    """The model's :class:`~agentloop_core.vision.VisionProcessor`; None: a text-only model."""
    image_limits: Any = Field(default=None, exclude=True)
    """:class:`~agentloop_core.vision.ImageLimits` of each segment's images (prompt and later
    messages together); None: the defaults."""

    _sessions: dict[str, TrajectorySession] = PrivateAttr(default_factory=dict)
    _renderers: dict[str, Any] = PrivateAttr(default_factory=dict)
    _parser: Any = PrivateAttr(default=None)
    _base_params: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        from agentloop_core.parsers import get_tool_parser

        self._parser = get_tool_parser(self.tool_parser)
        base = SamplingParams.from_mapping(self.sampling_params)
        stops = stop_token_ids(self.tokenizer, self._parser.stop_tokens)
        self._base_params = base.replace(stop_token_ids=tuple(dict.fromkeys(base.stop_token_ids + stops)))
        for key in ("response_length", "prompt_length", "max_assistant_turns", "max_parallel_calls"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ChatModel {key} must be a positive integer or None, got {value!r}")
        check_processor(self.vision, "ChatModel")
        if self.image_limits is None:
            self.image_limits = ImageLimits()
        elif not isinstance(self.image_limits, ImageLimits):
            raise TypeError(f"ChatModel image_limits must be an agentloop_core.vision.ImageLimits or None, got "
                            f"{type(self.image_limits).__name__}")

    @property
    def _llm_type(self) -> str:
        return "agentloop"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"tool_parser": self.tool_parser, "sampling_params": dict(self.sampling_params)}

    # -- public helpers ----------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any) -> Any:
        """Bind tools: their schemas are rendered into the prompt and calls are parsed against them.

        Args:
            tools: LangChain tools (``AgentLoopTool`` keeps its exact schema), functions,
                pydantic models or OpenAI tool dicts.
            tool_choice: Only ``None``/``"auto"``: the chat template cannot force a call.

        Raises:
            ValueError: for another ``tool_choice``.
        """
        if tool_choice not in (None, "auto"):
            raise ValueError(
                f"ChatModel cannot force tool_choice={tool_choice!r}: the engine samples freely from the "
                "chat template; leave tool_choice unset")
        return super().bind(tools=[_tool_schema(t) for t in tools], **kwargs)

    def session(self, request_id: str | None = None) -> TrajectorySession | None:
        """The trajectory recorded for ``request_id`` (default: the model's own), or None."""
        return self._sessions.get(request_id or self.request_id)

    def pop_session(self, request_id: str | None = None) -> TrajectorySession | None:
        """Forget a trajectory (and return it), e.g. once its output was built."""
        return self._sessions.pop(request_id or self.request_id, None)

    def is_call_over_limit(self, call_id: str, request_id: str | None = None) -> bool:
        """Whether a tool call of the trajectory came after ``max_parallel_calls`` others in its
        turn, so it must be answered with an error instead of being run."""
        session = self.session(request_id)
        return session is not None and call_id in session.calls_over_limit

    def media_screen(self, request_id: str | None = None) -> MediaScreen:
        """The screen of the images that tools return to the trajectory before its next model
        call: decoded within ``image_limits`` (no file paths), counted against ``max_images``
        with the images the current segment holds and the others screened since its last call,
        refused with text for the model when over a limit, unreadable, a video, or for a
        text-only model. Counted in the session's ``media_counters``."""
        limits = tool_limits(self.image_limits)
        session = self.session(request_id)
        if session is None:  # a tool ran before any model call: nothing to count against
            return MediaScreen(self.vision, limits, 0, dict.fromkeys(MEDIA_COUNTERS, 0))
        if session.media is None:
            session.media = MediaScreen(self.vision, limits, session.trajectory.images.count, session.media_counters)
        return session.media

    def adopt_image(self, source: str, item: Any, request_id: str | None = None) -> None:
        """Hand the trajectory an image a tool returned, already processed (``item``), under the
        data URL its message block holds (``source``): the block is then neither decoded nor
        processed again when the next call takes it. Nothing to do before the first call."""
        session = self.session(request_id)
        if session is not None:
            session.trajectory.images.adopt(source, item)

    # -- generation ----------------------------------------------------------------------------

    async def ainvoke(self, input: Any, config: Any = None, *, stop: list[str] | None = None,
                      **kwargs: Any) -> AIMessage:
        """Generate one turn; ``config["configurable"]["agentloop_request_id"]`` picks the trajectory
        (inside a graph run, the run's config is used when ``config`` is None)."""
        configurable = ensure_config(config).get("configurable") or {}
        request_id = configurable.get(REQUEST_ID_KEY)
        token = _CALL_REQUEST_ID.set(str(request_id) if request_id else None)
        try:
            return await super().ainvoke(input, config, stop=stop, **kwargs)
        finally:
            _CALL_REQUEST_ID.reset(token)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        raise NotImplementedError(
            "agentloop's ChatModel is async only (engines run on the event loop): use ainvoke/astream, "
            "or graph.ainvoke(...) for a LangGraph graph")

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        if stop:
            raise ValueError(
                f"ChatModel does not support stop strings ({stop!r}): generation stops on token ids; set "
                "sampling_params['stop_token_ids'] instead")
        tools = kwargs.pop("tools", None) or []
        kwargs.pop("tool_choice", None)
        if kwargs:
            raise ValueError(f"ChatModel got unsupported call arguments {sorted(kwargs)}; set sampling "
                             "options in ChatModel(sampling_params=...)")
        # The graph's own work (its tools) just ended a wait: render and encode in this
        # sample's turn slot, as the tool loop does after its tool calls.
        await turn_slot()
        request_id = self._resolve_request_id()
        tools_key = json.dumps(tools, sort_keys=True)
        session = self._sessions.get(request_id)
        started = session is None
        if session is None:
            session = self._start(request_id, messages, tools, tools_key)
        async with session.lock:
            if not started:
                self._extend(session, messages, tools, tools_key)
            message = await self._generate_turn(session, tools)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _resolve_request_id(self) -> str:
        return _CALL_REQUEST_ID.get() or self.request_id

    def _renderer(self, tools: list[dict[str, Any]], tools_key: str) -> Any:
        if tools_key not in self._renderers:
            from agentloop_core.tokenization import ChatRenderer

            self._renderers[tools_key] = ChatRenderer(
                self.tokenizer, tools=tools or None,
                use_inference_chat_template=self.use_inference_chat_template,
                apply_chat_template_kwargs=dict(self.apply_chat_template_kwargs),
                delta_strategy=self.delta_strategy, vision=self.vision,
                allow_special_tokens_in_content=self.allow_special_tokens_in_content)
        return self._renderers[tools_key]

    def _start(self, request_id: str, messages: Sequence[BaseMessage], tools: list[dict[str, Any]],
               tools_key: str) -> TrajectorySession:
        if not messages:
            raise ValueError("ChatModel was called with no messages")
        for i, msg in enumerate(messages):
            info = generation_info(msg)
            if info is not None:
                # Generated elsewhere: most likely the graph runs with a request id per call, which
                # would cut every trajectory into one-turn pieces.
                raise HistoryRewrittenError(
                    f"request {request_id}: message {i} was generated for request {info.get('request_id')} "
                    "but this request has no recorded trajectory; reuse the request id of that trajectory")
        trajectory = self._render_segment(messages, tools, tools_key)
        if self.prompt_length is not None and len(trajectory.prompt_ids) > self.prompt_length:
            raise ValueError(f"rendered prompt has {len(trajectory.prompt_ids)} tokens, more than "
                             f"prompt_length={self.prompt_length}; raise prompt_length or shorten the prompt")
        session = TrajectorySession(request_id, trajectory, _recorded_prompt(messages), tools_key)
        self._sessions[request_id] = session
        return session

    def _render_segment(self, messages: Sequence[BaseMessage], tools: list[dict[str, Any]], tools_key: str) -> Any:
        """A trajectory whose prompt is ``messages`` rendered afresh (AI messages as plain text)."""
        from agentloop_core.tokenization import Trajectory

        if isinstance(messages[-1], AIMessage):
            raise ValueError("ChatModel's last input message is an AI message; the model answers after a "
                             "user, tool or system message")
        return Trajectory(self._renderer(tools, tools_key), [to_chat_dict(m) for m in messages],
                          image_limits=self.image_limits)

    def _extend(self, session: TrajectorySession, messages: Sequence[BaseMessage], tools: list[dict[str, Any]],
                tools_key: str) -> None:
        try:
            if tools_key != session.tools_key:
                raise HistoryRewrittenError(
                    f"request {session.request_id}: the bound tools changed between model calls; the prompt "
                    "was rendered with the first set, so keep one tool set per trajectory")
            new = check_extension(session.request_id, session.recorded, messages)
        except HistoryRewrittenError as exc:
            if self.on_history_rewrite == "error":
                raise HistoryRewrittenError(f"{exc}. {REWRITE_FIX}") from None
            self._start_segment(session, messages, tools, tools_key, str(exc))
            return
        chats = [to_chat_dict(m) for m in new]
        trajectory = session.trajectory
        if trajectory.num_generations == 0:
            trajectory.append_messages(chats)
        else:
            if self.response_length is not None:
                delta = trajectory.preview_messages(chats)  # append_messages reuses it
                if len(trajectory.response_ids) + len(delta) >= self.response_length:
                    # Cutting the delta would end the trajectory mid-turn; leaving it out ends cleanly.
                    raise RolloutLimitReachedError(
                        "response_length", f"request {session.request_id}: the {len(new)} new messages "
                        f"({len(delta)} tokens) leave no room in response_length={self.response_length}")
            trajectory.append_messages(chats)
        session.recorded.extend(Recorded("appended", chat=c) for c in chats)
        session.media = None  # the screened images are in the trajectory now

    def _start_segment(self, session: TrajectorySession, messages: Sequence[BaseMessage],
                       tools: list[dict[str, Any]], tools_key: str, reason: str) -> None:
        """Close the current segment and make ``messages`` the prompt of a new one.

        The limits are checked first, so a segment is never started that could not generate:
        the episode ends instead, keeping the segments so far.
        """
        self._check_turn_limit(session)
        trajectory = self._render_segment(messages, tools, tools_key)
        if self.prompt_length is not None and len(trajectory.prompt_ids) > self.prompt_length:
            raise RolloutLimitReachedError(
                "prompt_length", f"request {session.request_id}: the rewritten history starts a segment whose "
                f"prompt has {len(trajectory.prompt_ids)} tokens, more than prompt_length={self.prompt_length}")
        logger.debug("request %s: segment %d starts: %s", session.request_id, len(session.segments), reason)
        if session.trajectory.num_generations:
            session.closed.append(session.trajectory)
            session.rewrites.append(reason)
        elif session.rewrites:
            session.rewrites[-1] = reason  # the empty segment is replaced, not closed
        session.trajectory = trajectory
        session.recorded = _recorded_prompt(messages)
        session.media = None
        session.tools_key = tools_key
        session.ended_with_eos = True

    def _check_turn_limit(self, session: TrajectorySession) -> None:
        if self.max_assistant_turns is not None and session.num_generations >= self.max_assistant_turns:
            raise RolloutLimitReachedError(
                "max_assistant_turns", f"request {session.request_id}: max_assistant_turns="
                f"{self.max_assistant_turns} model turns reached")

    async def _generate_turn(self, session: TrajectorySession, tools: list[dict[str, Any]]) -> AIMessage:
        trajectory = session.trajectory
        self._check_turn_limit(session)
        params = self._base_params
        if self.response_length is not None:
            remaining = self.response_length - len(trajectory.response_ids)
            if remaining < 1:
                raise RolloutLimitReachedError("response_length", f"request {session.request_id}: "
                                          f"response_length={self.response_length} tokens used")
            cap = params.max_tokens if "max_tokens" in self.sampling_params else remaining
            params = params.replace(max_tokens=min(cap, remaining))
        prompt_ids = list(trajectory.context_ids)
        start = time.perf_counter()
        # A text prompt adds no keyword, so text-only engines are called as before.
        out: TokenOutput = await self.server.generate(session.request_id, prompt_ids, params,
                                                      **multi_modal_kwargs(trajectory.image_items))
        session.generate_s += time.perf_counter() - start
        trajectory.append_generated(out)
        session.outputs.append(out)
        session.ended_with_eos = trajectory.renderer.ended_turn(out.token_ids, out.stop_reason)
        message = self._to_message(session, out, prompt_ids, tools)
        session.recorded.append(Recorded(
            "generated", turn=session.num_generations, response_ids=tuple(out.token_ids),
            content=content_text(message), calls=calls_signature(message)))
        return message

    def _to_message(self, session: TrajectorySession, out: TokenOutput, prompt_ids: list[int],
                    tools: list[dict[str, Any]]) -> AIMessage:
        turn = session.num_generations
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        tool_calls: list[dict[str, Any]] = []
        invalid: list[dict[str, Any]] = []
        content = text
        if out.stop_reason == "stop":
            # A turn cut by the token budget may hold half a call; acting on it would be a guess.
            by_name = {t["function"]["name"]: t for t in tools if isinstance(t.get("function"), dict)}
            parsed = self._parser.parse(text, by_name)
            content = parsed.content if parsed.attempted else text
            tool_calls = [{"name": c.name, "args": dict(c.arguments), "id": f"call_{turn}_{c.id}",
                           "type": "tool_call"} for c in parsed.calls]
            invalid = [{"name": e.name, "args": e.raw, "id": f"call_{turn}_invalid_{i}", "error": e.reason,
                        "type": "invalid_tool_call"} for i, e in enumerate(parsed.errors)]
            if self.max_parallel_calls is not None:
                session.calls_over_limit.update(c["id"] for c in tool_calls[self.max_parallel_calls:])
        finish = {"stop": "tool_calls" if tool_calls else "stop", "length": "length", "aborted": "aborted"}
        metadata = {
            METADATA_KEY: {
                "request_id": session.request_id, "turn": turn, "prompt_ids": prompt_ids,
                "response_ids": list(out.token_ids),
                "log_probs": None if out.log_probs is None else list(out.log_probs),
                "stop_reason": out.stop_reason,
            },
            "finish_reason": finish[out.stop_reason],
            "model_name": "agentloop",
        }
        return AIMessage(content=content, tool_calls=tool_calls, invalid_tool_calls=invalid,
                         response_metadata=metadata)

def _recorded_prompt(messages: Sequence[BaseMessage]) -> list[Recorded]:
    # The chat dicts as the call gave them (the trajectory's own messages name images by digest).
    return [Recorded("prompt", chat=to_chat_dict(m)) for m in messages]


__all__ = ["REQUEST_ID_KEY", "ChatModel", "TrajectorySession"]
