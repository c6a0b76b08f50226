"""Engine wrappers the agent loop suite puts under a loop: a recording proxy, a scripted engine
that emits non-canonical tokenizations, and an engine that always fails."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_core.server_wrapper import TransparentServerWrapper
from agentloop_core.testing import ScriptedServer


@dataclass(frozen=True)
class RecordedCall:
    """One ``generate`` call seen by :class:`RecordingServer`."""

    request_id: str
    """The loop's request id."""
    prompt_ids: list[int]
    """The prompt the loop sent."""
    sampling_params: dict[str, Any]
    """The sampling parameters as sent."""
    output: TokenOutput
    """What the engine returned."""
    multi_modal: dict[str, Any] | None = None
    """The call's images and videos as the loop passed them (``multi_modal_data`` and any other
    keyword ``generate`` takes beyond the sampling parameters); None: a text-only call."""


class RecordingServer(TransparentServerWrapper):
    """Forwards every call to ``inner`` and records each ``generate`` call in :attr:`calls`.

    Args:
        inner: The engine to wrap (may be set later, before the first call).
    """

    def __init__(self, inner: Any = None) -> None:
        super().__init__(inner)
        self.calls: list[RecordedCall] = []

    @property
    def inner(self) -> Any:
        """The wrapped engine."""
        return self.server

    @inner.setter
    def inner(self, engine: Any) -> None:
        self.server = engine

    @property
    def capabilities(self) -> ServerCapabilities:
        return getattr(self.server, "capabilities", ServerCapabilities())

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                       **multi_modal: Any) -> TokenOutput:
        params = sampling_params.as_dict() if isinstance(sampling_params, SamplingParams) else dict(sampling_params or {})
        # Images go on to the engine: a vision loop under the recorder sees what it would alone.
        out = await self.server.generate(request_id, list(prompt_ids), sampling_params, **multi_modal)
        self.calls.append(RecordedCall(request_id, list(prompt_ids), params, out, dict(multi_modal) or None))
        return out


class InjectedEngineError(RuntimeError):
    """Raised on purpose by :class:`FailingServer`."""


class FailingServer:
    """An engine whose every ``generate`` raises :class:`InjectedEngineError`; it declares no
    other capability, so sleep, wake-up and weight updates raise CapabilityNotSupportedError."""

    capabilities = ServerCapabilities(logprobs=True)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: Any) -> TokenOutput:
        raise InjectedEngineError("injected engine failure (agentloop-conformance)")

    async def abort(self, request_id: str) -> None:
        return None

    async def sleep(self) -> None:
        raise CapabilityNotSupportedError("FailingServer does not support sleep()")

    async def wake_up(self) -> None:
        raise CapabilityNotSupportedError("FailingServer does not support wake_up()")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        raise CapabilityNotSupportedError("FailingServer does not support update_weights()")


def non_canonical_ids(tokenizer: Any, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not its canonical tokenization where the tokenizer
    allows (multi-character tokens split into single characters), like ids an engine samples.
    A loop that decodes and re-encodes generated text changes them."""
    out: list[int] = []
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set(getattr(tokenizer, "get_added_vocab", dict)().values())
    for tid in tokenizer.encode(text, add_special_tokens=False):
        piece = tokenizer.decode([tid])
        if tid in special or tid in added or len(piece) < 2:
            out.append(tid)
            continue
        chars = [tokenizer.encode(ch, add_special_tokens=False) for ch in piece]
        split = [t for ids in chars for t in ids]
        out.extend(split if tokenizer.decode(split) == piece and len(split) > 1 else [tid])
    return out


def scripted_engine(tokenizer: Any, replies: Sequence[str] | Callable[[str, list[int], int], str]) -> ScriptedServer:
    """A scripted engine that says ``replies[i]`` on the i-th call of each request (the last
    reply repeats), as non-canonical ids, ending with the tokenizer's EOS."""

    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        text = replies(request_id, prompt_ids, index) if callable(replies) else replies[min(index, len(replies) - 1)]
        return non_canonical_ids(tokenizer, text)

    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else 1 << 16
    return ScriptedServer(reply, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id, append_eos=True)
