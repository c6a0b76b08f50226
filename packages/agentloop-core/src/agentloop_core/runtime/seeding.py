"""Per-trajectory sampling seeds, so a rollout's tokens do not depend on which worker, replica
or node served it.

With ``sampling_seed`` set in the rollout config, the worker hands loops a
:class:`SeededServer` instead of the bare server. Every ``generate`` call made without an
explicit ``seed`` gets one derived from ``(sampling_seed, sample key, call index)``:

* the sample key is the batch's ``step`` and ``validate`` flag plus the row's ``request_id``
  when the dataset gives one, else the sample's position in the batch (``sample_index``,
  which does not depend on how the batch was chunked). Loops draw random request ids when the
  row has none, so the id a loop passes to ``generate`` cannot be the key. Pass ``step`` to
  ``generate_sequences``: without it every batch reuses the same seeds per position;
* the call index counts the sample's ``generate`` calls so far, so each turn of a multi-turn
  trajectory gets its own seed. Loops that make concurrent calls within one sample get the
  indices in the order the calls start.

Engines that honour ``SamplingParams.seed`` per request (HFServer, vLLM) then sample the same
tokens wherever the request lands.
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.server_wrapper import TransparentServerWrapper

__all__ = ["SeededServer", "derive_seed", "sample_seed_scope"]


@dataclass(slots=True)  # one per sample in flight
class _SampleSeedState:
    """The seed key of the sample running in this asyncio task, and its calls so far."""

    key: str
    """Identifies the sample across runs (row request_id, or its batch position)."""
    calls: int = 0
    """``generate`` calls this sample has made through a SeededServer."""


_SAMPLE: contextvars.ContextVar[_SampleSeedState | None] = contextvars.ContextVar(
    "agentloop_sample_seed", default=None
)
# Outside a sample scope the request id is the key; bound the counters so a long-lived
# server used that way does not grow without limit.
_MAX_FALLBACK_KEYS = 100_000


def derive_seed(sampling_seed: int, key: str, call_index: int) -> int:
    """A 63-bit seed from the run's seed, a sample key and the call index (blake2b; stable
    across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b(f"{sampling_seed}\x1f{key}\x1f{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class sample_seed_scope:  # noqa: N801 - used as a function: ``with sample_seed_scope(key):``
    """Run the block (this asyncio task and the tasks it starts) as the sample ``key``.

    A small class rather than a generator: a worker holds one open per sample in flight."""

    __slots__ = ("_key", "_token")

    def __init__(self, key: str) -> None:
        self._key = str(key)
        self._token: contextvars.Token[_SampleSeedState | None] | None = None

    def __enter__(self) -> None:
        self._token = _SAMPLE.set(_SampleSeedState(self._key))

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _SAMPLE.reset(self._token)
            self._token = None


class SeededServer(TransparentServerWrapper):
    """Wraps an ``AsyncServer`` and fills in a per-trajectory ``seed`` on ``generate``.

    Everything else (``abort``, ``sleep``, ``update_weights``, ``capabilities``, engine
    attributes) is forwarded unchanged. An explicit ``seed`` in the sampling parameters wins.

    Args:
        server: The engine or engines client.
        sampling_seed: The run's seed (config ``sampling_seed``).
    """

    def __init__(self, server: Any, sampling_seed: int) -> None:
        if isinstance(sampling_seed, bool) or not isinstance(sampling_seed, int):
            raise ValueError(f"sampling_seed must be an integer or None, got {sampling_seed!r}")
        super().__init__(server)
        self.sampling_seed = sampling_seed
        self._fallback_calls: collections.OrderedDict[str, int] = collections.OrderedDict()

    def seed_for(self, request_id: str) -> int:
        """The seed of the next call of the current sample (or of ``request_id`` outside one)."""
        state = _SAMPLE.get()
        if state is not None:
            key, index = state.key, state.calls
            state.calls += 1
        else:
            key = f"request:{request_id}"
            index = self._fallback_calls.pop(key, 0)
            self._fallback_calls[key] = index + 1
            if len(self._fallback_calls) > _MAX_FALLBACK_KEYS:
                self._fallback_calls.popitem(last=False)
        return derive_seed(self.sampling_seed, key, index)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        **multi_modal: Any,
    ) -> TokenOutput:
        """``generate`` on the wrapped server with a derived ``seed`` when none is given
        (``multi_modal_data``, when given, passed on)."""
        sp = SamplingParams.from_mapping(sampling_params)
        if sp.seed is None:
            sp = sp.replace(seed=self.seed_for(request_id))
        return await self.server.generate(request_id, prompt_ids, sp, **multi_modal)
