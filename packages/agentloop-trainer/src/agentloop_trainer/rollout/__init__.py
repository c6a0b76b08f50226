"""Rollout: dataset rows through the agent loops and the configured engines, for training and
evaluation.

- :mod:`~agentloop_trainer.rollout.settings`: the room's sections (``actor_rollout_ref.rollout``,
  ``algorithm.filter_groups``, ``ray``) and their checks; the multi-turn section is
  :mod:`~agentloop_trainer.rollout.multi_turn`.
- :mod:`~agentloop_trainer.rollout.rollouts`: :class:`RolloutFleet` (the engines, the
  ``AgentLoopManager`` and the reward on the trainer's event loop), ``make_rows``, the
  held-out evaluation.
- :mod:`~agentloop_trainer.rollout.run_config`: the record the loops run with (tools, agent
  loops, reward hook).
- :mod:`~agentloop_trainer.rollout.engines`: the engine plug-in ``rollout.name`` names, or
  remote engine servers (``rollout.server_urls``).
- :mod:`~agentloop_trainer.rollout.diagnostics`: what a run tells its user when the rollout's
  numbers say something is wrong.
- :mod:`~agentloop_trainer.rollout.ray_session`: the Ray cluster a run joins or starts.
"""

from agentloop_trainer.rollout.diagnostics import (
    TURN_CAP_KEY,
    TURN_CAP_WARN_FRACTION,
    RolloutWatch,
    batch_errors,
    failure_breakdown,
    report_failures,
    turn_cap_warning,
    zero_reward_hint,
)
from agentloop_trainer.rollout.engines import (
    build_engine,
    capabilities,
    engine_config,
    engine_factory,
    remote_engines,
    rollout_dtype,
)
from agentloop_trainer.rollout.ray_session import ray_session
from agentloop_trainer.rollout.rollouts import EvalResult, RolloutFleet, attach_rewards, make_rows
from agentloop_trainer.rollout.run_config import (
    agent_loops,
    rollout_config,
    run_tools,
    tool_paths,
    tool_schemas,
)
from agentloop_trainer.rollout.settings import RaySection, RolloutSection, engine_plugin, uses_ray

__all__ = [
    "EvalResult",
    "RaySection",
    "RolloutFleet",
    "RolloutSection",
    "RolloutWatch",
    "TURN_CAP_KEY",
    "TURN_CAP_WARN_FRACTION",
    "agent_loops",
    "attach_rewards",
    "batch_errors",
    "build_engine",
    "capabilities",
    "engine_config",
    "engine_factory",
    "engine_plugin",
    "failure_breakdown",
    "make_rows",
    "ray_session",
    "remote_engines",
    "report_failures",
    "rollout_dtype",
    "rollout_config",
    "run_tools",
    "tool_paths",
    "tool_schemas",
    "turn_cap_warning",
    "uses_ray",
    "zero_reward_hint",
]
