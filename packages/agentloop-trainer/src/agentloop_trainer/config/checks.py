"""Range and choice checks that types cannot express, run on every loaded config."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from agentloop_trainer.config.accessors import custom_chat_template, engine_plugin, uses_ray
from agentloop_trainer.config.critic import critic_checks
from agentloop_trainer.config.errors import ConfigError
from agentloop_trainer.config.sections import TrainConfig

if TYPE_CHECKING:
    from agentloop_core.engine_registry import EnginePlugin

REWARD_SOURCES = ("auto", "function", "loop", "sum")
"""Values of ``reward.source``."""
TRAIN_DTYPES = ("float32", "bfloat16")
"""Values of ``model.dtype``."""
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16", "auto")
"""Values of ``actor_rollout_ref.rollout.dtype`` (besides null)."""

CPU_MATMULS = ("onednn", "torch")
"""Values of ``model.cpu_matmul`` (:mod:`agentloop_trainer.policy.onednn_linear`)."""

TRAINER_MODES = ("sync", "one_step_off", "async")
"""Values of ``trainer.mode``."""

TRACE_BACKENDS = (None, "mlflow", "jsonl")
"""Values of ``actor_rollout_ref.rollout.trace.backend`` (verl's weave is not one)."""


def validate(cfg: TrainConfig) -> None:
    """Range and choice checks that types cannot express.

    Raises:
        ConfigError: naming the key.
    """
    from agentloop_engines.fleet.hosting import PLACEMENT_STRATEGIES
    from agentloop_trainer.reward.scoring import ANSWER_FORMATS
    from agentloop_trainer.update.advantages import ADVANTAGE_ESTIMATORS
    from agentloop_trainer.update.losses import LOSS_AGG_MODES, POLICY_LOSSES
    from agentloop_trainer.update.turn_credit import TURN_CREDIT_MODES

    r, a = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    try:
        engine: EnginePlugin | None = engine_plugin(cfg)
        unknown_engine = ""
    except ConfigError as exc:  # raised in its turn below, after the checks listed before it
        engine, unknown_engine = None, str(exc).removeprefix("config actor_rollout_ref.rollout.name must be ")
    dtypes = engine.capabilities.dtypes if engine is not None else ()
    estimator = ADVANTAGE_ESTIMATORS.find(cfg.algorithm.adv_estimator)
    checks = [
        ("algorithm.adv_estimator", estimator is not None, f"one of {tuple(ADVANTAGE_ESTIMATORS.names())} "
         "(or one registered with agentloop_trainer.update.advantages.register_advantage_estimator)"),
        *critic_checks(cfg.algorithm.adv_estimator, estimator is not None and estimator.needs_critic, cfg.critic,
                       gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam, turn_credit=cfg.algorithm.turn_credit,
                       fsdp_ranks=cfg.trainer.fsdp_ranks, critic_warmup=cfg.trainer.critic_warmup),
        ("actor_rollout_ref.actor.loss_agg_mode", cfg.actor_rollout_ref.actor.loss_agg_mode in LOSS_AGG_MODES,
         f"one of {LOSS_AGG_MODES}"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", a.policy_loss.loss_mode in POLICY_LOSSES,
         f"one of {tuple(POLICY_LOSSES.names())}"),
        ("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n >= 1, "at least 1 (2+ for GRPO)"),
        ("actor_rollout_ref.rollout.n", estimator is None or r.n >= estimator.min_group_size,
         f"at least {estimator.min_group_size if estimator else 1} with algorithm.adv_estimator="
         f"{cfg.algorithm.adv_estimator} ({estimator.why if estimator else ''})"),
        ("algorithm.turn_credit", cfg.algorithm.turn_credit in TURN_CREDIT_MODES, f"one of {TURN_CREDIT_MODES}"),
        ("algorithm.turn_gamma", 0.0 <= cfg.algorithm.turn_gamma <= 1.0, "between 0 and 1 (the per-turn discount)"),
        ("algorithm.step_group_weight", math.isfinite(cfg.algorithm.step_group_weight)
         and cfg.algorithm.step_group_weight >= 0, "a finite number >= 0"),
        ("actor_rollout_ref.rollout.n", cfg.algorithm.turn_credit == "trajectory" or r.n >= 2,
         f"at least 2 with algorithm.turn_credit={cfg.algorithm.turn_credit} (each turn's baseline is the mean "
         "over the group's other trajectories)"),
        ("data.train_batch_size", cfg.data.train_batch_size >= 1, "at least 1"),
        ("trainer.total_steps", cfg.trainer.total_steps >= 0, ">= 0"),
        ("trainer.log_trajectories_per_step", cfg.trainer.log_trajectories_per_step >= 0, ">= 0"),
        ("trainer.fsdp_ranks", cfg.trainer.fsdp_ranks >= 1, "at least 1"),
        ("trainer.device", cfg.trainer.device in ("cpu", "cuda"), "cpu or cuda"),
        ("trainer.launcher", cfg.trainer.launcher in ("spawn", "ray"), "spawn or ray"),
        ("trainer.resume", cfg.trainer.resume in ("never", "auto", "must"), "never, auto or must"),
        ("actor_rollout_ref.rollout.backend", cfg.actor_rollout_ref.rollout.backend in ("inprocess", "ray"),
         "inprocess or ray"),
        ("actor_rollout_ref.rollout.num_replicas", cfg.actor_rollout_ref.rollout.num_replicas >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.trace.backend", r.trace.backend in TRACE_BACKENDS,
         f"null, {' or '.join(map(str, TRACE_BACKENDS[1:]))} (agentloop traces to MLflow or a JSONL file), "
         f"got {r.trace.backend!r}"),
        ("actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker",
         r.trace.max_samples_per_step_per_worker is None or r.trace.max_samples_per_step_per_worker >= 0,
         "null (every trajectory) or >= 0"),
        ("actor_rollout_ref.rollout.num_replicas",
         cfg.actor_rollout_ref.rollout.num_replicas == 1 or uses_ray(cfg),
         "1 with the inprocess backend (set actor_rollout_ref.rollout.backend=ray or ray.address for more)"),
        ("ray.placement_strategy", cfg.ray.placement_strategy in PLACEMENT_STRATEGIES,
         f"one of {', '.join(PLACEMENT_STRATEGIES)}"),
        ("ray.worker_placement", cfg.ray.worker_placement in ("spread", "default"), "spread or default"),
        ("actor_rollout_ref.rollout.name", engine is not None, unknown_engine),
        ("actor_rollout_ref.rollout.dtype", r.dtype is None or r.dtype in ROLLOUT_DTYPES,
         f"null (float32) or one of {ROLLOUT_DTYPES}"),
        ("actor_rollout_ref.rollout.dtype", r.dtype is None or r.dtype in dtypes,
         f"{', '.join(dtypes)} or null with rollout.name={r.name} (the dtypes its plug-in declares in "
         "capabilities.dtypes; auto, the engine's own choice, only where declared)"),
        ("actor_rollout_ref.rollout.server_urls", not r.server_urls or not uses_ray(cfg),
         "unset with the ray backend (remote servers are routed from the trainer process)"),
        ("actor_rollout_ref.rollout.multi_turn.enable", r.multi_turn.enable,
         "true (agentloop's loops are multi-turn; a loop that stops after one turn is still one)"),
        *((f"actor_rollout_ref.rollout.multi_turn.{key}",
           getattr(r.multi_turn, key) is None or getattr(r.multi_turn, key) >= 1, "null or at least 1")
          for key in ("max_tool_response_length", "max_tool_response_tokens")),
        ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
         r.multi_turn.tool_response_truncate_side in ("left", "right", "middle"), "left, right or middle"),
        ("actor_rollout_ref.rollout.sanity_check", r.sanity_check in ("strict", "ignore_strippable", "disable"),
         "strict, ignore_strippable or disable"),
        ("actor_rollout_ref.rollout.val_kwargs.n", r.val_kwargs.n >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.agent.turns_per_loop_iteration",
         r.agent.turns_per_loop_iteration is None or r.agent.turns_per_loop_iteration >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size",
         a.ppo_mini_batch_size is None or 1 <= a.ppo_mini_batch_size <= cfg.data.train_batch_size,
         "null or between 1 and data.train_batch_size (it counts prompts, as in verl)"),
        ("reward.source", cfg.reward.source in REWARD_SOURCES, f"one of {REWARD_SOURCES}"),
        ("reward.timeout_s", cfg.reward.timeout_s is None or cfg.reward.timeout_s > 0,
         "null (no limit) or a positive number of seconds"),
        ("reward.answer_format", all(v in ANSWER_FORMATS for v in cfg.reward.answer_format.values()),
         f"a mapping of data_source (or default) to one of {ANSWER_FORMATS}, e.g. reward.answer_format.gsm8k=flexible"),
        ("model.dtype", cfg.model.dtype in TRAIN_DTYPES,
         f"one of {TRAIN_DTYPES} (float16 needs loss scaling, which agentloop does not do: use bfloat16)"),
        ("model.lora_rank", cfg.model.lora_rank >= 0, ">= 0 (0: train every weight)"),
        ("model.cpu_matmul", cfg.model.cpu_matmul in CPU_MATMULS, f"one of {CPU_MATMULS}"),
        ("trainer.hf_max_shard_megabytes", cfg.trainer.hf_max_shard_megabytes >= 1, "at least 1"),
        ("model.lora_alpha", cfg.model.lora_alpha > 0, "> 0"),
        ("sft.batch_size", cfg.sft.batch_size >= 1, "at least 1"),
        ("sft.micro_batch_size", cfg.sft.micro_batch_size is None or 1 <= cfg.sft.micro_batch_size <= cfg.sft.batch_size,
         "null or between 1 and sft.batch_size"),
        ("sft.epochs", cfg.sft.epochs >= 1, "at least 1"),
        ("sft.total_steps", cfg.sft.total_steps is None or cfg.sft.total_steps >= 1, "null or at least 1"),
        ("sft.max_length", cfg.sft.max_length >= 2, "at least 2"),
        ("sft.resume", cfg.sft.resume in ("never", "auto", "must"), "never, auto or must"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
         a.ppo_micro_batch_size_per_gpu is None or a.ppo_micro_batch_size_per_gpu >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
         a.log_prob_micro_batch_size_per_gpu is None or a.log_prob_micro_batch_size_per_gpu >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu >= 2, "at least 2"),
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", r.update_weights_bucket_megabytes > 0,
         "> 0"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {key} must be {expected}")
    _validate_sampling(cfg)
    _validate_rollout_correction(cfg)
    _validate_mode(cfg)
    _validate_loggers(cfg)
    _validate_dapo(cfg)
    _validate_judge(cfg)
    _validate_distillation(cfg)
    custom_chat_template(cfg)  # an unknown name or a missing file fails here, before anything loads


def _validate_judge(cfg: TrainConfig) -> None:
    """``reward.judge`` (:meth:`~agentloop_trainer.reward.judge.JudgeSettings.from_section`), and
    that ``url=policy`` has the policy engine in the trainer's process."""
    from agentloop_trainer.reward.judge import POLICY, JudgeSettings

    try:
        settings = JudgeSettings.from_section(cfg.reward.judge)
    except ValueError as exc:
        raise ConfigError(f"config {exc}") from None
    if settings is not None and settings.url == POLICY and uses_ray(cfg):
        raise ConfigError("config reward.judge.url=policy needs the inprocess rollout backend (the judge calls the "
                          "engine from the rollout workers of the trainer's process); on Ray serve a judge "
                          "(`agentloop serve CHECKPOINT --port 8001`) and set reward.judge.url=http://HOST:8001/v1")
    if settings is not None and settings.mode == "group":
        if cfg.actor_rollout_ref.rollout.n < 2:
            raise ConfigError(f"config reward.judge.mode=group compares the samples of a prompt, but "
                              f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n}: set n to 2 or more, "
                              "or reward.judge.mode=single")
        if cfg.trainer.mode != "sync":
            raise ConfigError(f"config reward.judge.mode=group runs between a step's rollout and its update, which "
                              f"trainer.mode={cfg.trainer.mode} overlaps: use trainer.mode=sync, or "
                              "reward.judge.mode=single (judged as each trajectory finishes, in every mode)")


def _validate_sampling(cfg: TrainConfig) -> None:
    """The sampling keys checked by core's ``SamplingParams`` (the one validator every entry
    point uses) at load, not when the rollout starts: NaN or inf, out of range, wrong type."""
    from agentloop_core.protocol import SamplingParams

    r = cfg.actor_rollout_ref.rollout
    prefix = "actor_rollout_ref.rollout."
    keys = {  # config key -> (SamplingParams field, value)
        prefix + "temperature": ("temperature", r.temperature), prefix + "top_k": ("top_k", r.top_k),
        prefix + "top_p": ("top_p", r.top_p),
        prefix + "multi_turn.max_tokens_per_turn": ("max_tokens", r.multi_turn.max_tokens_per_turn),
        prefix + "val_kwargs.temperature": ("temperature", r.val_kwargs.temperature),
        prefix + "val_kwargs.top_k": ("top_k", r.val_kwargs.top_k),
        prefix + "val_kwargs.top_p": ("top_p", r.val_kwargs.top_p),
    }
    for key, (name, value) in keys.items():
        try:
            SamplingParams.from_mapping({name: value})
        except ValueError as exc:
            raise ConfigError(f"config {key}: {exc}") from exc
    if not isinstance(r.val_kwargs.do_sample, bool):
        raise ConfigError(f"config {prefix}val_kwargs.do_sample must be true or false, got {r.val_kwargs.do_sample!r}")


def _validate_loggers(cfg: TrainConfig) -> None:
    """``trainer.logger``'s names and that their packages are installed, ``trainer.wandb_mode``."""
    from agentloop_trainer.loggers import (
        LOGGERS,
        WANDB_MODES,
        active_loggers,
        missing_package,
        parse_logger_names,
    )

    tc = cfg.trainer
    for name in parse_logger_names(tc.logger):
        if name not in LOGGERS:
            raise ConfigError(f"config trainer.logger: unknown logger {name!r}; the loggers are {', '.join(LOGGERS)} "
                              "(e.g. trainer.logger=[console,wandb])")
    for name in active_loggers(cfg):
        hint = missing_package(name)
        if hint:
            why = "trainer.mlflow_tracking_uri is set" if name not in parse_logger_names(tc.logger) else (
                f"trainer.logger lists {name}")
            raise ConfigError(f"config {why}, but its package is not installed: {hint}")
    if cfg.actor_rollout_ref.rollout.trace.backend == "mlflow" and missing_package("mlflow"):
        raise ConfigError("config actor_rollout_ref.rollout.trace.backend=mlflow, but its package is not installed: "
                          f"{missing_package('mlflow')}")
    if tc.wandb_mode is not None and tc.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"config trainer.wandb_mode must be null or one of {WANDB_MODES}, got {tc.wandb_mode!r}")


def _validate_rollout_correction(cfg: TrainConfig) -> None:
    """``algorithm.rollout_correction``: levels, options and thresholds parse, and it does not
    contradict ``actor.tis_cap`` (two importance weights on one loss)."""
    from agentloop_trainer.update.rollout_correction import (
        IMPORTANCE_LEVELS,
        parse_is_threshold,
        parse_rs_options,
        parse_rs_thresholds,
    )

    rc, tis_cap = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.tis_cap
    prefix = "config algorithm.rollout_correction."
    if rc.rollout_is is not None and rc.rollout_is not in IMPORTANCE_LEVELS:
        raise ConfigError(f"{prefix}rollout_is must be null or one of {tuple(IMPORTANCE_LEVELS.names())}, "
                          f"got {rc.rollout_is!r}")
    if rc.rollout_is is not None and tis_cap is not None:
        raise ConfigError(
            f"{prefix}rollout_is={rc.rollout_is} and actor_rollout_ref.actor.tis_cap={tis_cap} both weight the loss "
            "by the rollout-vs-trainer ratio; set actor_rollout_ref.actor.tis_cap=null to use rollout_is "
            f"(rollout_is=token rollout_is_threshold={tis_cap} is what tis_cap={tis_cap} does), or unset rollout_is")
    try:
        if rc.rollout_is is not None:
            parse_is_threshold(rc.rollout_is_threshold)
        if rc.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(str(rc.rollout_rs)), rc.rollout_rs_threshold)
    except ValueError as exc:
        raise ConfigError(f"config {exc}") from None


def _validate_mode(cfg: TrainConfig) -> None:
    """``trainer.mode`` and ``trainer.max_staleness``, and what the async modes support so far."""
    tc, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    if tc.mode not in TRAINER_MODES:
        raise ConfigError(f"config trainer.mode must be one of {TRAINER_MODES}, got {tc.mode!r}")
    fixed = {"sync": 0, "one_step_off": 1}
    if tc.mode in fixed and tc.max_staleness not in (None, fixed[tc.mode]):
        raise ConfigError(f"config trainer.max_staleness is {fixed[tc.mode]} in trainer.mode={tc.mode}, got "
                          f"{tc.max_staleness}; leave it unset or use trainer.mode=async for another bound")
    if tc.max_staleness is not None and tc.max_staleness < 0:
        raise ConfigError(f"config trainer.max_staleness must be >= 0 (policy versions), got {tc.max_staleness}")
    if tc.mode == "sync":
        return
    # Partial rollout needs an engine whose abort returns the tokens generated so far (with
    # their log-probs): its plug-in says so (capabilities.partial_rollout). Our HTTP engine
    # server in front of such an engine (rollout.server_urls) is verified too, and so are Ray
    # replicas (the wrapper then lives in the shared client actor every rollout worker calls
    # through). Under FSDP the driver runs on rank 0, which hosts the engine; the other ranks
    # follow its updates and weight pushes.
    from agentloop_core.engine_registry import engine_names, get_engine_plugin

    able = [n for n in engine_names() if get_engine_plugin(n).capabilities.partial_rollout]
    unsupported = [
        ("actor_rollout_ref.rollout.name", bool(r.server_urls) or engine_plugin(cfg).capabilities.partial_rollout,
         f"one of the engines whose plug-in declares capabilities.partial_rollout ({', '.join(able)}; "
         f"not {r.name}: an engine declares it when its abort returns the tokens generated so far, with "
         "their log-probs, and a resumed request continues from them)"),
    ]
    for key, ok, expected in unsupported:
        if not ok:
            raise ConfigError(f"config {key} must be {expected} with trainer.mode={tc.mode}; "
                              "or use trainer.mode=sync for this setup")


def _validate_dapo(cfg: TrainConfig) -> None:
    """Dynamic sampling (``algorithm.filter_groups``) and over-long shaping
    (``reward_model.overlong_buffer``)."""
    from agentloop_trainer.config.dapo import FILTER_METRICS, ON_LIMIT

    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    limit = cfg.data.max_response_length
    checks = [
        ("algorithm.filter_groups.metric", fg.metric in FILTER_METRICS,
         f"one of {FILTER_METRICS} (a per-trajectory quantity agentloop defines), got {fg.metric!r}"),
        ("algorithm.filter_groups.max_num_gen_batches", fg.max_num_gen_batches >= 0,
         f">= 0 (0: no limit), got {fg.max_num_gen_batches}"),
        ("algorithm.filter_groups.on_limit", fg.on_limit in ON_LIMIT, f"one of {ON_LIMIT}, got {fg.on_limit!r}"),
        ("algorithm.filter_groups.on_limit", not fg.enable or fg.on_limit == "error" or cfg.trainer.mode == "sync",
         f"error with trainer.mode={cfg.trainer.mode} (a step there trains data.train_batch_size groups from "
         "the buffer); train_kept is for trainer.mode=sync"),
        ("actor_rollout_ref.rollout.n", not fg.enable or cfg.actor_rollout_ref.rollout.n >= 2,
         f"at least 2 with algorithm.filter_groups.enable=true (a group of one sample never has a spread), "
         f"got {cfg.actor_rollout_ref.rollout.n}"),
        ("reward_model.overlong_buffer.len", not ob.enable or 1 <= ob.len < limit,
         f"between 1 and data.max_response_length - 1 ({limit - 1}) with reward_model.overlong_buffer.enable=true, "
         f"got {ob.len}"),
        ("reward_model.overlong_buffer.penalty_factor", math.isfinite(ob.penalty_factor) and ob.penalty_factor >= 0,
         f"a finite number >= 0, got {ob.penalty_factor}"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {key} must be {expected}")


def _validate_distillation(cfg: TrainConfig) -> None:
    """``distillation``: a teacher path when enabled, a registered loss mode, sane numbers (the
    vocab check needs the tokenizers: the trainer runs it when it loads the teacher)."""
    from agentloop_trainer.update.distill import DISTILLATION_LOSSES

    d = cfg.distillation
    loss = d.distillation_loss
    prefix = "distillation.distillation_loss."
    checks = [
        ("distillation.teacher_model.model_path", not d.enabled or bool(d.teacher_model.model_path),
         "set with distillation.enabled=true (a Hugging Face folder whose tokenizer is the student's)"),
        (prefix + "loss_mode", loss.loss_mode in DISTILLATION_LOSSES,
         f"one of {tuple(DISTILLATION_LOSSES.names())}, got {loss.loss_mode!r}"),
        (prefix + "use_policy_gradient", loss.use_policy_gradient is True,
         "true (agentloop feeds the teacher's per-token signal to the policy gradient as an advantage)"),
        (prefix + "distillation_loss_coef", math.isfinite(loss.distillation_loss_coef)
         and loss.distillation_loss_coef >= 0, f"a finite number >= 0, got {loss.distillation_loss_coef}"),
        (prefix + "loss_max_clamp", loss.loss_max_clamp is None or loss.loss_max_clamp > 0,
         f"null or > 0, got {loss.loss_max_clamp}"),
        (prefix + "log_prob_min_clamp", loss.log_prob_min_clamp is None or loss.log_prob_min_clamp < 0,
         f"null or < 0 (a log-prob floor), got {loss.log_prob_min_clamp}"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {key} must be {expected}")
