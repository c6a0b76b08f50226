"""Which engine replicas hold the fleet's latest weights (for
:class:`~agentloop_engines.fleet.client.LLMServerClient`).

A trainer pushes weights in buckets (one ``update_weights`` call each), and the client does not
know where one policy version ends and the next begins. So staleness is tracked per weight
name: a replica that misses a push of some names holds old values of exactly those names, and
is current again once a later push of every one of them has reached it. A full push (every
weight, as the trainers send) brings any reachable replica back; a partial one (adapters only)
clears only what it carries. No copy of the weights is kept: re-sending them to a replica that
comes back would need the exact tensors of the latest version (not the trainer's model, which
may have moved on), i.e. a second copy of the model in host memory for the whole run.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ["WeightLedger"]


class WeightLedger:
    """Per replica, the weight names whose latest pushed value it does not hold.

    Args:
        num_replicas: How many replicas there are; they are addressed by index.

    Raises:
        ValueError: on ``num_replicas < 1``.
    """

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got num_replicas={num_replicas}")
        self._missing: list[set[str]] = [set() for _ in range(num_replicas)]
        self._pushed: set[str] = set()
        self.pushes = 0
        """Pushes recorded (``update_weights`` calls that at least one replica missed or got)."""
        self.received: list[int] = [0] * num_replicas
        """Pushes each replica accepted."""

    def record(self, names: Iterable[str], got: Collection[int], missed: Collection[int]) -> tuple[list[int], list[int]]:
        """Record one push of ``names``: the replicas in ``got`` accepted it, those in
        ``missed`` did not (replicas in neither, e.g. ones that refused a push every replica
        refused, keep what they had).

        Returns:
            ``(became_stale, became_current)``: replica indices whose state changed.
        """
        names = set(names)
        was = [self.is_stale(i) for i in range(len(self._missing))]
        if got or missed:
            self._pushed |= names
        for i in got:
            self._missing[i] -= names
            self.received[i] += 1
        for i in missed:
            self._missing[i] |= names
        if got or missed:
            self.pushes += 1
        now = [self.is_stale(i) for i in range(len(self._missing))]
        return ([i for i, (a, b) in enumerate(zip(was, now, strict=True)) if b and not a],
                [i for i, (a, b) in enumerate(zip(was, now, strict=True)) if a and not b])

    def is_stale(self, index: int) -> bool:
        """Whether replica ``index`` misses the latest value of some weight."""
        return bool(self._missing[index])

    def missing(self, index: int) -> list[str]:
        """The weight names replica ``index`` holds old values of (sorted)."""
        return sorted(self._missing[index])

    def lost_all(self, index: int) -> bool:
        """Replica ``index`` restarted from its checkpoint: it holds the pushed value of no
        weight. Returns whether that made it stale (False when nothing was ever pushed)."""
        self._missing[index] = set(self._pushed)
        return bool(self._pushed)

    def forget(self, index: int) -> None:
        """Treat replica ``index`` as current (its operator says so: ``mark_healthy``)."""
        self._missing[index].clear()
