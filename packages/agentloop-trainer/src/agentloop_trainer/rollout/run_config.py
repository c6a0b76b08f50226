"""The record a run's rollout runs with: its tools, its agent loops and their sections, and the
:class:`~agentloop_core.settings.RolloutConfig` the manager, the Ray workers and the loops get."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agentloop_core.protocol import SamplingParams
from agentloop_core.settings import RolloutConfig
from agentloop_trainer.config_base import plain_dict
from agentloop_trainer.reward.scoring import RewardScorer
from agentloop_trainer.rollout.multi_turn import MultiTurnSection, loop_options
from agentloop_trainer.rollout.settings import AgentSection, RolloutSection
from agentloop_trainer.task.calculator import BUILTIN_TOOL_CONFIG

if TYPE_CHECKING:
    from agentloop_core.tokenization.sanity import SanityCheckMode

__all__ = ["agent_loops", "rollout_config", "run_tools", "tool_paths", "tool_schemas"]


def tool_paths(multi_turn: MultiTurnSection, builtin_task: bool) -> tuple[str | None, str | None]:
    """``(tool_config_path, function_tool_path)`` of a run: the configured ones, or the
    calculator's config for the built-in task (``builtin_task``: no ``data.train_files``) when
    neither is set."""
    mt = multi_turn
    if mt.tool_config_path is None and mt.function_tool_path is None and builtin_task:
        return str(BUILTIN_TOOL_CONFIG), None
    return mt.tool_config_path, mt.function_tool_path


def run_tools(multi_turn: MultiTurnSection, builtin_task: bool) -> dict[str, Any]:
    """The run's tools by name (loaded once per process and shared with the loops)."""
    from agentloop_tools.loop_config import resolve_tools

    config_path, function_path = tool_paths(multi_turn, builtin_task)
    return resolve_tools({"tool_config_path": config_path, "function_tool_path": function_path})


def tool_schemas(multi_turn: MultiTurnSection, builtin_task: bool) -> list[dict[str, Any]] | None:
    """The tool schemas prompts are rendered with (None without tools), as the loop renders them."""
    tools = run_tools(multi_turn, builtin_task)
    return [t.tool_schema.model_dump(exclude_none=True) for t in tools.values()] or None


def agent_loops(agent: AgentSection) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """``(classes by import path, per-loop sections)`` from ``rollout.agent``: its ``loops``
    sections (``_target_`` registers a class) and verl's ``agent_loop_config_path`` YAML."""
    from omegaconf import OmegaConf

    sections: dict[str, dict[str, Any]] = {}
    if agent.agent_loop_config_path:
        path = Path(agent.agent_loop_config_path)
        if not path.is_file():
            raise FileNotFoundError(f"actor_rollout_ref.rollout.agent.agent_loop_config_path {path} does not exist")
        entries = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=True)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
            raise ValueError(f"{path}: expected a YAML list of {{name, _target_, ...}} entries (verl's layout)")
        for e in entries:
            sections[str(e["name"])] = {k: v for k, v in e.items() if k != "name"}
    for name, section in plain_dict(agent.loops, "actor_rollout_ref.rollout.agent.loops").items():
        if not isinstance(section, dict):
            raise ValueError(f"actor_rollout_ref.rollout.agent.loops.{name} must be a mapping of settings")
        sections.setdefault(name, {}).update(section)
    classes = {name: str(s.pop("_target_")) for name, s in sections.items() if "_target_" in s}
    return classes, {name: s for name, s in sections.items() if s}


def rollout_config(rollout: RolloutSection, scorer: RewardScorer, *, prompt_length: int, response_length: int,
                   builtin_task: bool, chat_template: str | None, seed: int | None = None) -> RolloutConfig:
    """The run's :class:`~agentloop_core.settings.RolloutConfig`, built once from the rollout
    section: the worker fields, the tool loops' keys (each under the loops' own name), the
    per-loop sections built into the loops' typed configs (a bad key fails here, at start-up)
    and the reward hook. What the manager, the Ray workers and the loops get, whole.

    Args:
        rollout: The ``actor_rollout_ref.rollout`` section.
        scorer: The reward hook (:meth:`~agentloop_trainer.reward.scoring.RewardScorer.from_sections`);
            its ``source`` also says whether the loops add up their own rewards.
        prompt_length: ``data.max_prompt_length``.
        response_length: ``data.max_response_length``.
        builtin_task: No ``data.train_files``: the calculator's tools when none are configured.
        chat_template: The run's chat template text (None: the tokenizer's own).
        seed: The workers' ``sampling_seed``: each trajectory's sampling seeds then follow from
            it, the step and the row's request id, whichever replica or node serves it.

    Raises:
        ValueError: a bad value or an unknown key of a loop section, naming it.
        UnknownAgentLoopError: the default loop, or a section's, is not registered.
    """
    r = rollout
    mt, val = r.multi_turn, r.val_kwargs
    config_path, function_path = tool_paths(mt, builtin_task)
    classes, per_loop = agent_loops(r.agent)
    train = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                           max_tokens=mt.max_tokens_per_turn, logprobs=True)
    if val.do_sample and val.temperature > 0:
        val_sampling = train.replace(temperature=val.temperature, top_k=val.top_k, top_p=val.top_p)
    else:
        val_sampling = train.replace(temperature=0.0)
    # The section's tool-loop keys under the loops' names (declared once, by the loops' config),
    # with the two the trainer decides: the built-in task's tools, and adding up the loop's own
    # rewards only when they are used.
    tool_loop_options = {
        **loop_options(mt), "tool_config_path": config_path, "function_tool_path": function_path,
        "tool_reward": "none" if scorer.source == "function" else "sum",
    }
    record = RolloutConfig(
        default_agent_loop=r.agent.default_agent_loop,
        agent_loop_modules=tuple(r.agent.agent_loop_modules),
        agent_loop_classes=tuple(classes.items()),
        loop_options=tuple(tool_loop_options.items()),
        prompt_length=prompt_length,
        response_length=response_length,
        truncate=True,
        # A str in the YAML schema (OmegaConf has no Literal); RolloutConfig checks the value.
        sanity_check=cast("SanityCheckMode", r.sanity_check),
        # Workers that load the tokenizer by path (Ray) set the run's template on it.
        custom_chat_template=chat_template,
        sample_timeout_s=r.sample_timeout_s,
        turns_per_loop_iteration=r.agent.turns_per_loop_iteration,
        hold_full_gc=r.agent.hold_full_gc,
        switch_interval_s=r.agent.switch_interval_s,
        sampling_seed=seed,
        sampling_params=train,
        val_sampling_params=val_sampling,
        reward_fn=scorer,
    )
    return record.with_loop_configs(per_loop, also=[record.default_agent_loop] if record.default_agent_loop else [])

