"""A scripted stand-in engine for unit tests of loop logic.

It is never how a feature is shown to work end to end (that is HFServer's job); it exists so
that loop and runtime logic can be tested fast, deterministically and with exact control over
what the "model" says.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_core.request_checks import validate_request
from agentloop_core.testing.tiny_tokenizer import VOCAB_SIZE as TINY_VOCAB_SIZE
from agentloop_core.vision.content import images_of

Script = Callable[[str, list[int], int], Sequence[int]]
"""(request_id, prompt_ids, call_index_for_this_request) -> token ids to return."""


@dataclass
class ScriptedCall:
    """One recorded ``generate`` call."""

    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    output: TokenOutput
    images: tuple = ()
    """The ``multi_modal_data`` images the call carried (ImageItems, in order)."""


class ScriptedServer:
    """Returns scripted (or prompt-seeded pseudo-random) token ids with deterministic log-probs.

    Requests are validated exactly as the real engines validate them
    (:func:`agentloop_core.request_checks.validate_request`): a bad prompt or sampling parameter
    raises the same ValueError, and ``max_tokens`` is clamped to what fits in ``max_model_len``.

    Args:
        script: A list of replies used in order (shared across requests), or a callable
            ``(request_id, prompt_ids, call_index) -> ids``. None: pseudo-random ids seeded by
            the prompt, so equal prompts give equal outputs.
        vocab_size: Number of valid token ids (prompt and stop ids must lie in
            ``[0, vocab_size)``), and the range of pseudo-random ids. The default is the tiny
            tokenizer's, which is what the tiny model (and so a real engine) has.
        max_model_len: Context length in tokens (prompt + generated), as a real engine's.
        eos_token_id: Appended to scripted replies when ``append_eos`` and they lack it; ends
            pseudo-random generation when drawn.
        latency_s: Simulated engine time per call.
        vision: Declare the ``vision`` capability and take ``multi_modal_data`` (recorded in
            :attr:`calls`), standing in for an engine serving a vision-language model.
    """

    capabilities = ServerCapabilities(logprobs=True)

    def __init__(
        self,
        script: Sequence[Sequence[int]] | Script | None = None,
        *,
        vocab_size: int = TINY_VOCAB_SIZE,
        max_model_len: int = 4096,
        eos_token_id: int | None = None,
        append_eos: bool = False,
        latency_s: float = 0.0,
        vision: bool = False,
    ) -> None:
        self._script = script
        if vision:  # stands in for an engine serving a vision-language model: takes images
            self.capabilities = ServerCapabilities(logprobs=True, vision=True)
        self._next = 0
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.append_eos = append_eos
        self.latency_s = latency_s
        self.calls: list[ScriptedCall] = []
        self._per_request: dict[str, int] = {}
        self._aborted: set[str] = set()

    def _reply(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> list[int]:
        index = self._per_request.get(request_id, 0)
        self._per_request[request_id] = index + 1
        if callable(self._script):
            ids = list(self._script(request_id, prompt_ids, index))
        elif self._script is not None:
            if self._next >= len(self._script):
                raise RuntimeError(f"ScriptedServer ran out of replies after {self._next} calls")
            ids = list(self._script[self._next])
            self._next += 1
        else:
            digest = hashlib.sha256(repr((prompt_ids, sp.seed)).encode()).digest()
            rng = random.Random(int.from_bytes(digest[:8], "little"))
            ids = [rng.randrange(self.vocab_size) for _ in range(sp.max_tokens)]
        if self.append_eos and self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)
        return ids

    def validate_request(
        self,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None,
    ) -> SamplingParams:
        """The real engines' request checks (``AsyncServerBase.validate_request``)."""
        return validate_request(
            prompt_ids, sampling_params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> TokenOutput:
        sp = self.validate_request(prompt_ids, sampling_params)
        images = images_of(multi_modal_data, engine="ScriptedServer")
        if images and not self.capabilities.vision:
            raise CapabilityNotSupportedError("ScriptedServer has no vision capability: it cannot take images; build "
                                              "it with vision=True to stand in for a vision-language model")
        prompt_ids = list(map(int, prompt_ids))  # a copy: the caller may reuse its list
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ids = self._reply(request_id, prompt_ids, sp)
        stops = set(sp.stop_token_ids)
        if self.eos_token_id is not None and not sp.ignore_eos:
            stops.add(self.eos_token_id)
        out_ids: list[int] = []
        reason = "length"
        for tok in ids:
            if len(out_ids) >= sp.max_tokens:
                break
            out_ids.append(tok)
            if tok in stops:
                reason = "stop"
                break
        else:
            if len(out_ids) < sp.max_tokens:
                reason = "stop"
        if request_id in self._aborted:
            reason = "aborted"
        log_probs = [-0.01 * (1 + (t % 97)) for t in out_ids] if sp.logprobs else None
        out = TokenOutput(token_ids=out_ids, log_probs=log_probs, stop_reason=reason)
        self.calls.append(ScriptedCall(request_id, prompt_ids, sp, out, images))
        return out

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        raise NotImplementedError("ScriptedServer has no weights")
