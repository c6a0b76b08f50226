"""What the code asks of a loaded config beyond its keys: derived settings read in one place
(the chat template's text, whether the run uses Ray, the staleness bound, offload). Each reads
the room that owns it, given the sections it needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.policy import chat_templates
from agentloop_trainer.rollout import settings as rollout_settings
from agentloop_trainer.update import settings as update_settings

if TYPE_CHECKING:
    from agentloop_core.engine_registry import EnginePlugin

__all__ = ["custom_chat_template", "engine_plugin", "max_staleness", "offload_enabled", "reference_offloaded",
           "uses_ray"]


def engine_plugin(cfg: TrainConfig) -> EnginePlugin:
    """The installed engine plug-in ``actor_rollout_ref.rollout.name`` names
    (:func:`agentloop_trainer.rollout.settings.engine_plugin`)."""
    return rollout_settings.engine_plugin(cfg.actor_rollout_ref.rollout)


def custom_chat_template(cfg: TrainConfig) -> str | None:
    """The Jinja text ``model.custom_chat_template`` names, or None when it is unset
    (:func:`agentloop_trainer.policy.chat_templates.custom_chat_template`)."""
    return chat_templates.custom_chat_template(cfg.model)


def max_staleness(cfg: TrainConfig) -> int:
    """The run's staleness bound in policy versions (``trainer.max_staleness`` or its mode's default)."""
    tc = cfg.trainer
    if tc.max_staleness is not None:
        return int(tc.max_staleness)
    return 0 if tc.mode == "sync" else 1


def offload_enabled(cfg: TrainConfig) -> bool:
    """Whether the policy is offloaded (:func:`agentloop_trainer.update.settings.offload_enabled`)."""
    return update_settings.offload_enabled(cfg.actor_rollout_ref.actor)


def reference_offloaded(cfg: TrainConfig) -> bool:
    """Whether a separate reference policy is loaded, and offloaded
    (:func:`agentloop_trainer.update.settings.reference_offloaded`)."""
    arr = cfg.actor_rollout_ref
    return update_settings.reference_offloaded(arr.actor, arr.ref, cfg.model.lora_rank)


def uses_ray(cfg: TrainConfig) -> bool:
    """Whether the rollout runs on Ray: ``rollout.backend=ray`` or a ``ray.address`` to join."""
    return rollout_settings.uses_ray(cfg.actor_rollout_ref.rollout, cfg.ray)
