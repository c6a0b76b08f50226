"""What the code asks of a loaded config beyond its keys: derived settings read in one place
(the chat template's text, whether the run uses Ray, the staleness bound, offload)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentloop_trainer.config.errors import ConfigError
from agentloop_trainer.config.sections import TrainConfig

if TYPE_CHECKING:
    from agentloop_core.engine_registry import EnginePlugin


def engine_plugin(cfg: TrainConfig) -> EnginePlugin:
    """The installed engine plug-in ``actor_rollout_ref.rollout.name`` names.

    Raises:
        ConfigError: no installed engine has that name (listing those that are, and how to add
            one), or its plug-in failed to load.
    """
    from agentloop_core.engine_registry import UnknownEngineError, get_engine_plugin

    name = cfg.actor_rollout_ref.rollout.name
    try:
        return get_engine_plugin(name)
    except UnknownEngineError as exc:
        raise ConfigError(f"config actor_rollout_ref.rollout.name must be one of the installed engines ({exc})") from None


def custom_chat_template(cfg: TrainConfig) -> str | None:
    """The Jinja text ``model.custom_chat_template`` names, or None when it is unset.

    Raises:
        ConfigError: an unknown name or a missing file, listing the built-in names.
    """
    from agentloop_core.tokenization import resolve_chat_template

    value = cfg.model.custom_chat_template
    if value is None or value == "":
        return None
    try:
        return resolve_chat_template(str(value))
    except ValueError as exc:
        raise ConfigError(f"config model.custom_chat_template: {exc}") from exc


def max_staleness(cfg: TrainConfig) -> int:
    """The run's staleness bound in policy versions (``trainer.max_staleness`` or its mode's default)."""
    tc = cfg.trainer
    if tc.max_staleness is not None:
        return int(tc.max_staleness)
    return 0 if tc.mode == "sync" else 1


def offload_enabled(cfg: TrainConfig) -> bool:
    """Whether the policy is offloaded: any of the actor's ``fsdp_config`` switches."""
    f = cfg.actor_rollout_ref.actor.fsdp_config
    return bool(f.param_offload or f.optimizer_offload or f.offload_policy)


def reference_offloaded(cfg: TrainConfig) -> bool:
    """Whether a separate reference policy is loaded, and offloaded (``ref.fsdp_config.param_offload``
    or the actor's offload): KL on, no LoRA."""
    arr = cfg.actor_rollout_ref
    needed = arr.actor.use_kl_loss and cfg.model.lora_rank == 0
    return bool(needed and (arr.ref.fsdp_config.param_offload or offload_enabled(cfg)))


def uses_ray(cfg: TrainConfig) -> bool:
    """Whether the rollout runs on Ray: ``rollout.backend=ray`` or a ``ray.address`` to join."""
    return cfg.actor_rollout_ref.rollout.backend == "ray" or cfg.ray.address is not None
