"""Time limits on the calls a loop makes into user code that produce rewards or observations:
an environment's ``reset`` / ``step`` / ``close``, an interaction's replies and score, a tool's
``calc_reward``. ``sample_timeout_s`` (off by default) is the only other bound on them, so one
of these that never returns would hold its sample, and the batch, forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

__all__ = ["CallTimeoutError", "call_within"]


class CallTimeoutError(TimeoutError):
    """A call into an environment, interaction or tool ran past its loop's limit; the message
    names the call and the config key that raises the limit."""


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
