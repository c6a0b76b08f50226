"""A latency-only engine for the scale benchmark: scripted ids after a fixed per-token delay.

No compute: ``generate`` looks up the scripted reply, waits ``per_token_s`` per returned token
with ``asyncio.sleep`` and returns the ids with deterministic log-probs. What a run with it
measures is the framework and its event loop, with the engine's latency shaping when each
trajectory becomes runnable again, as a real engine's decode time would.

One class serves both sides: our ``AsyncServer`` protocol (``generate(request_id, prompt_ids,
sampling_params)`` with a mapping or :class:`~agentloop_core.protocol.SamplingParams`) and
verl's ``server_manager`` (the same call with keyword arguments plus multimodal extras). Only
the output record differs; the caller passes its type and stop reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import ServerCapabilities


class LatencyOnlyEngine:
    """Scripted replies after ``per_token_s`` seconds per token; nothing computed.

    Args:
        reply: ``(request_id, prompt_ids, call_index) -> ids`` (the same script for both sides).
        eos_token_id: Appended to every reply (the turn ends on it).
        per_token_s: Simulated decode time per returned token.
        output_type: The record to return (ours or verl's ``TokenOutput``); built with
            ``token_ids``, ``log_probs`` and ``stop_reason``.
        stop_reason: What a reply that ends on EOS reports (ours ``"stop"``, verl
            ``"completed"``); one cut by ``max_tokens`` reports ``"length"``.
    """

    capabilities = ServerCapabilities(logprobs=True)

    def __init__(self, reply: Callable[[str, list[int], int], Sequence[int]], eos_token_id: int,
                 per_token_s: float, output_type: type, stop_reason: str = "stop") -> None:
        self.reply, self.eos, self.per_token_s = reply, eos_token_id, per_token_s
        self.output_type, self.stop_reason = output_type, stop_reason
        self._calls: dict[str, int] = {}
        self.generate_calls = 0
        self.generated_tokens = 0

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: Any, **_: Any) -> Any:
        index = self._calls.get(request_id, 0)
        self._calls[request_id] = index + 1
        ids = [*self.reply(request_id, prompt_ids, index), self.eos]
        limit = sampling_params.get("max_tokens") if isinstance(sampling_params, Mapping) \
            else sampling_params.max_tokens
        if limit is not None:
            ids = ids[:limit]
        self.generate_calls += 1
        self.generated_tokens += len(ids)
        await asyncio.sleep(self.per_token_s * len(ids))
        return self.output_type(token_ids=ids, log_probs=[-0.01 * (1 + t % 97) for t in ids],
                                stop_reason=self.stop_reason if ids[-1] == self.eos else "length")

    async def abort(self, request_id: str) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def update_weights(self, named_tensors: Any) -> None:
        raise NotImplementedError("latency-only benchmark engine has no weights")
