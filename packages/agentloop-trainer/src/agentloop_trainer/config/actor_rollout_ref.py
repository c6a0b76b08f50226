"""The ``actor_rollout_ref`` section of the config (verl's layout), composed of the update room's
actor and reference sections and the rollout room's rollout section."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentloop_trainer.rollout.multi_turn import MultiTurnSection
from agentloop_trainer.rollout.settings import AgentSection, RolloutSection, TraceSection, ValKwargsSection
from agentloop_trainer.update.settings import (
    ActorFSDPSection,
    ActorSection,
    PolicyLossSection,
    RefFSDPSection,
    RefSection,
)

__all__ = [
    "ActorFSDPSection", "ActorRolloutRefSection", "ActorSection", "AgentSection", "MultiTurnSection",
    "PolicyLossSection", "RefFSDPSection", "RefSection", "RolloutSection", "TraceSection", "ValKwargsSection",
]


@dataclass
class ActorRolloutRefSection:
    """Actor, rollout and reference (verl layout)."""

    actor: ActorSection = field(default_factory=ActorSection)
    """The trained policy."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """The rollout engine and loop."""
    ref: RefSection = field(default_factory=RefSection)
    """The KL reference."""
