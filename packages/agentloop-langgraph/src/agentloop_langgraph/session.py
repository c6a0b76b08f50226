"""``TrajectorySession``: one request id's trajectory in a :class:`~agentloop_langgraph.ChatModel`,
its segments, and what the model keeps to extend it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.protocol import TokenOutput
from agentloop_langgraph.messages import Recorded
from agentloop_tools.tool_media import MEDIA_COUNTERS

__all__ = ["TrajectorySession"]


@dataclass
class TrajectorySession:
    """One request id's trajectory and what the model needs to keep extending it.

    The trajectory is one or more segments, each a
    :class:`~agentloop_core.tokenization.Trajectory` whose every call extends the previous one;
    a call that rewrites the history closes :attr:`trajectory` and starts the next segment.
    """

    request_id: str
    """Sent with every generate call, so the client keeps the turns on one replica."""
    trajectory: Any
    """The current (last) segment's :class:`~agentloop_core.tokenization.Trajectory`."""
    recorded: list[Recorded]
    """One entry per message of the current segment, to check later calls against."""
    tools_key: str
    """The bound tool schemas (JSON) the current segment's prompt was rendered with."""
    closed: list[Any] = field(default_factory=list)
    """The earlier segments' trajectories, in order (each with at least one generation)."""
    rewrites: list[str] = field(default_factory=list)
    """Why each segment after the first was started (the history check's message), in order:
    ``rewrites[k]`` for ``segments[k + 1]``."""
    outputs: list[TokenOutput] = field(default_factory=list)
    """Every engine output of the trajectory, all segments, in order."""
    ended_with_eos: bool = True
    """Whether the current segment's last generation ended on a stop token
    (``ChatRenderer.ended_turn``)."""
    generate_s: float = 0.0
    """Seconds spent waiting for the engine."""
    calls_over_limit: set[str] = field(default_factory=set)
    """Ids of the tool calls past ``max_parallel_calls`` in their turn (see
    :meth:`ChatModel.is_call_over_limit`)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises calls: two concurrent calls cannot both extend one trajectory."""
    media: Any = None
    """The :class:`~agentloop_tools.tool_media.MediaScreen` of the tool results since the last
    model call (shared, so parallel calls count against ``max_images`` together); None until a
    tool asks for it (:meth:`ChatModel.media_screen`)."""
    media_counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEDIA_COUNTERS, 0))
    """Images that tools returned: kept, refused, refused for a text-only model, videos refused
    (:data:`~agentloop_tools.tool_media.MEDIA_COUNTERS`), all segments together."""

    @property
    def segments(self) -> list[Any]:
        """Every segment's trajectory, in order (the current one last)."""
        return [*self.closed, self.trajectory]

    @property
    def num_generations(self) -> int:
        """Model turns over all segments (``max_assistant_turns`` counts these)."""
        return sum(t.num_generations for t in self.segments)
