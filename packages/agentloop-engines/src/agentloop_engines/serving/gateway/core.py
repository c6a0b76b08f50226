"""``Gateway``: OpenAI chat and text completions over any token-level ``AsyncServer``.

The gateway renders chat messages with the tokenizer's chat template, calls
``server.generate(request_id, prompt_ids, sampling_params)``, decodes, honours text ``stop``
strings by cutting the generated ids (see :mod:`~agentloop_engines.serving.gateway.stop`), and parses
tool calls with one of core's tool-call parsers; image parts go through the model's vision
processor (:mod:`~agentloop_engines.serving.gateway.images`) and to ``generate`` as ``multi_modal_data``.
Calls made in a session are recorded with their exact ids
(:mod:`~agentloop_engines.serving.gateway.recorder`), and use the session id as the engine
``request_id``: the sticky-session key of ``LLMServerClient``, so a trajectory's calls stay on
one replica and reuse its prefix cache, and ``abort(session_id)`` stops the session's calls.
A session chat call that only appends messages to the previous one continues its ids exactly
(:mod:`~agentloop_engines.serving.gateway.continuation`, planned by
:mod:`~agentloop_engines.serving.gateway.chat_planner`).

Checking a request body, rendering, tokenizing (stop strings included), the stop search and
decoding run on the gateway's own one-thread pool, never on the event loop, so a big request
delays other renders but never the loop that answers ``/health`` and streams other responses;
:class:`~agentloop_engines.serving.gateway.prompt_limits.PromptLimits` bounds how big (its list lengths
are checked on the loop first, which costs nothing, so an oversized list is refused at once).

Session bookkeeping (open, authorize, admit, record, close) is
:class:`~agentloop_engines.serving.gateway.sessions.GatewaySessions`, the gateway's base class; what a
generation says as a chat choice (reasoning, tool calls) is
:class:`~agentloop_engines.serving.gateway.chat_output.ChatOutput`. No HTTP here:
:mod:`~agentloop_engines.serving.gateway.app` serves these methods.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentloop_core.parsers import ToolParser, get_tool_parser
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.reasoning import ReasoningParser, get_reasoning_parser
from agentloop_core.tokenization.content_marks import content_marks
from agentloop_core.tokenization.template_errors import raised_by_template
from agentloop_core.vision import ImageItem, ImageLimits, VisionProcessor, multi_modal_kwargs
from agentloop_engines.serving.gateway.chat_output import ChatOutput
from agentloop_engines.serving.gateway.chat_planner import ChatPlanner
from agentloop_engines.serving.gateway.generation import FINISH_REASONS, Generation, cut_at_stop
from agentloop_engines.serving.gateway.images import GatewayImages, recorded_request
from agentloop_engines.serving.gateway.openai_request import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from agentloop_engines.serving.gateway.openai_response import GatewayResponse
from agentloop_engines.serving.gateway.prompt_limits import PromptLimits, context_length
from agentloop_engines.serving.gateway.recorder import (
    RecordedCall,
    SessionBudgetError,
    SessionRecorder,
    check_session_id,
)
from agentloop_engines.serving.gateway.sessions import GatewaySessions
from agentloop_engines.serving.gateway.stop import StopMatch, find_stop, single_token_stop_ids

logger = logging.getLogger(__name__)

# Besides Gateway, the names this module held before its session and chat-choice halves moved out.
__all__ = ["ChatOutput", "Gateway", "GatewaySessions", "Generation", "RecordedCall", "SessionBudgetError", "StopMatch",
           "check_session_id", "find_stop", "recorded_request"]

_MAX_RENDERERS = 64


class Gateway(GatewaySessions):
    """OpenAI-compatible chat and text completions over a token-level ``AsyncServer``, with
    per-session recording of the exact tokens.

    Args:
        server: Any ``AsyncServer``: an engine, an ``LLMServerClient`` over replicas, an
            ``EngineHTTPClient`` client, a ``ScriptedServer``.
        tokenizer: The model's Hugging Face tokenizer (or processor): renders chat messages
            (``apply_chat_template``), encodes text prompts and decodes generations.
        chat_template: A Jinja template replacing the tokenizer's own; for a checkpoint whose
            template ignores ``tools=`` (requests with ``tools`` are then refused with a 400),
            a tool-aware built-in such as
            ``agentloop_core.tokenization.resolve_chat_template("chatml-hermes")``.
        tool_parser: Name of a core tool-call parser (``hermes``, ``llama3_json``,
            ``gpt_oss``, ``mistral``) or a parser object; turns generated text into
            ``tool_calls``. None: requests with ``tools`` are refused (400), as their calls
            could not be returned.
        reasoning_parser: Name of a core reasoning parser (``qwen3``, ``deepseek_r1``,
            ``gpt_oss``) or a parser object: the assistant message then carries the reasoning
            as ``reasoning_content``, ``content`` without it, and ``tool_calls`` only from the
            content (a call drafted while reasoning is not returned). None: ``content`` is the
            whole generated text. Token ids are returned unchanged either way.
        model_name: Listed by ``/v1/models`` and returned when a request names no model.
            None: the server's ``model_name``, else the tokenizer's ``name_or_path``.
        chat_template_kwargs: Template variables for every render (``enable_thinking``);
            a request's ``chat_template_kwargs`` add to them (only the names
            ``prompt_limits.template_variables`` allows).
        default_max_tokens: ``max_tokens`` of requests that set none. None: the rest of the
            context when the server declares ``max_model_len``, else ``SamplingParams``'
            default (256).
        sampling_overrides: Sampling parameters that replace what every request asks for
            (the trainer's ``temperature``); a session's own overrides replace these.
        recorder: Where sessions are recorded; None: a ``SessionRecorder`` with its defaults
            (10,000 sessions, one hour idle, 1,000 calls each).
        server_loop: The event loop that owns ``server``, when it is not the loop the gateway
            runs on (a gateway in a :class:`~agentloop_engines.serving.gateway.app.GatewayThread`
            around an engine or client that lives on the rollout worker's loop). Calls are
            then submitted to it; it must keep running (an agent that blocks it, e.g. a
            synchronous client called on it, deadlocks: run such agents in a thread).
        prompt_limits: What one request may make the gateway render and tokenize (messages,
            characters, tokens, template variables); None: :class:`PromptLimits`' defaults.
        vision: The model's :class:`~agentloop_core.vision.VisionProcessor` for image parts (see
            :mod:`~agentloop_engines.serving.gateway.images`); ``"auto"``: loaded from the checkpoint
            folder of the tokenizer (or of the server's ``model_name``); None: text only.
        max_images: Most images in one request (:class:`~agentloop_core.vision.ImageLimits`).
        max_image_pixels: Most pixels one image may declare, checked on its header.
        max_image_bytes: Most encoded bytes of one image.
        allow_remote_image_urls: Fetch ``http(s)`` image URLs; off: data URLs only. File paths
            are always refused.
        allow_special_tokens_in_content: False (default): a special token's string in any
            message a client sends (system, user, tool, and assistant messages: the gateway
            continues the ids it generated itself, so an assistant message it renders from
            text is the client's text) and in ``tools`` is encoded as text, never as the
            control token, on every chat route (Chat Completions, Responses, Messages); see
            :mod:`agentloop_core.tokenization.content_marks`. True: the render is encoded whole
            (vLLM's behaviour). ``/v1/completions`` prompts are raw text either way.

    Raises:
        UnknownToolParserError: for an unknown parser name (the message lists the known ones).
        UnknownReasoningParserError: likewise for ``reasoning_parser``.
        ValueError: when a reasoning parser that reads special tokens (``gpt_oss``) comes with
            a tool parser that does not; when the tokenizer has no ``apply_chat_template``. A tokenizer without a chat
            template (a base model) still serves ``/v1/completions``; chat requests are then 400.
    """

    def __init__(
        self,
        server: Any,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        tool_parser: str | ToolParser | None = None,
        reasoning_parser: str | ReasoningParser | None = None,
        model_name: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        default_max_tokens: int | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
        recorder: SessionRecorder | None = None,
        server_loop: asyncio.AbstractEventLoop | None = None,
        prompt_limits: PromptLimits | None = None,
        vision: VisionProcessor | str | None = "auto",
        max_images: int = ImageLimits.max_images,
        max_image_pixels: int = ImageLimits.max_pixels,
        max_image_bytes: int = ImageLimits.max_bytes,
        allow_remote_image_urls: bool = False,
        allow_special_tokens_in_content: bool = False,
    ) -> None:
        if not callable(getattr(server, "generate", None)):
            raise TypeError(f"{type(server).__name__} has no generate(); pass an AsyncServer")
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(f"{type(tokenizer).__name__} has no apply_chat_template; pass a Hugging Face tokenizer")
        if default_max_tokens is not None and default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1 or None, got {default_max_tokens}")
        self.server = server
        self.processor = tokenizer
        inner = getattr(tokenizer, "tokenizer", None)
        # Processors render with their own apply_chat_template but tokenize with .tokenizer.
        self.tokenizer = inner if inner is not None and hasattr(inner, "encode") else tokenizer
        self.chat_template = chat_template
        self.allow_special_tokens_in_content = allow_special_tokens_in_content
        self._marks = None if allow_special_tokens_in_content else content_marks(self.tokenizer)
        self.parser = get_tool_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
        self.reasoning = (get_reasoning_parser(reasoning_parser) if isinstance(reasoning_parser, str)
                          else reasoning_parser)
        if (self.reasoning is not None and self.reasoning.needs_special_tokens and self.parser is not None
                and not self.parser.needs_special_tokens):
            raise ValueError(f"reasoning parser {self.reasoning.name!r} reads special tokens that tool parser "
                             f"{self.parser.name!r} does not; pass the tool parser of the same family "
                             "(Gateway(tool_parser='gpt_oss'))")
        self.model_name = (model_name or getattr(server, "model_name", None)
                           or getattr(self.tokenizer, "name_or_path", None) or "agentloop")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.default_max_tokens = default_max_tokens
        SamplingParams.from_mapping(sampling_overrides)  # a wrong type or range fails here, naming the key
        self.sampling_overrides = dict(sampling_overrides or {})
        self.recorder = recorder if recorder is not None else SessionRecorder()
        self.server_loop = server_loop
        self.prompt_limits = prompt_limits if prompt_limits is not None else PromptLimits()
        # One thread: renders ran one at a time on the event loop before, so this costs no
        # throughput, bounds the CPU that renders take, and never runs two renders on one
        # tokenizer at once (a fast tokenizer whose settings one call changes while another
        # encodes panics with "Already borrowed").
        self._render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-render")
        self.max_model_len = context_length(server)
        capabilities = getattr(server, "capabilities", None)
        self._logprobs = bool(getattr(capabilities, "logprobs", True))
        self._output = ChatOutput(self.tokenizer, self.parser, self.reasoning)
        limits = ImageLimits(max_pixels=max_image_pixels, max_bytes=max_image_bytes, max_images=max_images,
                             allow_paths=False, allow_remote_urls=allow_remote_image_urls)
        self.images = GatewayImages(vision, limits, tokenizer, server)
        """The vision processor (``images.vision``), image limits and decoded images of sessions."""
        self._planner = ChatPlanner(self.processor, chat_template, self.chat_template_kwargs, self.recorder,
                                    self.render, self.images, max_renderers=_MAX_RENDERERS,
                                    allow_special_tokens_in_content=allow_special_tokens_in_content)

    def __repr__(self) -> str:
        return f"Gateway({type(self.server).__name__}, model={self.model_name!r})"

    @property
    def continued_calls(self) -> int:
        """Session chat calls whose prompt extended the previous chat call's ids (monotonic)."""
        return self._planner.continued_calls

    @property
    def restarted_calls(self) -> int:
        """Session chat calls after the first whose messages did not extend the previous call's
        (the agent edited its context, or changed tools): rendered whole, so they start a new
        segment (monotonic)."""
        return self._planner.restarted_calls

    # ---- endpoints -----------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` list: the one model this gateway serves."""
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "agentloop"}]}

    def render(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None, images: Sequence[ImageItem] = ()) -> list[int]:
        """Prompt ids of ``messages`` (and ``tools``) with the generation prompt; ``images`` are
        those of the image parts (core's kept form), each placeholder expanded to its tokens.

        Raises:
            ValueError: when the chat template refuses or fails on the messages.
        """
        if self.chat_template is None and not getattr(self.processor, "chat_template", None):
            raise ValueError(f"the tokenizer ({type(self.processor).__name__}) has no chat template, so this gateway "
                             "serves /v1/completions only; start it with Gateway(..., chat_template=...)")
        kwargs = {**self.chat_template_kwargs, **(chat_template_kwargs or {})}
        marks = self._marks
        try:
            text = self.processor.apply_chat_template(
                [dict(m) for m in messages] if marks is None else marks.mark_messages(messages),
                tools=tools if marks is None else marks.mark_value(tools), chat_template=self.chat_template,
                add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:
            if not raised_by_template(exc):
                raise
            raise ValueError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):  # some processors return a one-element batch
            text = text[0]
        text = self.images.expand(text, images) if images else text
        return marks.encode(text) if marks is not None else list(self.tokenizer.encode(text, add_special_tokens=False))

    async def chat_completion(self, body: Mapping[str, Any], *, session_id: str | None = None,
                              session_key: str | None = None, endpoint: str = "chat.completions") -> GatewayResponse:
        """Answer a ``/v1/chat/completions`` body.

        In a session, a request whose messages are the previous chat call's messages, the
        assistant message it returned and new non-assistant messages gets the previous prompt
        ids + generated ids + the chat template's delta for the new messages as its prompt, so
        the engine's ids are never decoded and encoded again; any other request is rendered
        whole (see :mod:`~agentloop_engines.serving.gateway.continuation`). The recorded call's
        ``extra["extends_previous"]`` says which.

        Args:
            body: The OpenAI request.
            session_id: Record the call in this session (and use it as the engine request id).
            session_key: The key the call carried (an HTTP client's); the session must then be
                open and this its key. None: an in-process call, which opens the session if needed.
            endpoint: The API the call came through, as recorded (``"responses"`` and
                ``"messages"`` translate their bodies to chat bodies and call this).

        Returns:
            The ``chat.completion`` object (with ``prompt_token_ids``, ``token_ids`` and
            ``token_logprobs``) and how the client wants it delivered.

        Raises:
            ValueError: on an unsupported key or value, template text or a template variable
                the server does not allow, messages the template cannot render, ``tools``
                without a tool parser or with a chat template that ignores them, or a request
                the engine rejects.
            PromptLimitError: over one of :attr:`prompt_limits`' sizes.
            SessionCallLimitError: when the session holds ``max_calls_per_session`` calls.
            SessionNotFoundError: with ``session_key``, when it is not the key of an open session.
        """
        req, prompt_ids, plan, images = await self._prepare_chat(body, session_id, session_key)
        gen = await self._generate("chatcmpl", prompt_ids, req, session_id, session_key, images)
        return await self._chat_response(body, req, gen, plan, session_id, endpoint)

    async def _prepare_chat(self, body: Mapping[str, Any], session_id: str | None,
                            session_key: str | None) -> tuple[ChatRequest, list[int], Any, tuple[ImageItem, ...]]:
        """The checked request, its prompt ids, (in a session) its continuation plan, and the
        images of its prompt."""
        self._authorize(session_id, session_key)
        self.prompt_limits.check_lists(body)
        req = await self._off_loop(parse_chat_request, body, self.prompt_limits)
        if req.tools is not None and self.parser is None:
            raise ValueError("this gateway has no tool parser, so tool calls could not be returned; start it "
                             "with Gateway(..., tool_parser='hermes') (or the model's format)")
        if req.tools:
            await self._off_loop(self._planner.check_renders_tools, req.chat_template_kwargs)
        plan, images = None, ()
        if session_id is None and req.num_images:
            prompt_ids, images = await self._off_loop(self.images.render_request, self.render, req)
        elif session_id is None:
            prompt_ids = await self._off_loop(self.render, req.messages, req.tools, req.chat_template_kwargs)
        else:
            plan = await self._off_loop(self._planner.plan, req, session_id)
            prompt_ids, images = plan.prompt_ids, plan.images
        self.prompt_limits.check_tokens(len(prompt_ids))
        return req, prompt_ids, plan, images

    async def _chat_response(self, body: Mapping[str, Any], req: ChatRequest, gen: Generation, plan: Any,
                             session_id: str | None, endpoint: str = "chat.completions") -> GatewayResponse:
        """The ``chat.completion`` of a finished generation, recorded in its session."""
        choice = await self._off_loop(self._output.choice, gen, req)
        response = self._body("chatcmpl", "chat.completion", req, choice, gen)
        if plan is None:
            return self._finish(endpoint, body, response, gen, req, session_id)
        assert session_id is not None
        result = self._finish(endpoint, body, response, gen, req, session_id,
                              extra={"extends_previous": plan.extends_previous})
        await self._off_loop(self._planner.advance, session_id, plan, req, gen.prompt_ids, gen.token_ids,
                             gen.stop_reason, choice["message"])
        return result

    async def completion(self, body: Mapping[str, Any], *, session_id: str | None = None,
                         session_key: str | None = None) -> GatewayResponse:
        """Answer a ``/v1/completions`` body (prompt as text or token ids); ``session_id`` and
        ``session_key`` as in :meth:`chat_completion`.

        Raises:
            ValueError: on an unsupported key or value, or a request the engine rejects.
            PromptLimitError: over ``max_prompt_chars`` or ``max_prompt_tokens``.
            SessionCallLimitError: when the session holds ``max_calls_per_session`` calls.
            SessionNotFoundError: with ``session_key``, when it is not the key of an open session.
        """
        req, prompt_ids = await self._prepare_completion(body, session_id, session_key)
        gen = await self._generate("cmpl", prompt_ids, req, session_id, session_key)
        return await self._completion_response(body, req, gen, session_id)

    async def _prepare_completion(self, body: Mapping[str, Any], session_id: str | None,
                                  session_key: str | None) -> tuple[CompletionRequest, list[int]]:
        self._authorize(session_id, session_key)
        self.prompt_limits.check_lists(body)
        req = await self._off_loop(parse_completion_request, body, self.prompt_limits)
        if isinstance(req.prompt, str):
            prompt_ids = list(await self._off_loop(self.tokenizer.encode, req.prompt,
                                                   add_special_tokens=req.add_special_tokens))
        else:
            prompt_ids = list(req.prompt)
        self.prompt_limits.check_tokens(len(prompt_ids))
        return req, prompt_ids

    async def _completion_response(self, body: Mapping[str, Any], req: CompletionRequest, gen: Generation,
                                   session_id: str | None) -> GatewayResponse:
        logprobs = None
        if req.logprobs is not None and gen.log_probs is not None:
            tokens = await self._off_loop(self._output.token_texts, gen.token_ids)
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            logprobs = {"tokens": tokens, "token_logprobs": gen.log_probs, "top_logprobs": None,
                        "text_offset": offsets}
        choice = {"index": 0, "text": gen.text, "logprobs": logprobs, "finish_reason": FINISH_REASONS[gen.stop_reason],
                  "stop_reason": gen.stop, "token_ids": gen.token_ids, "token_logprobs": gen.log_probs}
        response = self._body("cmpl", "text_completion", req, choice, gen)
        return self._finish("completions", body, response, gen, req, session_id)

    # ---- internals -----------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a render or tokenization on the render thread, so the event loop stays free."""
        return await asyncio.get_running_loop().run_in_executor(self._render_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def _generate(self, prefix: str, prompt_ids: list[int], req: ChatRequest | CompletionRequest,
                        session_id: str | None, session_key: str | None = None,
                        images: Sequence[ImageItem] = ()) -> Generation:
        request_id, params = await self._engine_request(prefix, prompt_ids, req, session_id, session_key)
        out = await self._call_server(request_id, prompt_ids, params, images)
        return await self._generation(out, prompt_ids, req, images)

    async def _engine_request(self, prefix: str, prompt_ids: list[int], req: ChatRequest | CompletionRequest,
                              session_id: str | None, session_key: str | None) -> tuple[str, dict[str, Any]]:
        """The engine request id and sampling parameters of a call (admitted in its session)."""
        overrides = self._admit(session_id, session_key) if session_id is not None else {}
        params: dict[str, Any] = {**req.sampling, "logprobs": self._logprobs, **self.sampling_overrides, **overrides}
        if "max_tokens" not in params:
            if self.default_max_tokens is not None:
                params["max_tokens"] = self.default_max_tokens
            elif self.max_model_len is not None and self.max_model_len > len(prompt_ids):
                params["max_tokens"] = self.max_model_len - len(prompt_ids)
        if session_id is not None:
            self._cap_to_budget(session_id, prompt_ids, params)
        stop_ids = await self._off_loop(single_token_stop_ids, self.tokenizer, req.stop) if req.stop else []
        if stop_ids:
            params["stop_token_ids"] = list(dict.fromkeys([*(params.get("stop_token_ids") or ()), *stop_ids]))
        return session_id or f"{prefix}-{uuid.uuid4().hex}", params

    async def _generation(self, out: TokenOutput, prompt_ids: list[int], req: ChatRequest | CompletionRequest,
                          images: Sequence[ImageItem] = ()) -> Generation:
        """The engine's output cut at the first stop string, with its text (see
        :func:`~agentloop_engines.serving.gateway.generation.cut_at_stop`)."""
        return await self._off_loop(cut_at_stop, out, prompt_ids, req.stop, self._text, images)

    async def _call_server(self, request_id: str, prompt_ids: list[int], params: dict[str, Any],
                           images: Sequence[ImageItem] = ()) -> TokenOutput:
        call = self.server.generate(request_id, prompt_ids, params, **multi_modal_kwargs(images))
        loop = self.server_loop
        if loop is None or loop is asyncio.get_running_loop():
            return await call
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, loop))

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _body(self, prefix: str, obj: str, req: ChatRequest | CompletionRequest, choice: dict[str, Any],
              gen: Generation) -> dict[str, Any]:
        n_prompt, n_gen = len(gen.prompt_ids), len(gen.token_ids)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": req.model or self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
                "prompt_token_ids": gen.prompt_ids}

    def _finish(self, endpoint: str, request: Mapping[str, Any], response: dict[str, Any], gen: Generation,
                req: ChatRequest | CompletionRequest, session_id: str | None,
                extra: Mapping[str, Any] | None = None) -> GatewayResponse:
        call = self._record(endpoint, request, response, gen, session_id, extra)
        return GatewayResponse(body=response, stream=req.stream, include_usage=req.include_usage, call=call)
