"""What a reward must be before it reaches the batch: finite in the dtype advantages are
computed in, and produced within ``reward.timeout_s``.

**Finite in float32.** A reward function returns a Python float (float64), but the batch holds
rewards as float32 and advantages are computed and trained in float32 (``update/advantages.py``,
``update/losses.py``). ``1e39`` is finite in float64 and ``inf`` in float32, and one ``inf`` (or
NaN) in a group makes every advantage of that group NaN: the group's mean and std are NaN. So
each reward, and each per-turn reward, is checked after the cast (:func:`not_finite_reason`),
and a sample whose reward does not survive it fails with the value in its error (counted in
``rollout/num_failed`` like every failed sample: reward 0 in its group's baseline, its own
tokens out of the loss) instead of poisoning its group.

**Time-limited.** A reward function that never returns would hold its sample, and with it the
batch, forever: ``sample_timeout_s`` covers the loop, not the scoring. :func:`call_limited` runs
an async function under ``asyncio.wait_for`` and a sync one on a daemon thread of its own (a
thread cannot be interrupted; a stuck one is abandoned and does not keep the process from
exiting, nor take a thread of the event loop's default executor that the engine shares).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import inspect
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["REWARD_DTYPE", "RewardTimeoutError", "call_limited", "in_training_dtype", "not_finite_reason"]

REWARD_DTYPE = "float32"
"""The dtype rewards and advantages are held and trained in; a reward is checked in it."""


class RewardTimeoutError(TimeoutError):
    """A reward function ran longer than ``reward.timeout_s``."""


def in_training_dtype(value: float) -> float:
    """``value`` after the cast to :data:`REWARD_DTYPE` (C's ``(float)x``: ``1e39`` -> ``inf``)."""
    return array.array("f", [value])[0]


def not_finite_reason(score: float, turn_rewards: Sequence[float] | None = None) -> str | None:
    """Why ``score`` (or one of its per-turn rewards, or a return summed from them) is not a
    finite :data:`REWARD_DTYPE` number, or None when all are."""
    if not math.isfinite(in_training_dtype(float(score))):
        return f"reward {score!r} is not finite as {REWARD_DTYPE}"
    if turn_rewards:
        for t, value in enumerate(turn_rewards):
            if not math.isfinite(in_training_dtype(float(value))):
                return f"per-turn reward {value!r} (turn {t}) is not finite as {REWARD_DTYPE}"
        # Returns-to-go are sums of turn rewards (|G_t| <= sum |r_t| for turn_gamma <= 1).
        bound = math.fsum(abs(float(v)) for v in turn_rewards)
        if not math.isfinite(in_training_dtype(bound)):
            return f"per-turn rewards {list(turn_rewards)!r:.200} add up past the {REWARD_DTYPE} range"
    return None


def _in_thread(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               name: str) -> asyncio.Future[Any]:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            value, ok = fn(*args, **kwargs), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting sample
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop closed while an abandoned call ran on
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=work, name=f"agentloop-reward-{name}", daemon=True).start()
    return future


async def call_limited(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                       timeout_s: float | None, where: str) -> Any:
    """``fn(*args, **kwargs)`` within ``timeout_s`` seconds (None: no limit): awaited when
    ``fn`` is async (or returns an awaitable), on a daemon thread of its own when it is sync.

    Raises:
        RewardTimeoutError: naming ``where``, the limit and the key that raises it.
        Exception: whatever ``fn`` raises.
    """
    async def run() -> Any:
        if inspect.iscoroutinefunction(fn):
            result = await fn(*args, **kwargs)
        else:
            result = await _in_thread(fn, args, kwargs, getattr(fn, "__name__", "fn"))
        if inspect.isawaitable(result):
            result = await result
        return result

    if timeout_s is None:
        return await run()
    start = time.monotonic()
    try:
        return await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        if time.monotonic() - start < timeout_s:
            raise  # the function's own timeout (its I/O), not ours to rename
        raise RewardTimeoutError(
            f"{where} ran longer than reward.timeout_s={timeout_s:g} s and was abandoned; make it return "
            "sooner (a timeout on its own I/O), or raise reward.timeout_s (null: no limit)") from None
