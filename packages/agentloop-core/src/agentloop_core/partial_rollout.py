"""Partial rollout: weight updates in the middle of generations, for asynchronous RL.

:class:`PartialRolloutServer` stands in front of any engine. Loops keep calling ``generate``;
when the trainer updates the weights (:meth:`PartialRolloutServer.weight_update`), the wrapper

1. closes the gate, so no new engine call starts;
2. aborts every in-flight engine call at a token boundary (the engine's ``abort`` returns the
   tokens generated so far with ``stop_reason="aborted"``) and waits until all have returned,
   so no engine call ever spans an update;
3. lets the trainer push the weights, bumps ``policy_version`` and opens the gate;
4. resumes each interrupted generation on the new weights from ``prompt_ids`` + exactly the
   token ids already generated (never decoded and re-encoded), with the rest of the
   ``max_tokens`` budget.

The caller gets one :class:`~agentloop_core.protocol.TokenOutput` holding every token of the
generation with its own log-prob, and ``extra["policy_versions"]``: the policy version that
sampled each token. A trainer that wants those versions per batch row names the request ids it
will read back (:meth:`PartialRolloutServer.track`) and takes them from the per-request ledger
(:meth:`PartialRolloutServer.pop_ledger`), since loops assemble their outputs without
``TokenOutput.extra``. Only tracked ids are recorded, so requests nobody pops (evaluation
rollouts through the same engine) leave nothing behind.

Because step 2 waits for every call to come back (re-sending ``abort`` until it has, for an
abort that raced a request's admission), the version recorded for a call's tokens is exact: the
engine held those weights for the call's whole life.

A trainer drives the wrapper through :class:`RolloutControl`, a small async interface with one
implementation per place the wrapper can live: :class:`LocalRolloutControl` over a wrapper in the
trainer's own process, and ``agentloop_engines.fleet.hosting.RemoteClient`` over one hosted inside the
shared Ray client actor (where every rollout worker's calls pass through the same gate).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.runtime.seeding import derive_seed
from agentloop_core.server_wrapper import BusyClock, TransparentServerWrapper

__all__ = ["LocalRolloutControl", "PartialRolloutServer", "PartialRolloutState", "RolloutControl",
           "resume_seed"]

_ABORT_RESEND_S = 0.05
"""How often a pause re-sends ``abort`` to calls that have not returned yet: an abort that
reaches an engine before the request it targets is ignored there."""


def resume_seed(seed: int | None, generated: int) -> int | None:
    """The seed of a generation's resumed call after ``generated`` tokens (None stays None).

    Reusing the original seed would replay the random draws that sampled the first tokens;
    a seed derived from the original one and the resume point keeps a seeded generation
    reproducible (same abort points, same tokens) without repeating draws.
    """
    if seed is None:
        return None
    return derive_seed(seed, "partial-rollout-resume", generated)


@dataclass(eq=False)  # hashed by identity: two calls may share a request id
class _Call:
    """One ``generate`` of the wrapper (it may span several engine calls)."""

    request_id: str
    user_aborted: bool = False
    in_engine: bool = False


@dataclass(frozen=True)
class PartialRolloutState:
    """A snapshot of a :class:`PartialRolloutServer`, in one piece (one remote call when the
    wrapper lives in a Ray actor)."""

    policy_version: int
    """The version of the weights the engine holds."""
    paused: bool
    """Whether a weight update holds the gate closed."""
    busy_seconds: float
    """See :meth:`PartialRolloutServer.busy_seconds`."""
    in_engine: int
    """Engine calls in flight now."""
    ledger_size: int
    """See :attr:`PartialRolloutServer.ledger_size`."""
    stats: dict[str, int]
    """A copy of :attr:`PartialRolloutServer.stats`."""


@dataclass
class _Ledger:
    token_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class PartialRolloutServer(TransparentServerWrapper):
    """An engine wrapper that carries generations across weight updates.

    Args:
        server: The engine (or a client in front of several). It must implement ``abort``
            so that an aborted call returns its tokens so far (every agentloop engine does).
        policy_version: The version of the weights the engine holds now.
        interrupt: True: a pause aborts in-flight calls and resumes them after the update
            (partial rollout). False: a pause waits for in-flight calls to finish on the old
            weights (one-step-off training), so every call still runs on one version.
        keep_ledger: Record every request id's tokens and versions until :meth:`pop_ledger`
            takes them (for a caller that pops every id it sends). Otherwise only the ids
            passed to :meth:`track` are recorded, and nothing else is kept.

    Attributes:
        policy_version: Bumped by each :meth:`weight_update` (or ``update_weights`` outside one).
        stats: ``resumed_calls`` (engine calls that continued an interrupted generation),
            ``interrupted_calls`` (engine calls a pause aborted), ``updates``.
    """

    def __init__(self, server: Any, policy_version: int = 0, interrupt: bool = True,
                 keep_ledger: bool = False) -> None:
        super().__init__(server)
        self.policy_version = int(policy_version)
        self.interrupt = interrupt
        self._busy = BusyClock()
        self.keep_ledger = keep_ledger
        self.stats: dict[str, int] = {"resumed_calls": 0, "interrupted_calls": 0, "updates": 0}
        self._calls: set[_Call] = set()
        self._ledger: dict[str, _Ledger] = collections.defaultdict(_Ledger)
        self._tracked: set[str] = set()
        self._gate: asyncio.Event | None = None
        self._returned = asyncio.Event()
        self._pausing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def _sync(self) -> None:
        # asyncio primitives belong to one event loop; build them on the loop that uses them.
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._gate = asyncio.Event()
            if not self._pausing:
                self._gate.set()
            self._returned = asyncio.Event()

    def busy_seconds(self) -> float:
        """Wall seconds so far during which at least one engine call was in flight (for the
        engine idle fraction of a step: one minus the busy share of its wall time)."""
        return self._busy.seconds()

    @property
    def paused(self) -> bool:
        """Whether a weight update holds the gate closed."""
        return self._pausing

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                       **multi_modal: Any) -> TokenOutput:
        """``generate`` that survives weight updates; see the module docstring (a resumed
        request carries the same ``multi_modal_data``: its images precede every generated token).

        Returns:
            Every token of the generation, one log-prob each (None when not asked for), the
            final stop reason (``aborted`` only for a caller's own ``abort``), and in ``extra``
            ``policy_versions`` (one per token) and ``resumes`` (how many times it resumed).
        """
        self._sync()
        assert self._gate is not None
        sp = SamplingParams.from_mapping(sampling_params)
        call = _Call(request_id)
        tokens: list[int] = []
        log_probs: list[float] | None = [] if sp.logprobs else None
        versions: list[int] = []
        extra: dict[str, Any] = {}
        resumes = 0
        self._calls.add(call)
        try:
            while True:
                await self._gate.wait()
                if call.user_aborted:
                    # The caller aborted while the call waited out a weight update: the engine
                    # ignored that abort (nothing of it was running), so it must not resume.
                    stop = "aborted"
                    break
                remaining = sp.max_tokens - len(tokens)
                if remaining < 1:  # pragma: no cover - an aborted call never ends on its budget
                    stop = "length"
                    break
                part_sp = sp if not tokens else sp.replace(max_tokens=remaining,
                                                            seed=resume_seed(sp.seed, len(tokens)))
                version = self.policy_version
                # No await between the gate check and marking the call in flight: a pause that
                # starts now sees it and aborts it.
                call.in_engine = True
                self._busy.enter()
                try:
                    out = await self.server.generate(request_id, list(prompt_ids) + tokens, part_sp, **multi_modal)
                finally:
                    call.in_engine = False
                    self._busy.leave()
                    self._returned.set()
                tokens.extend(out.token_ids)
                if log_probs is not None:
                    if out.log_probs is None:
                        log_probs = None
                    else:
                        log_probs.extend(out.log_probs)
                versions.extend([version] * len(out.token_ids))
                if self.keep_ledger or request_id in self._tracked:
                    entry = self._ledger[request_id]
                    entry.token_ids.extend(out.token_ids)
                    entry.versions.extend([version] * len(out.token_ids))
                extra.update(out.extra)
                stop = out.stop_reason
                if stop != "aborted" or call.user_aborted or not self._pausing:
                    # Aborted by someone else (or after the pause ended): the caller's abort.
                    break
                self.stats["interrupted_calls"] += 1
                resumes += 1
                self.stats["resumed_calls"] += 1
        finally:
            self._calls.discard(call)
        extra.update({"policy_versions": versions, "resumes": resumes})
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason=stop, extra=extra)

    async def abort(self, request_id: str) -> None:
        """The caller's abort: the generation returns ``aborted`` and is not resumed."""
        for call in list(self._calls):
            if call.request_id == request_id:
                call.user_aborted = True
        await self.server.abort(request_id)

    async def pause(self) -> None:
        """Close the gate, abort every in-flight engine call and wait until all have returned.

        Interrupted generations wait at the gate and resume after :meth:`unpause`.
        """
        self._sync()
        assert self._gate is not None
        if self._pausing:
            raise RuntimeError("PartialRolloutServer is already paused; call unpause() before pausing again")
        self._pausing = True
        self._gate.clear()
        while True:
            self._returned.clear()  # before looking: a call that returns from here on sets it
            busy = {c.request_id for c in self._calls if c.in_engine}
            if not busy:
                return
            if self.interrupt:
                for request_id in sorted(busy):
                    await self.server.abort(request_id)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._returned.wait(), _ABORT_RESEND_S)

    def unpause(self, policy_version: int | None = None) -> None:
        """Open the gate; interrupted generations resume on the weights the engine holds now.

        Args:
            policy_version: The version those weights are; None: one more than before.
        """
        if not self._pausing:
            raise RuntimeError("PartialRolloutServer is not paused; call pause() first")
        self.policy_version = self.policy_version + 1 if policy_version is None else int(policy_version)
        self.stats["updates"] += 1
        self._pausing = False
        if self._gate is not None:
            self._gate.set()

    @contextlib.asynccontextmanager
    async def weight_update(self, policy_version: int | None = None) -> AsyncIterator[None]:
        """Hold generation still around a weight push (which may be several ``update_weights``
        calls, one per bucket); interrupted generations resume when the block ends.

        Args:
            policy_version: The version of the pushed weights; None: the current one plus one.
        """
        await self.pause()
        try:
            yield
        finally:
            self.unpause(policy_version)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Push weights. Inside :meth:`weight_update` this only forwards; outside one it is a
        whole update of its own (pause, push, bump the version, resume)."""
        if self._pausing:
            await self.server.update_weights(named_tensors)
            return
        async with self.weight_update():
            await self.server.update_weights(named_tensors)

    def track(self, request_ids: Iterable[str]) -> None:
        """Record the tokens and versions of ``request_ids`` in the ledger until each is popped.

        Call it before the requests start; :meth:`pop_ledger` ends the tracking of an id.
        """
        self._tracked.update(request_ids)

    @property
    def ledger_size(self) -> int:
        """Request ids the ledger holds or tracks (zero once every tracked id was popped)."""
        return len(self._ledger.keys() | self._tracked)

    def pop_ledger(self, request_id: str) -> tuple[list[int], list[int]]:
        """``(token_ids, policy_versions)`` of every token generated under ``request_id`` since
        it was tracked (or the last pop), in generation order, and stop tracking it; empty lists
        for an id that generated nothing.

        Raises:
            RuntimeError: when ``request_id`` was not tracked and the wrapper was built without
                ``keep_ledger=True``.
        """
        if not self.keep_ledger and request_id not in self._tracked:
            raise RuntimeError(f"request {request_id!r} was not tracked: call track([request_id]) before it starts "
                               "(or build PartialRolloutServer(keep_ledger=True)) to read per-token versions back")
        self._tracked.discard(request_id)
        entry = self._ledger.pop(request_id, None)
        return (entry.token_ids, entry.versions) if entry is not None else ([], [])

    def pop_ledger_many(self, request_ids: Iterable[str]) -> list[tuple[list[int], list[int]]]:
        """:meth:`pop_ledger` of each id, in order (a group's rows in one call).

        Every id is popped even when one was not tracked; the error then comes after.

        Raises:
            RuntimeError: as :meth:`pop_ledger`, for the first untracked id.
        """
        out: list[tuple[list[int], list[int]]] = []
        error: RuntimeError | None = None
        for request_id in request_ids:
            try:
                out.append(self.pop_ledger(request_id))
            except RuntimeError as exc:
                error = error or exc
                out.append(([], []))
        if error is not None:
            raise error
        return out

    def snapshot(self) -> PartialRolloutState:
        """Version, gate, busy time, ledger size and stats as one frozen record."""
        return PartialRolloutState(policy_version=self.policy_version, paused=self.paused,
                                   busy_seconds=self.busy_seconds(), in_engine=self._busy.in_flight,
                                   ledger_size=self.ledger_size,
                                   stats=dict(self.stats))


@runtime_checkable
class RolloutControl(Protocol):
    """What a trainer needs of a :class:`PartialRolloutServer`, as async calls, so that one
    driver works whether the wrapper is in its process or inside a Ray actor.

    A weight push is ``pause()``, one ``update_weights`` per bucket, ``unpause(version)``; the
    trainer is the only caller of these, so it may mirror ``policy_version`` and ``paused``
    instead of asking for them.
    """

    async def set_policy_version(self, policy_version: int) -> None:
        """Declare the version of the weights the engine holds now (no update happens).

        Args:
            policy_version: The version, e.g. the trainer's step when a run starts or resumes.
        """
        ...

    async def pause(self) -> None:
        """:meth:`PartialRolloutServer.pause`: close the gate, abort (or, without interrupt,
        wait out) the in-flight engine calls and return once none is in the engine."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Push one bucket of weights (forwarded as is while paused).

        Args:
            named_tensors: ``(name, tensor)`` pairs.
        """
        ...

    async def unpause(self, policy_version: int | None = None) -> None:
        """:meth:`PartialRolloutServer.unpause`: open the gate on the pushed weights.

        Args:
            policy_version: Their version; None: one more than before.
        """
        ...

    async def track(self, request_ids: Iterable[str]) -> None:
        """:meth:`PartialRolloutServer.track`; call it before the requests start.

        Args:
            request_ids: The ids whose tokens and versions to record.
        """
        ...

    async def pop_ledger_many(self, request_ids: Iterable[str]) -> list[tuple[list[int], list[int]]]:
        """:meth:`PartialRolloutServer.pop_ledger_many`.

        Args:
            request_ids: Tracked ids.

        Returns:
            ``(token_ids, policy_versions)`` per id, in order.
        """
        ...

    async def rollout_state(self) -> PartialRolloutState:
        """:meth:`PartialRolloutServer.snapshot`.

        Returns:
            The wrapper's version, gate, busy seconds, ledger size and stats.
        """
        ...


class LocalRolloutControl:
    """:class:`RolloutControl` over a :class:`PartialRolloutServer` in this process (each call
    finishes on the caller's event loop, the one the wrapper's generations run on).

    Args:
        server: The wrapper.
    """

    def __init__(self, server: PartialRolloutServer) -> None:
        if not isinstance(server, PartialRolloutServer):
            raise TypeError(f"LocalRolloutControl needs a PartialRolloutServer, got {type(server).__name__}; "
                            "wrap the engine first: PartialRolloutServer(engine)")
        self.server = server

    async def set_policy_version(self, policy_version: int) -> None:
        """See :meth:`RolloutControl.set_policy_version`."""
        self.server.policy_version = int(policy_version)

    async def pause(self) -> None:
        """See :meth:`RolloutControl.pause`."""
        await self.server.pause()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """See :meth:`RolloutControl.update_weights`."""
        await self.server.update_weights(named_tensors)

    async def unpause(self, policy_version: int | None = None) -> None:
        """See :meth:`RolloutControl.unpause`."""
        self.server.unpause(policy_version)

    async def track(self, request_ids: Iterable[str]) -> None:
        """See :meth:`RolloutControl.track`."""
        self.server.track(request_ids)

    async def pop_ledger_many(self, request_ids: Iterable[str]) -> list[tuple[list[int], list[int]]]:
        """See :meth:`RolloutControl.pop_ledger_many`."""
        return self.server.pop_ledger_many(request_ids)

    async def rollout_state(self) -> PartialRolloutState:
        """See :meth:`RolloutControl.rollout_state`."""
        return self.server.snapshot()
