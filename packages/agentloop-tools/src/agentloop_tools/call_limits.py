"""Time limits on the calls a loop makes into user code that produce rewards or observations:
an environment's ``reset`` / ``step`` / ``close``, an interaction's replies and score, a tool's
``calc_reward``. ``sample_timeout_s`` (off by default) is the only other bound on them, so one
of these that never returns would hold its sample, and the batch, forever.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable
from typing import Any

__all__ = ["CallTimeoutError", "call_within", "within"]


class CallTimeoutError(TimeoutError):
    """A call into an environment, interaction or tool ran past its loop's limit; the message
    names the call and the config key that raises the limit."""


async def within(awaitable: Awaitable[Any], timeout_s: float | None) -> Any:
    """``asyncio.wait_for(awaitable, timeout_s)`` in the calling task: on Python 3.11+ with a
    positive limit, ``asyncio.timeout`` bounds the await without the task ``wait_for`` wraps
    around it (a task, its callbacks and a context copy per tool call; issue 49, CPU per turn).
    The same ``TimeoutError`` when the limit passes (the call is cancelled); a ``TimeoutError``
    the call raises itself propagates as it is. The caller's task is its own: a tool call
    runs in a task of its own (``asyncio.gather`` wraps each), so no context leaks out."""
    if timeout_s is None or timeout_s <= 0 or sys.version_info < (3, 11):
        return await asyncio.wait_for(awaitable, timeout_s)
    async with asyncio.timeout(timeout_s):  # pyright: ignore[reportAttributeAccessIssue]
        return await awaitable


async def call_within(awaitable: Awaitable[Any], timeout_s: float | None, what: str, key: str) -> Any:
    """Await ``awaitable`` for at most ``timeout_s`` seconds (None: no limit).

    Args:
        awaitable: The call.
        timeout_s: The limit.
        what: The call, for the error ("environment 'x' step").
        key: The config key of the limit, for the error.

    Raises:
        CallTimeoutError: the limit passed (the call is cancelled). A ``TimeoutError`` the call
            raised itself, sooner, propagates unchanged.
    """
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        if timeout_s is None or time.perf_counter() - start < timeout_s:
            raise
        raise CallTimeoutError(f"{what} ran longer than {key.rsplit('.', 1)[-1]}={timeout_s:g} s and was cancelled; "
                               f"make it return sooner, or raise {key} (null: no limit)") from None
