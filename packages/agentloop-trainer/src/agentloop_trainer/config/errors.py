"""The one error a config raises (declared below every room, in
:mod:`agentloop_trainer.config_base`, so that each room's check can raise it)."""

from agentloop_trainer.config_base import ConfigError

__all__ = ["ConfigError"]
