"""The rollout of a :class:`~agentloop_trainer.config.sections.TrainConfig`: the one place that
reads the sections the rollout room's pieces take and hands each its own (the rollout
section, the data lengths, the reward sections, ``ray``, the trainer's seed and mode).

The rollout room (:mod:`agentloop_trainer.rollout`) takes sections and plain facts; these
functions compose them for the stages and the CLI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.data.records import load_records
from agentloop_trainer.policy.chat_templates import check_template_renders_tools, custom_chat_template
from agentloop_trainer.policy.tokenizer import load_tokenizer, tokenizer_source
from agentloop_trainer.reward.scoring import RewardScorer
from agentloop_trainer.rollout import engines, run_config, tracing
from agentloop_trainer.rollout.diagnostics import RolloutWatch
from agentloop_trainer.rollout.dynamic_sampling import DynamicSampler
from agentloop_trainer.rollout.ray_session import ray_session as room_ray_session
from agentloop_trainer.rollout.rollouts import EvalResult, RolloutFleet
from agentloop_trainer.rollout.settings import uses_ray

if TYPE_CHECKING:
    from agentloop_core.engine_registry import EngineConfig
    from agentloop_core.settings import RolloutConfig
    from agentloop_core.tracing import Tracer

__all__ = [
    "checked_tokenizer", "dynamic_sampler", "engine_config", "evaluate_checkpoint", "ray_session", "rollout_config",
    "rollout_fleet", "rollout_tracer", "rollout_watch", "run_records", "tool_schemas",
]


def tool_schemas(cfg: TrainConfig) -> list[dict[str, Any]] | None:
    """The run's tool schemas (None without tools): see :func:`agentloop_trainer.rollout.run_config.tool_schemas`."""
    return run_config.tool_schemas(cfg.actor_rollout_ref.rollout.multi_turn, not cfg.data.train_files)


def rollout_config(cfg: TrainConfig, seed: int | None = None) -> RolloutConfig:
    """The run's :class:`~agentloop_core.settings.RolloutConfig`
    (:func:`agentloop_trainer.rollout.run_config.rollout_config`) with its reward hook."""
    return run_config.rollout_config(
        cfg.actor_rollout_ref.rollout, RewardScorer.from_sections(cfg.reward, cfg.custom_reward_function),
        prompt_length=cfg.data.max_prompt_length, response_length=cfg.data.max_response_length,
        builtin_task=not cfg.data.train_files, chat_template=custom_chat_template(cfg.model), seed=seed)


def engine_config(cfg: TrainConfig, model_path: str, tokenizer_path: str | None = None,
                  notice: Callable[[str], None] | None = None) -> EngineConfig:
    """The run's :class:`~agentloop_core.engine_registry.EngineConfig`
    (:func:`agentloop_trainer.rollout.engines.engine_config`)."""
    return engines.engine_config(
        cfg.actor_rollout_ref.rollout, model_path, tokenizer_path, notice, device=cfg.trainer.device,
        seed=cfg.trainer.seed, model_dtype=cfg.model.dtype,
        context_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
        chat_template=custom_chat_template(cfg.model))


def rollout_fleet(cfg: TrainConfig, model_path: str | Path, tokenizer: Any, engine_model: Any = None,
                  name: str = "agentloop", tracer: Any = None) -> RolloutFleet:
    """The run's :class:`~agentloop_trainer.rollout.rollouts.RolloutFleet` (its arguments: see there)."""
    return RolloutFleet(
        cfg.actor_rollout_ref.rollout, model_path, tokenizer, engine_model, name, tracer,
        record=rollout_config(cfg, cfg.trainer.seed),
        engine=engine_config(cfg, str(model_path), cfg.model.tokenizer_path),
        ray=cfg.ray, mode=cfg.trainer.mode, tokenizer_path=cfg.model.tokenizer_path)


@contextlib.contextmanager
def ray_session(cfg: TrainConfig, log: Any) -> Iterator[Any]:
    """The run's Ray cluster (:func:`agentloop_trainer.rollout.ray_session.ray_session`): when the
    rollout runs on Ray, or the FSDP ranks do (``trainer.launcher=ray``)."""
    needed = uses_ray(cfg.actor_rollout_ref.rollout, cfg.ray) or (
        cfg.trainer.fsdp_ranks > 1 and cfg.trainer.launcher == "ray")
    with room_ray_session(cfg.ray, log, needed=needed) as ray:
        yield ray


def rollout_tracer(cfg: TrainConfig, run_dir: str | Path) -> Tracer | None:
    """The run's rollout tracer (:func:`agentloop_trainer.rollout.tracing.rollout_tracer`)."""
    return tracing.rollout_tracer(cfg.actor_rollout_ref.rollout, cfg.trainer, run_dir)


def rollout_watch(cfg: TrainConfig, tokenizer: Any, log: Callable[[str], None], active: bool = True) -> RolloutWatch:
    """The run's :class:`~agentloop_trainer.rollout.diagnostics.RolloutWatch`."""
    return RolloutWatch(tokenizer, log, active, rollout=cfg.actor_rollout_ref.rollout,
                        response_length=cfg.data.max_response_length,
                        zero_reward_warn_steps=cfg.reward.zero_reward_warn_steps)


def dynamic_sampler(cfg: TrainConfig) -> DynamicSampler:
    """The run's :class:`~agentloop_trainer.rollout.dynamic_sampling.DynamicSampler`."""
    return DynamicSampler(cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer,
                          response_length=cfg.data.max_response_length, batch_groups=cfg.data.train_batch_size)


def run_records(cfg: TrainConfig, tokenizer: Any = None, log: Any = None,
                stats: dict[str, int] | None = None) -> tuple[list[dict], list[dict]]:
    """The run's train and held-out rows (:func:`agentloop_trainer.data.records.load_records`),
    prompts measured with the run's tool schemas."""
    schemas = tool_schemas(cfg) if tokenizer is not None and (cfg.data.train_files or cfg.data.val_files) else None
    return load_records(cfg.data, tokenizer, log, stats, schemas=schemas,
                        need_ground_truth=cfg.reward.source != "loop")


def checked_tokenizer(cfg: TrainConfig, checkpoint: str | Path | None = None) -> Any:
    """The run's tokenizer (``model.custom_chat_template`` applied), checked to show the run's
    tools to the model before any data or engine is loaded."""
    tokenizer = load_tokenizer(cfg.model, checkpoint)
    check_template_renders_tools(cfg.model, tokenizer, tokenizer_source(cfg.model, checkpoint), tool_schemas(cfg),
                                 default_agent_loop=cfg.actor_rollout_ref.rollout.agent.default_agent_loop)
    return tokenizer


def evaluate_checkpoint(cfg: TrainConfig, checkpoint: str | Path) -> EvalResult:
    """Greedy accuracy of ``checkpoint`` on the config's held-out split."""
    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
    tokenizer = checked_tokenizer(cfg, path)
    _, test = run_records(cfg, tokenizer, print)
    with ray_session(cfg, print):
        fleet = rollout_fleet(cfg, checkpoint, tokenizer, name="agentloop-eval")
        try:
            return fleet.evaluate(test)
        finally:
            fleet.close()
