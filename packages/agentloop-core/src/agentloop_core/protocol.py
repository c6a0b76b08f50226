"""The engine-facing protocol: token-level ``generate`` and what an engine declares it can do.

Loops talk to engines only through :class:`AsyncServer.generate`: prompt token ids in,
generated token ids (and their log-probs) out. Text never crosses this boundary, which is
what lets a trainer use exactly the tokens the engine sampled.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, runtime_checkable

StopReason = Literal["stop", "length", "aborted"]
"""Why generation ended: a stop token or EOS (``stop``), the token budget (``length``), or
``abort(request_id)`` (``aborted``)."""

STOP_REASONS: tuple[str, ...] = ("stop", "length", "aborted")


@dataclass(frozen=True)
class TokenOutput:
    """What an engine returns for one ``generate`` call."""

    token_ids: list[int]
    """Generated token ids, in order. A stop token that ended generation is included."""
    log_probs: list[float] | None = None
    """Log-probability of each generated token under the sampling distribution, or None when
    log-probs were not asked for."""
    stop_reason: StopReason = "stop"
    """Why generation ended."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific details (server id, cached prefix tokens, timings)."""

    def __post_init__(self) -> None:
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(
                f"TokenOutput.stop_reason must be one of {STOP_REASONS}, got {self.stop_reason!r}"
            )
        if self.log_probs is not None and len(self.log_probs) != len(self.token_ids):
            raise ValueError(
                f"TokenOutput has {len(self.token_ids)} token ids but {len(self.log_probs)} "
                "log-probs; an engine must return exactly one log-prob per generated token"
            )


@dataclass(frozen=True)
class ServerCapabilities:
    """What an engine declares it supports. Tests and callers read these flags instead of
    guessing from method identity."""

    logprobs: bool = True
    """``generate`` returns the log-prob of each sampled token when ``logprobs=True``."""
    sleep: bool = False
    """``sleep()``/``wake_up()`` release and restore memory the engine holds between requests
    (accelerator memory; a CPU engine's prefix cache), for a trainer's update to use."""
    weight_update: bool = False
    """``update_weights(named_tensors)`` loads new weights in place."""
    prefix_cache: bool = False
    """Requests sharing a prompt prefix reuse its KV cache."""
    vision: bool = False
    """``generate`` takes ``multi_modal_data={"image": [ImageItem, ...]}`` beside prompt ids
    whose image tokens are already expanded (see :mod:`agentloop_core.vision`). An engine
    class declares that it can; an instance serving a text-only model reports False."""
    forget_session: bool = False
    """``forget_session(request_id)`` drops what the engine keeps for a trajectory that is over
    (its prefix-cache entry, its sticky-routing slot): a plain method that returns at once. The
    worker calls it when a trajectory ends, for each request id its loop generated with
    (:mod:`agentloop_core.runtime.sessions`)."""

    def as_dict(self) -> dict[str, bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` of one request: the ids that end a turn are a handful; a longer list
is a mistake (or a way to make every engine step scan it), refused before it is looked at."""

_BRIEF = reprlib.Repr()  # keyword arguments only from Python 3.12
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80
_BRIEF.maxdict = _BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = 4


def brief_repr(value: Any) -> str:
    """``repr(value)`` shortened (long strings and lists elided), for an error message that
    quotes a value a client sent: a 3 MiB value is not echoed back."""
    return _BRIEF.repr(value)


def _got(value: Any) -> str:
    return f"got {brief_repr(value)} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    # bool is an int subclass but True is never a token count, k or seed; numpy ints are fine.
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _finite_float(key: str, value: Any, valid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{key} must be {valid}, {_got(value)}: not a number")
    if not math.isfinite(value):
        raise ValueError(f"{key} must be {valid}, got {value!r} (not finite)")
    return float(value)


def _boolean(key: str, value: Any) -> None:
    # "false" and "yes" are truthy strings, 0 and 1 are numbers: only a real boolean says which.
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false (a boolean), {_got(value)}")


def _token_ids(key: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of integer token ids, or ValueError naming ``key`` (and the entry)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        # tuple("123") would be (1, 2, 3): a string is never a list of ids.
        raise ValueError(f"{key} must be a list of integer token ids, {_got(value)}")
    # The length first: a million-entry list is refused before any entry is looked at.
    ids = value if isinstance(value, (list, tuple)) else tuple(value)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{key} has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} (MAX_STOP_TOKEN_IDS) are "
                         "accepted: send the ids that end a turn, not a vocabulary")
    for i, tid in enumerate(ids):
        if not _is_int(tid):
            raise ValueError(f"{key}[{i}] must be an integer token id, {_got(tid)}")
    return tuple(int(tid) for tid in ids)


DEFAULT_RESPONSE_LENGTH = 256
"""The one default of the response length, declared here and imported everywhere else: a
trajectory's token budget after the prompt (``response_length`` of every loop config; the
trainer's ``data.max_response_length``), and the cap of one ``generate`` call given none
(:attr:`SamplingParams.max_tokens`): a call may then use a whole response's budget."""


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters. Loops pass plain mappings; engines call
    :meth:`from_mapping` so a typo such as ``max_token`` is an error, not a silent default."""

    max_tokens: int = DEFAULT_RESPONSE_LENGTH
    """Most tokens this call may generate (clamped by the engine to what fits in the context):
    the OpenAI API's name, and the name of the per-call cap everywhere inside (the trainer's
    ``multi_turn.max_tokens_per_turn``); a trajectory's budget over all its calls is its
    ``response_length``."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the model's EOS always does); the stop token is
    included in the output. Any list of integers is taken (stored as a tuple), at most
    :data:`MAX_STOP_TOKEN_IDS`."""
    logprobs: bool = True
    """Return the log-prob of each sampled token."""
    seed: int | None = None
    """Per-request seed for reproducible sampling."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks only)."""

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """Validate a mapping of sampling parameters: the one check of every entry point (the
        engines, the HTTP servers' ``/generate`` and ``/v1``, the rollout config).

        Raises:
            ValueError: on an unknown key (naming the closest valid one), or a value of the wrong
                type (naming the key and the type expected: ``"false"`` is not a boolean, ``"123"``
                not a list of token ids, ``true`` not a number) or out of range.
        """
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise ValueError(f"sampling parameters must be a mapping of names to values, {_got(params)}")
        valid = [f.name for f in fields(cls)]
        for key in params:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"unknown sampling parameter {brief_repr(key)}{hint} Valid keys: {', '.join(valid)}"
                )
        return cls(**params)  # __post_init__ checks the values

    def __post_init__(self) -> None:
        # Validate on construction too: a typed SamplingParams skips from_mapping, and a NaN
        # temperature that reaches an engine poisons a whole batch's softmax instead of failing.
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the key and its valid range or type on a bad value."""
        _token_ids("stop_token_ids", self.stop_token_ids)
        _boolean("logprobs", self.logprobs)
        _boolean("ignore_eos", self.ignore_eos)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (>= 1), {_got(self.max_tokens)}")
        temperature = _finite_float("temperature", self.temperature, "in [0, inf), finite (0 is greedy)")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite (0 is greedy), got {self.temperature!r}")
        top_p = _finite_float("top_p", self.top_p, "in (0, 1]")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 disables), {_got(self.top_k)}")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be None or an integer in the int64 range [-2**63, 2**63 - 1], "
                             f"{_got(self.seed)}")

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes``, checked like :meth:`from_mapping` (a typo is an error)."""
        if not changes.keys() <= _SAMPLING_FIELDS:
            data = {f.name: getattr(self, f.name) for f in fields(self)}
            data.update(changes)
            return SamplingParams.from_mapping(data)
        return dataclasses.replace(self, **changes)  # __post_init__ checks the values

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@runtime_checkable
class AsyncServer(Protocol):
    """An inference engine (or a client in front of several) as agent loops see it.

    One method is optional and not part of this check: ``forget_session(request_id)``, which
    an engine declaring ``capabilities.forget_session`` has (see that flag)."""

    @property
    def capabilities(self) -> ServerCapabilities:
        """What this engine supports; read-only here, so a wrapper may forward its engine's."""
        ...

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams,
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``.

        An engine with the ``vision`` capability also takes the keyword argument
        ``multi_modal_data={"image": [ImageItem, ...]}``: the images whose (already expanded)
        tokens the prompt holds, in order. Loops pass it only for a prompt with images
        (:func:`agentloop_core.vision.multi_modal_kwargs`), so text-only engines never see it.

        Args:
            request_id: Identifies the trajectory; requests sharing it may be routed to the
                same replica to reuse its prefix cache, and ``abort`` targets it.
            prompt_ids: The full prompt as token ids (never text).
            sampling_params: Sampling parameters, see :class:`SamplingParams`.

        Returns:
            The generated token ids, their log-probs, and why generation stopped.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop the in-flight requests of ``request_id``; they return ``stop_reason='aborted'``."""
        ...

    async def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) until ``wake_up``."""
        ...

    async def wake_up(self) -> None:
        """Restore what ``sleep`` released."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights in place and reset the prefix cache."""
        ...


class CapabilityNotSupportedError(RuntimeError):
    """An engine was asked for something its capabilities say it cannot do."""

