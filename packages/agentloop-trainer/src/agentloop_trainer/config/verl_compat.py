"""verl's config spellings, read as agentloop's with a one-line notice each.

A config copied from verl should either mean the same thing here or fail with the reason: a
key is renamed (:data:`RENAMED`), accepted because agentloop always behaves that way or the
setting only tunes memory and speed (:data:`NO_EFFECT`), accepted only at the value that
matches agentloop's behaviour (:data:`ONLY_VALUE`), or unknown (the usual did-you-mean error).
A Hydra config file of verl's names verl's base config in its ``defaults:`` list
(:data:`VERL_BASE_CONFIGS`); a tool config names verl's tool classes (:data:`VERL_TOOL_CLASSES`,
kept with the tool loader in :mod:`agentloop_tools.verl_tools`).

These tables are the one place the translation lives: the loader reads them, and the migration
guide (``docs/migrate-from-verl.md``, written by ``tools/docs/verl_migration.py``) is generated
from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentloop_tools.verl_tools import VERL_TOOL_CLASSES, VerlTool

__all__ = [
    "HYDRA_SECTIONS", "NO_EFFECT", "ONLY_VALUE", "REASONS", "RENAMED", "SPLIT", "VERL_BASE_CONFIGS",
    "VERL_TOOL_CLASSES", "Reading", "VerlTool", "is_no_effect", "read_key", "translate",
]

RENAMED: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.tokenizer_path": "model.tokenizer_path",
    "actor_rollout_ref.model.custom_chat_template": "model.custom_chat_template",
    "actor_rollout_ref.model.dtype": "model.dtype",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "model.lora_rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora_alpha",
    "actor_rollout_ref.model.target_modules": "model.target_modules",
    "actor_rollout_ref.model.use_remove_padding": "actor_rollout_ref.actor.use_remove_padding",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.run_dir",
    "actor_rollout_ref.actor.optim.lr": "actor_rollout_ref.actor.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor_rollout_ref.actor.weight_decay",
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": "actor_rollout_ref.rollout.sanity_check",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.multi_turn.max_turns": "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    "actor_rollout_ref.rollout.multi_turn.format": "actor_rollout_ref.rollout.multi_turn.tool_parser",
    # verl names each teacher; its examples name the one teacher "teacher_model".
    "distillation.teacher_models.teacher_model.model_path": "distillation.teacher_model.model_path",
}
"""verl key -> agentloop key (same meaning)."""

SPLIT: dict[str, tuple[str, ...]] = {
    "actor_rollout_ref.actor.clip_ratio": ("actor_rollout_ref.actor.clip_ratio_low",
                                           "actor_rollout_ref.actor.clip_ratio_high"),
}
"""verl key -> several agentloop keys that all take its value."""

NO_EFFECT: tuple[str, ...] = (
    "actor_rollout_ref.actor.fsdp_config.", "actor_rollout_ref.ref.", "actor_rollout_ref.actor.checkpoint.",
    "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "actor_rollout_ref.actor.optim.lr_warmup_init", "actor_rollout_ref.actor.optim.warmup_style",
    "actor_rollout_ref.actor.optim.min_lr_ratio", "actor_rollout_ref.actor.optim.total_training_steps",
    "critic.strategy", "critic.model.fsdp_config.", "critic.model.use_remove_padding", "critic.model.tokenizer_path",
    "critic.model.override_config", "critic.model.external_lib", "critic.model.trust_remote_code",
    "critic.model.enable_gradient_checkpointing", "critic.optim.lr_warmup_steps_ratio", "critic.optim.lr_warmup_steps",
    "critic.optim.min_lr_ratio", "critic.optim.warmup_style", "critic.optim.total_training_steps",
    "critic.ulysses_sequence_parallel_size", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu", "critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size", "critic.shuffle", "critic.checkpoint.", "critic.rollout_n", "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.log_val_generations",
    "data.return_raw_chat", "data.truncation", "data.prompt_key", "data.reward_fn_key", "data.tokenizer",
    "data.return_full_prompt", "data.val_batch_size", "data.custom_cls.", "data.dataloader_num_workers",
    "actor_rollout_ref.model.external_lib", "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.model.trust_remote_code", "actor_rollout_ref.model.use_fused_kernels",
    "actor_rollout_ref.model.enable_activation_offload", "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.use_torch_compile", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.max_num_seqs", "actor_rollout_ref.rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.layered_summon",
    "actor_rollout_ref.rollout.calculate_log_probs", "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
    "reward_model.enable", "reward_model.reward_manager", "reward_model.launch_reward_fn_async",
    "trainer.balance_batch", "trainer.project_name_suffix", "trainer.val_only", "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep", "trainer.resume_mode", "trainer.del_local_ckpt_after_load", "ray_init.",
    "trainer.total_epochs", "reward_model.overlong_buffer.log", "actor_rollout_ref.rollout.trace.experiment_name",
    "distillation.n_gpus_per_node", "distillation.nnodes", "distillation.teacher_key",
    "distillation.teacher_model.inference.", "distillation.teacher_model.num_replicas",
    "distillation.teacher_models.teacher_model.inference.", "distillation.teacher_models.teacher_model.num_replicas",
    "distillation.teacher_models.teacher_model.key", "distillation.distillation_loss.topk",
)
"""Keys accepted and ignored: memory/speed knobs (agentloop sizes these itself), logging and
layout settings with an agentloop counterpart, or things agentloop always does. An entry that
ends with ``.`` is a whole verl section (every key under it); any other entry is one exact key,
so a misspelt key (``ppo_micro_batch_size_per_gpuu``) is an unknown-key error, not ignored."""


def is_no_effect(key: str) -> bool:
    """Whether ``key`` is one of :data:`NO_EFFECT` (exactly, or under one of its sections)."""
    return key in _NO_EFFECT_KEYS or key.startswith(_NO_EFFECT_SECTIONS)

_NO_EFFECT_SECTIONS = tuple(k for k in NO_EFFECT if k.endswith("."))
_NO_EFFECT_KEYS = frozenset(k for k in NO_EFFECT if not k.endswith("."))

REASONS: dict[str, str] = {
    "trainer.total_epochs": "the run length is trainer.total_training_steps / trainer.total_steps",
    "trainer.n_gpus_per_node": "set trainer.fsdp_ranks, ray.rank_num_gpus and ray.replica_num_gpus",
    "trainer.nnodes": "set ray.address to run on a cluster",
    "actor_rollout_ref.actor.fsdp_config.param_dtype": "the policy's dtype is model.dtype",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "the policy's dtype is model.dtype",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "log-prob passes follow actor.use_dynamic_bsz",
    "reward_model.overlong_buffer.log": "the over-long metrics (reward/overlong_*) are always logged",
    "actor_rollout_ref.rollout.trace.experiment_name": "each trace is tagged with its step, sample_index and "
                                                       "rollout_n, in the experiment trace.project_name",
}
"""Why a key is ignored, where the generic reason would mislead."""

ONLY_VALUE: dict[str, tuple[tuple[Any, ...], str]] = {
    "actor_rollout_ref.rollout.mode": (("async",), "agentloop's rollout is always asynchronous"),
    "actor_rollout_ref.actor.kl_loss_type": (("low_var_kl", "k3"), "agentloop's KL loss is the k3 (low_var_kl) estimator"),
    "actor_rollout_ref.actor.entropy_coeff": ((0, 0.0), "agentloop has no entropy bonus"),
    "algorithm.use_kl_in_reward": ((False,), "agentloop puts the KL in the loss (actor.use_kl_loss), not the reward"),
    "algorithm.norm_adv_by_std_in_grpo": ((True,), "use algorithm.adv_estimator=dr_grpo for mean-only advantages"),
    "actor_rollout_ref.rollout.multi_turn.enable": ((True,), "agentloop's loops are multi-turn"),
    "critic.loss_agg_mode": (("token-mean",), "the value loss is a mean over the mini-batch's model tokens"),
    "algorithm.rollout_correction.bypass_mode": (
        (False,), "agentloop recomputes the old log-probs (decoupled mode); the correction weighs old against rollout"),
    "algorithm.rollout_correction.loss_type": (("ppo_clip",), "the policy loss is PPO-clip (bypass_mode is off)"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": ((False,), "the weights are used as computed"),
    "algorithm.rollout_correction.debug_rollout_actor_probs": ((False,), "a bypass-mode diagnostic; no bypass mode"),
}
"""Keys accepted at the values that match agentloop, with why other values are not."""


VERL_BASE_CONFIGS: dict[str, str | None] = {
    "ppo_trainer": None,
    "ppo_megatron_trainer": "agentloop trains with FSDP2, not Megatron: name ppo_trainer and drop the megatron keys",
}
"""verl's base configs a Hydra ``defaults:`` list may name -> None where agentloop's defaults
stand in for it (with a notice), else why not (an error)."""

HYDRA_SECTIONS: dict[str, str] = {
    "hydra": "Hydra's own settings (search path, run folder); agentloop reads the file directly",
}
"""Top-level sections of a verl config file that configure Hydra, not the run: ignored, with why."""

DEFAULT_REASON = "agentloop sizes memory and speed itself, or always behaves this way"
"""Why a :data:`NO_EFFECT` key is ignored, where :data:`REASONS` says nothing more specific."""


@dataclass(frozen=True)
class Reading:
    """How the loader reads one verl ``key=value``."""

    kind: str
    """same (the key is agentloop's too) | renamed | split | only_value (accepted, no effect) |
    ignored | unknown (not verl's either: the loader's did-you-mean error)."""
    keys: tuple[str, ...] = ()
    """The agentloop keys it sets."""
    why: str = ""
    """Why it is ignored or accepted only at this value."""

    def notice(self, key: str, value: Any) -> str | None:
        """The one-line notice the loader prints for it (None for a key read as it is)."""
        if self.kind in ("renamed", "split"):
            return f"verl key {key} read as {' and '.join(self.keys)}"
        if self.kind == "only_value":
            return f"verl key {key}={value!r} matches agentloop's behaviour; ignored"
        if self.kind == "ignored":
            return f"verl key {key} ignored ({self.why})"
        return None


def read_key(key: str, value: Any, valid: set[str] | frozenset[str]) -> Reading:
    """How ``key=value`` is read, ``valid`` being agentloop's own keys.

    Raises:
        ValueError: a key of :data:`ONLY_VALUE` has a value agentloop cannot honour.
    """
    if key in valid:
        return Reading("same", (key,))
    if key in RENAMED:
        return Reading("renamed", (RENAMED[key],))
    if key in SPLIT:
        return Reading("split", SPLIT[key])
    if key in ONLY_VALUE:
        allowed, why = ONLY_VALUE[key]
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not supported: {why}")
        return Reading("only_value", why=why)
    if is_no_effect(key):
        return Reading("ignored", why=REASONS.get(key, DEFAULT_REASON))
    return Reading("unknown", (key,))


def translate(flat: dict[str, Any], valid: set[str], notice: Callable[[str], None]) -> dict[str, Any]:
    """Rewrite verl spellings in ``flat`` (dotted key -> value) to agentloop's.

    Keys agentloop already knows pass through unchanged, so a key both tools spell the same way
    (``data.train_batch_size``) needs no entry here; unknown keys pass through too, for the
    loader's did-you-mean error.

    Raises:
        ValueError: a key of :data:`ONLY_VALUE` has a value agentloop cannot honour.
    """
    out: dict[str, Any] = {}
    for key, value in flat.items():
        reading = read_key(key, value, valid)
        line = reading.notice(key, value)
        if line is not None:
            notice(line)
        out.update(dict.fromkeys(reading.keys, value))
    return out
