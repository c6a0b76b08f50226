"""``AsyncServerBase``: the shared front half of every engine adapter.

Adapters implement one coroutine, :meth:`AsyncServerBase._generate`, and receive requests that
are already validated: a non-empty prompt of in-vocabulary integer ids that fits in the context,
and a :class:`~agentloop_core.protocol.SamplingParams` whose ``max_tokens`` is clamped so that
prompt + generation never exceeds ``max_model_len``. OpenAI-compatible requests are the
gateway's (:class:`~agentloop_engines.serving.gateway.Gateway`), over ``generate``, wherever ``/v1`` is
served.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_core.request_checks import validate_request
from agentloop_core.vision.content import images_of
from agentloop_core.vision.processor import ImageItem
from agentloop_engines.streaming import TokenDelta


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
        tokenizer: Hugging Face tokenizer, or None; an HTTP server in front of the engine serves
            the OpenAI ``/v1`` routes with it (see :func:`agentloop_engines.serving.server.create_app`).
        model_name: The model name those routes report (``/v1/models``, a response's ``model``).
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
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``.

        Args:
            request_id: Identifies the request (and its trajectory); ``abort`` targets it.
            prompt_ids: The full prompt as token ids.
            sampling_params: A mapping or :class:`SamplingParams`; unknown keys are errors.
            multi_modal_data: ``{"image": [ImageItem, ...]}``, the images whose expanded tokens
                ``prompt_ids`` holds, in order (engines with ``capabilities.vision``).

        Returns:
            The generated ids (a stop token that ended generation included), one log-prob per
            id when ``logprobs`` was asked for, and the stop reason.

        Raises:
            ValueError: on an invalid prompt or sampling parameters (see :meth:`validate_request`),
                or malformed ``multi_modal_data``.
            CapabilityNotSupportedError: images sent to an engine without the ``vision`` capability.
        """
        sp = self.validate_request(prompt_ids, sampling_params)
        images = self._images(multi_modal_data)
        if images:
            generate: Any = self._generate  # a vision adapter's takes images= (see _generate)
            return await generate(request_id, list(prompt_ids), sp, images=images)
        return await self._generate(request_id, list(prompt_ids), sp)

    def _images(self, multi_modal_data: Mapping[str, Any] | None) -> tuple[ImageItem, ...]:
        images = images_of(multi_modal_data, engine=type(self).__name__)
        if images and not self.capabilities.vision:
            raise CapabilityNotSupportedError(
                f"{type(self).__name__} serving {self.model_name!r} has no vision capability: it cannot take images. "
                "Serve a vision-language checkpoint on an engine that declares vision (hf, vllm, sglang)")
        return images

    async def generate_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Generate like :meth:`generate`, yielding the tokens as they are decoded.

        The ids of the deltas, joined, are exactly the ids of the last delta's ``output`` (the
        :class:`~agentloop_core.protocol.TokenOutput` :meth:`generate` would return); see
        :mod:`agentloop_engines.streaming`. Closing the stream early stops the request. An
        adapter that overrides :meth:`generate` itself (not :meth:`_generate`) must override
        this too, or the two would differ.

        Args:
            request_id: As in :meth:`generate`.
            prompt_ids: As in :meth:`generate`.
            sampling_params: As in :meth:`generate`.
            multi_modal_data: As in :meth:`generate`.

        Yields:
            :class:`~agentloop_engines.streaming.TokenDelta`\\ s; the last carries ``output``.

        Raises:
            ValueError: on an invalid request, at the first step of the iteration.
        """
        sp = self.validate_request(prompt_ids, sampling_params)
        images = self._images(multi_modal_data)
        stream = (self._generate_stream(request_id, list(prompt_ids), sp, images=images) if images
                  else self._generate_stream(request_id, list(prompt_ids), sp))
        # aclosing: closing this stream must close the adapter's at once (it stops the request).
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

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

        An adapter whose instance declares ``capabilities.vision`` also takes
        ``images: tuple[ImageItem, ...]`` (non-empty, checked), for a prompt with images.

        Args:
            request_id: The caller's request id (``abort`` targets it).
            prompt_ids: Valid, non-empty prompt ids that fit in the context.
            sp: Validated sampling parameters; ``max_tokens`` already fits in the context.

        Returns:
            The engine's output, following the stop semantics in the class docstring.
        """

    async def _generate_stream(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                               images: tuple[ImageItem, ...] = ()) -> AsyncGenerator[TokenDelta, None]:
        """Stream one validated request. The default yields :meth:`_generate`'s whole result as
        one delta, which keeps engines that cannot stream correct; adapters that can override it.
        ``images`` is non-empty only for an adapter that declares ``vision`` (see :meth:`_generate`)."""
        generate: Any = self._generate
        out = await (generate(request_id, prompt_ids, sp, images=images) if images
                     else self._generate(request_id, prompt_ids, sp))
        yield TokenDelta(list(out.token_ids), None if out.log_probs is None else list(out.log_probs), out)

    async def abort(self, request_id: str) -> None:  # noqa: B027 - documented default
        """Stop the in-flight requests of ``request_id``.

        The default does nothing, which is only correct for engines whose requests cannot be
        interrupted; adapters that can stop a request early override it.
        """

    def forget_session(self, request_id: str) -> None:  # noqa: B027 - documented default
        """Drop what the engine keeps for the trajectory ``request_id``, which is over
        (``capabilities.forget_session``). The default keeps nothing per trajectory, so does
        nothing; an adapter that does (HFServer's prefix cache) overrides it and sets the flag.
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
