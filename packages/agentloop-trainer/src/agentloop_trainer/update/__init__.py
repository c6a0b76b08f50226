"""The update: what changes the policy's weights, and how they leave the trainer.

- :mod:`~agentloop_trainer.update.advantages`: the advantage-estimator table (GRPO, Dr. GRPO, RLOO;
  ``algorithm.adv_estimator``).
- :mod:`~agentloop_trainer.update.losses`: the policy-loss table (PPO-clip on token or GSPO sequence ratios), its
  aggregation, KL, the per-token importance weight (change the loss here).
- :mod:`~agentloop_trainer.update.rollout_correction`: token / sequence importance weights and
  rejection masks (``algorithm.rollout_correction``), their tables.
- :mod:`~agentloop_trainer.update.tables`: the name -> record table the three use.
- :mod:`~agentloop_trainer.update.actor`: :class:`PolicyGradientActor`, log-probs of a batch and the
  optimizer steps over its micro-batches.
- :mod:`~agentloop_trainer.update.forward`: per-token log-probs, a shared prompt prefix computed once.
- :mod:`~agentloop_trainer.update.fsdp`: FSDP2 sharding and process groups.
- :mod:`~agentloop_trainer.update.ray_ranks`: FSDP ranks as Ray actors.
- :mod:`~agentloop_trainer.update.weights`: the policy's weights streamed in buckets (LoRA merged).

Importing this package is light: torch and Ray are imported by the functions that use them.
"""

from agentloop_trainer.update.actor import (
    ActorConfig,
    PolicyBatch,
    PolicyGradientActor,
    micro_batches,
    policy_batch_from_rollout,
    response_log_probs,
)
from agentloop_trainer.update.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    group_advantages,
    leave_one_out_advantages,
    register_advantage_estimator,
    trajectory_advantages,
)
from agentloop_trainer.update.forward import (
    MIN_SHARED_PREFIX,
    common_prefix_length,
    prompt_groups,
    prompt_shared_log_probs,
    sequence_log_probs,
)
from agentloop_trainer.update.fsdp import (
    broadcast_object,
    free_port,
    full_model_state,
    full_train_state,
    init_process_group,
    is_sharded,
    load_full_train_state,
    load_reference,
    shard_policy,
    spawn,
)
from agentloop_trainer.update.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossAggMode,
    PolicyLoss,
    PolicyTerms,
    aggregate_loss,
    gspo_log_ratio,
    kl_k3,
    masked_mean,
    ppo_clip_loss,
    register_policy_loss,
    sequence_weights,
    truncated_importance_weight,
)
from agentloop_trainer.update.ray_ranks import RankFailedError, RayRankActor, spawn_ray
from agentloop_trainer.update.rollout_correction import (
    IMPORTANCE_LEVELS,
    REJECTION_OPTIONS,
    Correction,
    ImportanceLevel,
    RejectionOption,
    rollout_correction,
)
from agentloop_trainer.update.tables import AlgorithmTable, UnknownAlgorithmError
from agentloop_trainer.update.turn_credit import (
    TURN_CREDIT,
    TURN_CREDIT_MODES,
    CreditSettings,
    credit_advantages,
    discounted_returns,
    per_turn_advantages,
    token_advantages,
)
from agentloop_trainer.update.turns import Trajectory, TurnSpan, batch_trajectories, mask_runs, turn_rewards
from agentloop_trainer.update.weights import (
    DEFAULT_BUCKET_BYTES,
    base_model_config,
    hf_name,
    iter_policy_weights,
    layer_group,
    policy_state_dict,
    tied_output_name,
    unwrap_policy,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ActorConfig",
    "AdvantageEstimator",
    "AlgorithmTable",
    "Correction",
    "CreditSettings",
    "DEFAULT_BUCKET_BYTES",
    "LOSS_AGG_MODES",
    "LossAggMode",
    "MIN_SHARED_PREFIX",
    "IMPORTANCE_LEVELS",
    "ImportanceLevel",
    "POLICY_LOSSES",
    "PolicyBatch",
    "PolicyGradientActor",
    "PolicyLoss",
    "PolicyTerms",
    "REJECTION_OPTIONS",
    "RejectionOption",
    "RankFailedError",
    "RayRankActor",
    "TURN_CREDIT",
    "TURN_CREDIT_MODES",
    "Trajectory",
    "TurnSpan",
    "UnknownAlgorithmError",
    "aggregate_loss",
    "base_model_config",
    "batch_trajectories",
    "broadcast_object",
    "common_prefix_length",
    "compute_advantages",
    "credit_advantages",
    "discounted_returns",
    "free_port",
    "full_model_state",
    "full_train_state",
    "group_advantages",
    "gspo_log_ratio",
    "hf_name",
    "init_process_group",
    "is_sharded",
    "iter_policy_weights",
    "kl_k3",
    "layer_group",
    "leave_one_out_advantages",
    "load_full_train_state",
    "load_reference",
    "mask_runs",
    "masked_mean",
    "micro_batches",
    "per_turn_advantages",
    "policy_batch_from_rollout",
    "policy_state_dict",
    "ppo_clip_loss",
    "prompt_groups",
    "prompt_shared_log_probs",
    "register_advantage_estimator",
    "register_policy_loss",
    "response_log_probs",
    "rollout_correction",
    "sequence_log_probs",
    "sequence_weights",
    "shard_policy",
    "spawn",
    "spawn_ray",
    "tied_output_name",
    "token_advantages",
    "trajectory_advantages",
    "truncated_importance_weight",
    "turn_rewards",
    "unwrap_policy",
]
