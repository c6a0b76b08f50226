"""Pacing: at most a few turns of CPU work per event-loop iteration.

A sample's CPU work (building its loop, rendering and encoding, parsing, its output) comes in
turns, each after an outside wait: the engine's ``generate``, a tool, a simulated user. When
thousands of samples share one event loop, such waits end in bursts (an engine batch returns
many rows at once; a tool's thread pool hands back every call it ran in one switch interval),
and asyncio runs every ready task in one iteration before it looks at its timers again. The
worker's :class:`TurnPacer` lets at most ``turns_per_loop_iteration`` turns through per
iteration: after ``generate`` (:class:`PacedServer`), when a sample starts, and wherever a loop
calls :func:`turn_slot` after a wait of its own (the tool loop does after its tool calls and
its interaction turns).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Mapping
from typing import Any

from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.server_wrapper import TransparentServerWrapper


class TurnPacer:
    """Lets at most ``per_iteration`` waiters through per event-loop iteration, first come
    first served.

    Why: when thousands of trajectories share one event loop and their turns' CPU work
    (rendering, tokenization, parsing, the final output) is more than one core can keep up
    with, every turn whose engine call has returned becomes runnable in the same iteration,
    and asyncio runs them all before it looks at its timers again. One iteration then takes
    seconds (thousands of turns x ~1 ms), and every timer in the process (tool timeouts,
    Ray heartbeats, HTTP keep-alives, a ``sample_timeout_s``) fires that late. Releasing a
    bounded number of turns per iteration keeps iterations short; the same turns run in the
    same order (FIFO), so the results do not change and a saturated loop does as much work,
    only the wait moves from asyncio's ready queue into this one. A loop that is not
    saturated pays a few extra iterations per turn (~5% CPU in ``bench/bench_scale.py``).

    Must be built and used on one running event loop.
    """

    def __init__(self, per_iteration: int) -> None:
        self.per_iteration = per_iteration
        self.loop = asyncio.get_running_loop()
        """The event loop it paces."""
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._passed = 0  # let through since the last tick
        self._tick_pending = False

    async def wait(self) -> None:
        """Return at once while this iteration has room and nobody is queued, else wait for
        a later iteration."""
        if not self._waiters and self._passed < self.per_iteration:
            self._passed += 1
            self._schedule_tick()
            return
        future = self.loop.create_future()
        self._waiters.append(future)
        self._schedule_tick()
        await future

    def _schedule_tick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._tick_pending = False
        self._passed = 0
        while self._waiters and self._passed < self.per_iteration:
            future = self._waiters.popleft()
            if not future.done():  # a waiter cancelled by a timeout takes no slot
                future.set_result(None)
                self._passed += 1
        if self._passed:
            self._schedule_tick()


class PacedServer(TransparentServerWrapper):
    """Forwards to ``server``; once a ``generate`` call has returned, the calling loop waits
    for the :class:`TurnPacer` before it goes on with the turn. Everything else (``abort``,
    ``capabilities``, ``tokenizer``, ...) is the wrapped server's."""

    def __init__(self, server: Any, pacer: TurnPacer) -> None:
        super().__init__(server)
        self.pacer = pacer

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                       **multi_modal: Any) -> TokenOutput:
        """``generate`` on the wrapped server, then wait for this turn's slot."""
        out = await self.server.generate(request_id, prompt_ids, sampling_params, **multi_modal)
        # The prompt (a trajectory's whole context, often the largest list it has) is not
        # needed past the engine, and at scale many samples wait here: holding it while queued
        # was 3.4 of 33 KB per trajectory at peak (bench/bench_scale.py's batch, N=1024).
        del prompt_ids, multi_modal
        await self.pacer.wait()
        return out


_PACER: contextvars.ContextVar[TurnPacer | None] = contextvars.ContextVar("agentloop_turn_pacer", default=None)


def use_pacer(pacer: TurnPacer | None) -> None:
    """Make ``pacer`` the one :func:`turn_slot` waits for in the current context: call it at
    the start of a sample's own task (every asyncio task runs in its own copy of the context,
    so it reaches that sample and the tasks it starts, nothing else)."""
    _PACER.set(pacer)


async def turn_slot() -> None:
    """Wait for this sample's next slot of CPU work; call it after an outside wait that many
    samples may finish at once (a tool's result, a user simulator's reply, a remote reward),
    before the work that follows. Returns at once outside a paced worker
    (``turns_per_loop_iteration=None``, or no worker at all).

    Pacing never changes what a sample does, only when: waiters go through first come first
    served, a few per event-loop iteration."""
    pacer = _PACER.get()
    # A context copied into another thread's event loop (a sync tool that runs its own loop)
    # carries the pacer along; it paces only the loop it was built on.
    if pacer is not None and pacer.loop is asyncio.get_running_loop():
        await pacer.wait()
