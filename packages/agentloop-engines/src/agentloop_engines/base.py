"""``AsyncServerBase``: the shared front half of every engine adapter.

Adapters implement one coroutine, :meth:`AsyncServerBase._generate`, and receive requests that
are already validated: a non-empty prompt of in-vocabulary integer ids that fits in the context,
and a :class:`~agentloop_core.protocol.SamplingParams` whose ``max_tokens`` is clamped so that
prompt + generation never exceeds ``max_model_len``. The base class also turns the token-level
engine into an OpenAI-compatible ``chat_completion`` endpoint for black-box agents.
"""

from __future__ import annotations

import abc
import asyncio
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_core.request_checks import validate_request

# OpenAI request keys we honour, and the ones we accept only with their harmless default.
_CHAT_SAMPLING_KEYS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                       "stop_token_ids", "ignore_eos", "logprobs"}
_CHAT_KEYS = _CHAT_SAMPLING_KEYS | {"messages", "tools", "tool_choice", "model", "n", "stream", "stop",
                                    "user", "chat_template_kwargs", "request_id"}


class AsyncServerBase(abc.ABC):
    """Base class of token-in, token-out inference engines (implements ``AsyncServer``).

    Stop semantics, shared by every adapter:

    * generation ends on any of ``eos_token_ids`` (unless ``ignore_eos``) or any of the request's
      ``stop_token_ids``; that stop token **is included** in ``token_ids`` and ``stop_reason`` is
      ``"stop"``;
    * when the (clamped) ``max_tokens`` budget is used up, ``stop_reason`` is ``"length"``;
    * after ``abort(request_id)`` the request returns the tokens generated so far with
      ``stop_reason="aborted"``.

    Subclasses set ``capabilities`` (only the flags that differ from the defaults), the instance
    attributes below, and implement :meth:`_generate`.

    Attributes:
        capabilities: What this engine supports; callers read it instead of probing methods.
        max_model_len: Context length in tokens (prompt + generated).
        vocab_size: Number of valid token ids; ids must lie in ``[0, vocab_size)``.
        eos_token_ids: Token ids that always end generation (unless ``ignore_eos``).
        tokenizer: Hugging Face tokenizer; needed by ``chat_completion`` only.
        model_name: Reported in ``chat_completion`` responses.
    """

    # Not a ClassVar: adapters whose capabilities depend on how they were built (the device,
    # a tokenizer) set them per instance.
    capabilities: ServerCapabilities = ServerCapabilities()
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any | None = None
    model_name: str = "agentloop"

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``.

        Args:
            request_id: Identifies the request (and its trajectory); ``abort`` targets it.
            prompt_ids: The full prompt as token ids.
            sampling_params: A mapping or :class:`SamplingParams`; unknown keys are errors.

        Returns:
            The generated ids (a stop token that ended generation included), one log-prob per
            id when ``logprobs`` was asked for, and the stop reason.

        Raises:
            ValueError: on an invalid prompt or sampling parameters (see :meth:`validate_request`).
        """
        sp = self.validate_request(prompt_ids, sampling_params)
        return await self._generate(request_id, list(prompt_ids), sp)

    def validate_request(
        self,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None,
    ) -> SamplingParams:
        """Check a request and return its sampling parameters with ``max_tokens`` clamped.

        The checks live in :func:`agentloop_core.request_checks.validate_request`, shared with
        the scripted test engine so that loop tests send only requests a real engine accepts.

        Args:
            prompt_ids: The prompt token ids.
            sampling_params: A mapping or :class:`SamplingParams`.

        Returns:
            Validated parameters whose ``max_tokens`` fits in ``max_model_len - len(prompt_ids)``.

        Raises:
            ValueError: empty prompt, a non-integer or out-of-vocabulary id (the first bad one and
                its position are named), a prompt that fills the context, or bad sampling params.
        """
        return validate_request(
            prompt_ids, sampling_params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )

    @abc.abstractmethod
    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        """Run one validated request.

        Args:
            request_id: The caller's request id (``abort`` targets it).
            prompt_ids: Valid, non-empty prompt ids that fit in the context.
            sp: Validated sampling parameters; ``max_tokens`` already fits in the context.

        Returns:
            The engine's output, following the stop semantics in the class docstring.
        """

    async def abort(self, request_id: str) -> None:  # noqa: B027 - documented default
        """Stop the in-flight requests of ``request_id``.

        The default does nothing, which is only correct for engines whose requests cannot be
        interrupted; adapters that can stop a request early override it.
        """

    async def sleep(self) -> None:
        """Release accelerator memory until :meth:`wake_up`.

        Raises:
            CapabilityNotSupportedError: unless the adapter overrides it (``capabilities.sleep``).
        """
        raise CapabilityNotSupportedError(f"{type(self).__name__} does not support sleep()")

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released.

        Raises:
            CapabilityNotSupportedError: unless the adapter overrides it (``capabilities.sleep``).
        """
        raise CapabilityNotSupportedError(f"{type(self).__name__} does not support wake_up()")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights in place.

        Raises:
            CapabilityNotSupportedError: unless the adapter overrides it (``capabilities.weight_update``).
        """
        raise CapabilityNotSupportedError(f"{type(self).__name__} does not support update_weights()")

    async def close(self) -> None:  # noqa: B027 - documented default
        """Release the engine's resources. The default has nothing to release."""

    # ---- OpenAI-compatible chat ----------------------------------------------------------

    def _chat_sampling_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(request) - _CHAT_KEYS)
        if unknown:
            raise ValueError(
                f"unsupported chat_completion request keys {unknown}; supported: {sorted(_CHAT_KEYS)}"
            )
        if request.get("n", 1) != 1:
            raise ValueError("chat_completion supports n=1 only; send n separate requests")
        if request.get("stream", False):
            raise ValueError("chat_completion does not stream; set stream=False")
        if request.get("stop"):
            raise ValueError(
                "text stop sequences ('stop') are not supported: they would cut generated tokens at "
                "a text boundary; pass token ids as 'stop_token_ids' instead"
            )
        params = {k: request[k] for k in _CHAT_SAMPLING_KEYS if request.get(k) is not None}
        if "max_completion_tokens" in params:
            params["max_tokens"] = params.pop("max_completion_tokens")
        if "logprobs" in params:
            params["logprobs"] = bool(params["logprobs"])
        return params

    def _chat_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RuntimeError(
                f"{type(self).__name__} has no tokenizer, so it cannot render chat messages; pass "
                "tokenizer= when constructing it, or call generate() with token ids"
            )
        return self.tokenizer

    def _render_chat(self, messages: list[Any], tools: Any, template_kwargs: dict[str, Any]) -> list[int]:
        tokenizer = self._chat_tokenizer()
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **template_kwargs)
        return list(tokenizer.encode(text, add_special_tokens=False))

    async def chat_completion(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Serve an OpenAI-style chat completion request.

        The messages (and ``tools``) are rendered with the tokenizer's chat template, tokenized
        without extra special tokens, generated, and decoded. Besides the OpenAI fields the
        response carries the exact tokens: top-level ``prompt_token_ids`` and, in the choice,
        ``token_ids`` and ``token_logprobs``, so black-box agents can still train on exactly
        what was generated.

        Args:
            request: ``messages`` (required), optional ``tools``, ``max_tokens`` /
                ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
                ``stop_token_ids``, ``chat_template_kwargs``, ``model``, ``request_id``.

        Returns:
            An OpenAI ``chat.completion`` object with the extension fields above.

        Raises:
            ValueError: on unknown keys, missing messages, text ``stop`` sequences, ``n != 1``
                or ``stream=True``.
            RuntimeError: when the server has no tokenizer.
        """
        tokenizer = self._chat_tokenizer()
        if not isinstance(request, Mapping):
            raise ValueError(f"chat_completion expects a dict request, got {type(request).__name__}")
        messages = request.get("messages")
        if not messages:
            raise ValueError("chat_completion request needs a non-empty 'messages' list")
        params = self._chat_sampling_params(request)
        template_kwargs = dict(request.get("chat_template_kwargs") or {})
        # Off the event loop: a long conversation takes seconds to render and tokenize, and the
        # loop also serves every other request (and an HTTP server's health checks).
        prompt_ids = await asyncio.to_thread(self._render_chat, list(messages), request.get("tools") or None,
                                             template_kwargs)
        request_id = str(request.get("request_id") or f"chatcmpl-{uuid.uuid4().hex}")
        out = await self.generate(request_id, prompt_ids, params)
        content = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        finish_reason = {"stop": "stop", "length": "length", "aborted": "abort"}[out.stop_reason]
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model") or self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish_reason,
                    "token_ids": list(out.token_ids),
                    "token_logprobs": None if out.log_probs is None else list(out.log_probs),
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(prompt_ids) + len(out.token_ids),
            },
            "prompt_token_ids": prompt_ids,
        }
