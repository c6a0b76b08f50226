"""The update's sections: ``actor_rollout_ref.actor`` and ``.ref`` (the trained policy's
optimisation, sharding and KL reference) and ``algorithm`` (advantage estimation, turn credit,
rollout correction), and their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agentloop_trainer.config_base import ConfigError, require
from agentloop_trainer.rollout.settings import FilterGroupsSection


@dataclass
class ActorFSDPSection:
    """FSDP2 settings of the policy and reference (verl: ``actor.fsdp_config``)."""

    param_offload: bool = False
    """Keep parameters, gradients and optimizer state in host memory between uses (FSDP2's
    ``CPUOffloadPolicy``, which offloads the three together; the optimizer step runs on the
    CPU). On one process the policy is then sharded over a one-rank group."""
    optimizer_offload: bool = False
    """Same switch as ``param_offload`` (FSDP2 offloads parameters and optimizer state together)."""
    offload_policy: bool = False
    """verl's FSDP2 spelling of the same switch."""


@dataclass
class PolicyLossSection:
    """Which policy loss (verl: ``actor.policy_loss``)."""

    loss_mode: str = "vanilla"
    """A name in the loss table (``update.losses.POLICY_LOSSES``; add one with
    ``register_policy_loss``): vanilla (PPO-clip on each token's ratio) | gspo (on its sequence's
    length-normalised ratio; use GSPO's small clip ranges, e.g. ``clip_ratio_low=0.0003
    clip_ratio_high=0.0004``, and ``loss_agg_mode=seq-mean-token-mean``, the paper's objective and
    what verl always uses for gspo)."""


@dataclass
class ActorSection:
    """GRPO actor (verl: ``actor_rollout_ref.actor``)."""

    lr: float = 1e-4
    """AdamW learning rate (verl: ``actor.optim.lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay (verl: ``actor.optim.weight_decay``)."""
    clip_ratio_low: float = 0.2
    """PPO ratio floor is 1 - this."""
    clip_ratio_high: float = 0.2
    """PPO ratio ceiling is 1 + this."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum. A trajectory split into segments
    counts once: token-mean weights each generated token once, the seq-mean modes take the
    whole trajectory as the sequence."""
    use_kl_loss: bool = False
    """Add a k3 KL term to a frozen reference policy."""
    kl_loss_coef: float = 0.001
    """Weight of the KL term."""
    tis_cap: float | None = 2.0
    """Cap of the rollout-vs-trainer importance weight per token; null disables it. The same as
    ``algorithm.rollout_correction.rollout_is=token`` with ``rollout_is_threshold`` = this cap; set
    it null to use ``rollout_is`` (token or sequence)."""
    policy_loss: PolicyLossSection = field(default_factory=lambda: PolicyLossSection())
    """The policy loss (``loss_mode``)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step, as in verl (each brings ``rollout.n`` samples; a mini-batch
    is that many rows, so trajectories split into segments take more steps); null: one update
    per batch."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Rows per forward/backward pass on each rank; gradients accumulate over a rank's
    micro-batches before the optimizer step (same result as one pass); null: a rank's whole
    share of the mini-batch in one pass."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget (``ppo_max_token_len_per_gpu``) instead of row count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch with ``use_dynamic_bsz`` (or with ``use_remove_padding`` and
    no ``ppo_micro_batch_size_per_gpu``), counted as the forward pays it: rows x longest row when
    padded, the sum of the rows' tokens when packed (a longer row still gets a micro-batch of its
    own)."""
    use_remove_padding: bool = True
    """Padding-free updates (verl: ``actor_rollout_ref.model.use_remove_padding``): each
    micro-batch of a text model runs as one packed row, its sequences concatenated with position
    ids restarting at 0 and attention kept within each sequence, in the log-prob passes (old and
    reference) and the update. Vision-language models always run padded. False: pad every
    micro-batch to its longest row (and share the rows' common prompt prefix instead)."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Rows per no-grad pass when recomputing old and reference log-probs; null: as
    ``ppo_micro_batch_size_per_gpu`` (and ``use_dynamic_bsz``)."""
    fsdp_config: ActorFSDPSection = field(default_factory=lambda: ActorFSDPSection())
    """Sharding and offload of the policy and the reference."""


@dataclass
class RefFSDPSection:
    """FSDP2 settings of the reference policy (verl: ``ref.fsdp_config``)."""

    param_offload: bool = False
    """Keep the reference's shards in host memory (also on when the actor offloads)."""


@dataclass
class RefSection:
    """The frozen reference policy of the KL loss (verl: ``actor_rollout_ref.ref``). With LoRA
    there is none: the reference is the policy with its adapters disabled."""

    fsdp_config: RefFSDPSection = field(default_factory=RefFSDPSection)
    """Sharding and offload of the reference."""



@dataclass
class RolloutCorrectionSection:
    """Importance weights and rejection for the engine-vs-trainer log-prob gap (verl:
    ``algorithm.rollout_correction``; see :mod:`agentloop_trainer.update.rollout_correction`).
    ``actor.tis_cap`` is the same correction as ``rollout_is=token`` with a cap: set one of the
    two (``actor.tis_cap=null`` with ``rollout_is``)."""

    rollout_is: str | None = None
    """null (no weights) | token (each token by its ratio old/rollout) | sequence (every token of
    a sequence by the product of its ratios; a trajectory split into segments is one sequence)."""
    rollout_is_threshold: Any = 2.0
    """A cap on the weight (truncated IS), or ``"lower_upper"`` (e.g. ``"0.5_2.0"``: IcePop, a
    weight outside the bounds becomes 0). Write both bounds with a decimal point: YAML reads
    ``0.5_2`` as the number 0.52."""
    rollout_rs: str | None = None
    """null | rejection options, comma-separated, all must pass: token_k1, token_k2, token_k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1: geometric mean), seq_max_k2/k3. A
    rejected token or sequence leaves the loss and its normaliser."""
    rollout_rs_threshold: Any = None
    """Bounds of ``rollout_rs``, one for all options or one per option (comma-separated): k1 takes
    ratio bounds ``"lower_upper"`` on pi_rollout/pi_old (``u`` alone: ``1/u`` to ``u``), k2 and k3
    an upper bound on the divergence."""


@dataclass
class AlgorithmSection:
    """Advantage estimation and rollout correction (verl: ``algorithm``)."""

    adv_estimator: str = "grpo"
    """A name in the estimator table (``update.advantages.ADVANTAGE_ESTIMATORS``; add one with
    ``register_advantage_estimator``): grpo (mean/std per group) | dr_grpo (mean only) | rloo (each
    reward minus the mean of the group's other rewards; needs rollout.n >= 2) | gae (PPO: GAE over
    the model's tokens with a value model trained beside the policy; needs critic.optim.lr, see
    the ``critic`` section and docs/ppo.md)."""
    turn_credit: str = "trajectory"
    """How a multi-turn trajectory's credit is split over its turns (a turn: one run of model
    tokens): trajectory (one advantage per trajectory, on every token) | discounted (turn t's
    return G_t = r_t + turn_gamma * G_{t+1} minus the mean episode return of the group's other
    trajectories) | turn_group (MT-GRPO: minus the mean return at turn t of the other
    trajectories that reached it) | step_group (GiGPO: the trajectory advantage plus
    step_group_weight x G_t minus the mean return of the other trajectories' turns that saw the
    identical token prefix). Per-turn rewards come from the loop (``extra_fields["turn_rewards"]``:
    env step rewards, tool rewards, interaction turn scores) or the reward function; the rest of
    the reward goes to the last turn. Baselines are leave-one-out; adv_estimator=grpo divides by
    the std. Needs rollout.n >= 2 unless trajectory. See docs/beyond-grpo.md."""
    turn_gamma: float = 1.0
    """Discount from one turn to the next in the per-turn returns (0 to 1; 1: every turn's return
    is the reward still to come)."""
    step_group_weight: float = 1.0
    """w in step_group's A = A_trajectory + w x A_step (GiGPO uses 1); >= 0."""
    gamma: float = 1.0
    """GAE's discount per model token (``adv_estimator=gae``; 0 to 1; verl's default 1)."""
    lam: float = 1.0
    """GAE's lambda (``adv_estimator=gae``; 0 to 1; 1: Monte-Carlo returns minus values)."""
    mask_truncated: bool = False
    """Leave trajectories cut short out of the policy loss (TRL: ``mask_truncated_completions``;
    DAPO's over-long filtering): a trajectory one of whose turns stopped on a length limit (the
    per-turn cap, the engine's context, the response budget) or that padding cut gets an
    all-zero loss mask; its reward still counts in its group's baseline and in the metrics
    (``rollout/truncated/*`` count what each limit cut). For a model that sometimes runs on past
    its answer: without it, a right answer followed by a runaway turn is reinforced whole."""
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)
    """Dynamic sampling (DAPO): drop groups whose samples all score the same."""
    rollout_correction: RolloutCorrectionSection = field(default_factory=RolloutCorrectionSection)
    """Importance weights / rejection for the rollout-vs-trainer mismatch (beside ``actor.tis_cap``)."""



def offload_enabled(actor: ActorSection) -> bool:
    """Whether the policy is offloaded: any of the actor's ``fsdp_config`` switches."""
    f = actor.fsdp_config
    return bool(f.param_offload or f.optimizer_offload or f.offload_policy)


def reference_offloaded(actor: ActorSection, ref: RefSection, lora_rank: int) -> bool:
    """Whether a separate reference policy is loaded, and offloaded (``ref.fsdp_config.param_offload``
    or the actor's offload): KL on, no LoRA (``lora_rank``: ``model.lora_rank``)."""
    needed = actor.use_kl_loss and lora_rank == 0
    return bool(needed and (ref.fsdp_config.param_offload or offload_enabled(actor)))


def check(actor: ActorSection, algorithm: AlgorithmSection, *, rollout_n: int, train_batch_size: int) -> None:
    """Range and choice checks of ``actor_rollout_ref.actor`` and ``algorithm`` against the update's
    tables (estimators, policy losses, turn credit, rollout correction), given ``rollout.n`` and
    ``data.train_batch_size``. The critic's keys are checked by :func:`critic_checks`'s caller.

    Raises:
        ConfigError: naming the key and what it must be.
    """
    from agentloop_trainer.update.advantages import ADVANTAGE_ESTIMATORS
    from agentloop_trainer.update.losses import LOSS_AGG_MODES, POLICY_LOSSES
    from agentloop_trainer.update.turn_credit import TURN_CREDIT_MODES

    a, alg = actor, algorithm
    estimator = ADVANTAGE_ESTIMATORS.find(alg.adv_estimator)
    require([
        ("algorithm.adv_estimator", estimator is not None, f"one of {tuple(ADVANTAGE_ESTIMATORS.names())} "
         "(or one registered with agentloop_trainer.update.advantages.register_advantage_estimator)"),
        ("actor_rollout_ref.actor.loss_agg_mode", a.loss_agg_mode in LOSS_AGG_MODES, f"one of {LOSS_AGG_MODES}"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", a.policy_loss.loss_mode in POLICY_LOSSES,
         f"one of {tuple(POLICY_LOSSES.names())}"),
        ("actor_rollout_ref.rollout.n", estimator is None or rollout_n >= estimator.min_group_size,
         f"at least {estimator.min_group_size if estimator else 1} with algorithm.adv_estimator="
         f"{alg.adv_estimator} ({estimator.why if estimator else ''})"),
        ("algorithm.turn_credit", alg.turn_credit in TURN_CREDIT_MODES, f"one of {TURN_CREDIT_MODES}"),
        ("algorithm.turn_gamma", 0.0 <= alg.turn_gamma <= 1.0, "between 0 and 1 (the per-turn discount)"),
        ("algorithm.step_group_weight", math.isfinite(alg.step_group_weight) and alg.step_group_weight >= 0,
         "a finite number >= 0"),
        ("actor_rollout_ref.rollout.n", alg.turn_credit == "trajectory" or rollout_n >= 2,
         f"at least 2 with algorithm.turn_credit={alg.turn_credit} (each turn's baseline is the mean "
         "over the group's other trajectories)"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size",
         a.ppo_mini_batch_size is None or 1 <= a.ppo_mini_batch_size <= train_batch_size,
         "null or between 1 and data.train_batch_size (it counts prompts, as in verl)"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
         a.ppo_micro_batch_size_per_gpu is None or a.ppo_micro_batch_size_per_gpu >= 1, "null or at least 1"),
        ("actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
         a.log_prob_micro_batch_size_per_gpu is None or a.log_prob_micro_batch_size_per_gpu >= 1,
         "null or at least 1"),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu >= 2, "at least 2"),
    ])
    _check_rollout_correction(alg.rollout_correction, a.tis_cap)


def needs_critic(algorithm: AlgorithmSection) -> bool:
    """Whether ``algorithm.adv_estimator`` trains a value model (an unknown one: no)."""
    from agentloop_trainer.update.advantages import ADVANTAGE_ESTIMATORS

    estimator = ADVANTAGE_ESTIMATORS.find(algorithm.adv_estimator)
    return estimator is not None and estimator.needs_critic


def _check_rollout_correction(rc: RolloutCorrectionSection, tis_cap: float | None) -> None:
    """``algorithm.rollout_correction``: levels, options and thresholds parse, and it does not
    contradict ``actor.tis_cap`` (two importance weights on one loss)."""
    from agentloop_trainer.update.rollout_correction import (
        IMPORTANCE_LEVELS,
        parse_is_threshold,
        parse_rs_options,
        parse_rs_thresholds,
    )

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
