"""The policy-gradient actor: recomputes log-probs of a rollout batch and takes PPO-clip updates.

It works on a plain module or an FSDP2-sharded one (``fully_shard``) through the same code:
sharding changes where parameters live, not what the loss is. The batch record is in
:mod:`~agentloop_trainer.update.policy_batch`, its forward passes and micro-batches in
:mod:`~agentloop_trainer.update.log_probs` (both re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentloop_trainer.update.forward import MIN_SHARED_PREFIX, common_prefix_length, prompt_groups
from agentloop_trainer.update.log_probs import micro_batches, response_log_probs
from agentloop_trainer.update.losses import (
    kl_k3,
    masked_mean,
    ppo_clip_loss,
    sequence_weights,
    truncated_importance_weight,
)
from agentloop_trainer.update.packing import packed_micro_batches, packing_pays, packs
from agentloop_trainer.update.policy_batch import PolicyBatch, policy_batch_from_rollout
from agentloop_trainer.update.rollout_correction import rollout_correction
from agentloop_trainer.update.settings import ActorSection, RolloutCorrectionSection
from agentloop_trainer.update.step_prefix import StepPrefix
from agentloop_trainer.update.tail_buckets import shared_prompt_micro_batches

__all__ = ["ActorConfig", "PolicyBatch", "PolicyGradientActor", "micro_batches", "policy_batch_from_rollout",
           "response_log_probs"]


@dataclass
class ActorConfig(ActorSection):
    """Optimisation settings of the policy-gradient actor: the config's ``actor_rollout_ref.actor``
    section (see :class:`~agentloop_trainer.update.settings.ActorSection` for its fields) plus what the
    actor takes from elsewhere."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    temperature: float = 1.0
    """Sampling temperature (``rollout.temperature``); log-probs are of ``logits / temperature``."""
    rollout_n: int = 1
    """Samples per prompt (``rollout.n``): ``ppo_mini_batch_size`` counts prompts, as in verl."""
    compute_dtype: str | None = None
    """Run forward passes under ``torch.autocast`` in this dtype (``model.dtype=bfloat16`` on one
    process; under FSDP2 the sharding's mixed-precision policy casts instead); None: no autocast."""
    share_prefix_with_grad: bool = True
    """Compute the rows' common prefix once in the gradient pass; off with gradient checkpointing
    (a checkpointed layer cannot keep the prefix's key/value cache)."""
    rollout_correction: RolloutCorrectionSection = field(default_factory=RolloutCorrectionSection)
    """``algorithm.rollout_correction``: importance weights and rejection against the engine's
    log-probs (instead of ``tis_cap``'s per-token weight, or with it for rejection only)."""

    @property
    def corrects_rollout(self) -> bool:
        """Whether ``rollout_correction`` weights or masks anything."""
        rc = self.rollout_correction
        return rc.rollout_is is not None or rc.rollout_rs is not None

    def mini_batch_samples(self, batch_samples: int) -> int:
        """Rows per optimizer step for a batch of ``batch_samples`` rows:
        ``ppo_mini_batch_size * rollout_n``. A row is a sample, or one segment of a sample whose
        loop split it, so a batch of split trajectories takes more optimizer steps."""
        if self.ppo_mini_batch_size is None:
            return batch_samples
        return min(batch_samples, self.ppo_mini_batch_size * self.rollout_n)


class PolicyGradientActor:
    """Owns the policy and its optimizer; its loss is a name in the policy-loss table.

    Args:
        model: The policy module (already sharded when running under FSDP2; possibly a peft
            model, whose adapters are then the only trained weights).
        config: Optimisation settings.
        ref_model: Frozen reference policy for the KL loss. None with ``use_kl_loss`` on a peft
            policy: the reference is the policy with its adapters disabled (no second copy).
        device: Where forward inputs go; None: the device of the model's first parameter (pass
            it when parameters are offloaded to the host).
    """

    def __init__(self, model: Any, config: ActorConfig, ref_model: Any = None, device: Any = None) -> None:
        import torch

        self.adapter_reference = ref_model is None and config.use_kl_loss and hasattr(model, "disable_adapter")
        if config.use_kl_loss and ref_model is None and not self.adapter_reference:
            raise ValueError("use_kl_loss=True needs a reference model; pass ref_model= or set use_kl_loss=False")
        if config.tis_cap is not None and config.rollout_correction.rollout_is is not None:
            raise ValueError("tis_cap and rollout_correction.rollout_is both weight the loss; set tis_cap=None to use "
                             "rollout_is (rollout_is='token' with rollout_is_threshold=cap is tis_cap's weight)")
        self.model = model
        self.config = config
        self.ref_model = ref_model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the policy has no trainable parameters (all have requires_grad=False); with LoRA, "
                             "check model.target_modules names modules the model has")
        beta1, beta2 = config.betas  # a list when it comes from the YAML config
        self.optimizer = torch.optim.AdamW(
            trainable, lr=config.lr, betas=(beta1, beta2), weight_decay=config.weight_decay
        )
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.distributed = distributed
        self.packed = config.use_remove_padding and packs(model)
        """Whether micro-batches may run as packed rows (``use_remove_padding`` on a text model);
        each pass then packs unless sharing its prompts computes fewer tokens (:meth:`_packs`)."""

    @property
    def has_reference(self) -> bool:
        """Whether reference log-probs are computed (``use_kl_loss``)."""
        return self.ref_model is not None or self.adapter_reference

    def local_rows(self, rows: Sequence[int]) -> list[int]:
        """This rank's share of ``rows`` (data parallel: contiguous, equal slices).

        Raises:
            ValueError: when the rows do not split evenly over the ranks (FSDP ranks must run
                the same number of forward passes).
        """
        rows = list(rows)
        if len(rows) % self.world_size:
            raise ValueError(
                f"{len(rows)} samples do not split evenly over {self.world_size} FSDP ranks; make "
                "data.train_batch_size * rollout.n (and ppo_mini_batch_size) a multiple of trainer.fsdp_ranks"
            )
        k = len(rows) // self.world_size
        return rows[self.rank * k : (self.rank + 1) * k]

    def _all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def _shares_prefix(self, grad: bool) -> bool:
        """Whether a pass keeps the shared prefix's cache: always without gradients; with them
        unless ``share_prefix_with_grad`` is off (gradient checkpointing)."""
        return self.config.share_prefix_with_grad or not grad

    def _packs(self, pb: PolicyBatch, rows: list[int], grad: bool) -> bool:
        """Whether a pass over ``rows`` runs packed: ``use_remove_padding`` on a text model,
        except on one process when the rows repeat prompts (a GRPO group) and running each
        distinct prompt once, padded, computes fewer tokens than packing every row whole
        (:func:`~agentloop_trainer.update.packing.packing_pays`)."""
        share = self.world_size == 1 and self._shares_prefix(grad)
        return self.packed and (not share or packing_pays(pb.sequences, pb.prompt_lengths, rows))

    def _micro(self, pb: PolicyBatch, rows: list[int], size: int | None, packed: bool, grad: bool) -> list[list[int]]:
        """This rank's micro-batches of ``rows``, padded with empty ones to the most any rank
        has (FSDP ranks must make the same number of passes). Packed, a micro-batch with no row
        count set is a row of at most ``ppo_max_token_len_per_gpu`` tokens (sum, not padded);
        prompt-shared and padded, it is cut where long tails would pad the rest
        (:func:`~agentloop_trainer.update.tail_buckets.shared_prompt_micro_batches`)."""
        import torch

        cfg = self.config
        lengths = [len(s) for s in pb.sequences]
        share = self.world_size == 1 and self._shares_prefix(grad)
        if packed and (cfg.use_dynamic_bsz or size is None):
            parts = packed_micro_batches(rows, lengths, cfg.ppo_max_token_len_per_gpu)
        elif (share and size is None and not cfg.use_dynamic_bsz
              and prompt_groups([pb.sequences[r] for r in rows], [pb.prompt_lengths[r] for r in rows]) is not None):
            parts = shared_prompt_micro_batches(pb.sequences, pb.prompt_lengths, rows)
        else:
            parts = micro_batches(rows, lengths, size, cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None)
        if self.world_size > 1:
            most = int(self._all_reduce(torch.tensor([len(parts)]), "max")[0])
            parts += [[] for _ in range(most - len(parts))]
        return parts

    def _cast(self) -> Any:
        """``torch.autocast`` in ``compute_dtype``, or a context that does nothing."""
        import contextlib

        import torch

        dtype = self.config.compute_dtype
        return (torch.autocast(self.device.type, dtype=getattr(torch, dtype))
                if dtype and dtype != "float32" else contextlib.nullcontext())

    def _step_prefix(self, model: Any, pb: PolicyBatch, rows: list[int], parts: list[list[int]], grad: bool,
                     packed: bool) -> StepPrefix | None:
        """The prompt prefix all ``rows`` share (system turn, tool schemas), run once for all
        their micro-batches (:class:`~agentloop_trainer.update.step_prefix.StepPrefix`); None on
        FSDP (ranks must make the same calls), packed or image passes, one micro-batch, no
        sharing, or a prefix under ``MIN_SHARED_PREFIX`` tokens."""
        if (self.distributed or packed or len(parts) < 2 or not self._shares_prefix(grad)
                or (pb.images is not None and any(pb.images[r] for r in rows))):
            return None
        if any(len(pb.sequences[r]) < 2 for r in rows):  # a failed sample runs as a stand-in row
            return None
        # Two prompt tokens of each row stay outside: the distinct prompt's own pass needs one,
        # and the last prompt token's logit scores the response.
        length = min(common_prefix_length([pb.sequences[r] for r in rows]),
                     min(pb.prompt_lengths[r] for r in rows) - 2)
        if length < MIN_SHARED_PREFIX:
            return None
        with self._cast():
            return StepPrefix.build(model, pb.sequences[rows[0]][:length], device=self.device)

    def _forward(self, model: Any, pb: PolicyBatch, rows: list[int], grad: bool, packed: bool,
                 prefix: StepPrefix | None = None) -> Any:
        """Response log-probs of ``rows`` (an empty micro-batch runs a stand-in row whose result
        is discarded, so every rank makes the same collective calls)."""
        with self._cast():
            return response_log_probs(model, pb, self.config.temperature, rows or [0],
                                      share_prefix=self._shares_prefix(grad), device=self.device,
                                      share_prompts=self.world_size == 1, packed=packed, prefix=prefix)

    def compute_log_probs(self, pb: PolicyBatch, model: Any = None) -> Any:
        """Log-probs of the batch's responses under the current (or given) model, no grad,
        in micro-batches of ``log_prob_micro_batch_size_per_gpu`` rows."""
        import torch

        model = model or self.model
        cfg = self.config
        was_training = model.training
        model.eval()
        rows = self.local_rows(range(len(pb.sequences)))
        full = torch.zeros(pb.response_mask.shape, dtype=torch.float32, device=self.device)
        size = cfg.log_prob_micro_batch_size_per_gpu or cfg.ppo_micro_batch_size_per_gpu
        with torch.no_grad():
            packed = self._packs(pb, rows, grad=False)
            parts = self._micro(pb, rows, size, packed, grad=False)
            prefix = self._step_prefix(model, pb, rows, parts, grad=False, packed=packed)
            for part in parts:
                logp = self._forward(model, pb, part, grad=False, packed=packed, prefix=prefix)
                if part:
                    full[part] = logp.to(full.dtype)
        model.train(was_training)
        return self._all_reduce(full) if self.world_size > 1 else full

    def reference_log_probs(self, pb: PolicyBatch) -> Any:
        """Log-probs under the reference: the frozen copy, or the policy with its LoRA adapters
        disabled (the base weights)."""
        if self.ref_model is not None:
            return self.compute_log_probs(pb, self.ref_model)
        if not self.adapter_reference:
            raise ValueError("no reference: pass ref_model= or use a peft policy with use_kl_loss=True")
        with self.model.disable_adapter():
            return self.compute_log_probs(pb)

    def _share(self, mask: Any, rows: list[int], mini: list[int], seq_weights: Any = None) -> tuple[float, float]:
        """(these rows', the whole mini-batch's) normaliser under the loss aggregation mode."""
        if self.config.loss_agg_mode == "token-mean":
            return float(mask[rows].sum()), float(mask[mini].sum())
        has = (mask.sum(-1) > 0).float() if seq_weights is None else seq_weights
        return float(has[rows].sum()), float(has[mini].sum())

    _TOKEN_MEANS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/ratio_mean", "actor/tis_weight_mean", "actor/kl_loss")

    def update(self, pb: PolicyBatch, advantages: Any, old_log_probs: Any = None, ref_log_probs: Any = None) -> dict[str, float]:
        """PPO-clip updates on one rollout batch.

        Each optimizer step takes one mini-batch; each rank runs its share of it in micro-batches
        (``ppo_micro_batch_size_per_gpu`` rows, or by token budget with ``use_dynamic_bsz``; each
        one a single packed row with ``use_remove_padding`` on a text model) and accumulates
        gradients. Each micro-batch's loss is scaled by its share of the mini-batch's
        normaliser, so the accumulated gradient is the one a single pass over the whole
        mini-batch on one process gives.

        Args:
            pb: The batch.
            advantages: ``[B]`` per-row advantages (a trajectory's, on each of its segments), or
                ``[B, R]`` per-token ones (each turn's: ``algorithm.turn_credit``).
            old_log_probs: ``[B, R]`` recomputed log-probs of the policy that generated it.
                None (on-policy, one optimizer step per batch): the update's own forward pass,
                detached, is the old policy, which saves a forward pass over the batch.
            ref_log_probs: ``[B, R]`` reference log-probs (when ``use_kl_loss``).

        Returns:
            Mean metrics over the optimizer steps: ``actor/pg_loss``, ``actor/grad_norm``,
            ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/kl_loss``, ``actor/tis_weight_mean``,
            ``actor/micro_batches``; with ``rollout_correction`` its ``rollout_corr/...`` metrics
            (once per batch: weights and rejections are computed before the first step).
        """
        import torch

        cfg = self.config
        B = len(pb.sequences)
        mb = cfg.mini_batch_samples(B)
        device = self.device
        advantages = advantages.to(device)
        on_policy = old_log_probs is None
        if on_policy and (cfg.ppo_epochs != 1 or mb < B):
            raise ValueError("old_log_probs=None needs exactly one optimizer step per batch (ppo_epochs=1, no "
                             "mini-batches); compute them with compute_log_probs first")
        if cfg.use_kl_loss and ref_log_probs is None:
            raise ValueError("use_kl_loss=True needs ref_log_probs; compute them with actor.reference_log_probs(pb)")
        if not on_policy:
            old_log_probs = old_log_probs.to(device)
        if ref_log_probs is not None:
            ref_log_probs = ref_log_probs.to(device)
        mask = pb.response_mask.to(device)
        rollout_lp = pb.rollout_log_probs.to(device) if pb.rollout_log_probs is not None else None
        seq_weights = pb.seq_weights.to(device) if pb.seq_weights is not None else None
        is_weights, corr_metrics = None, {}
        if cfg.corrects_rollout:
            if rollout_lp is None:
                raise ValueError("algorithm.rollout_correction needs the engine's log-probs of the batch "
                                 "(pb.rollout_log_probs); this engine returned none")
            if old_log_probs is None:  # the correction needs the whole batch's old log-probs up front
                old_log_probs = self.compute_log_probs(pb).to(device)
            rc = cfg.rollout_correction
            corr = rollout_correction(old_log_probs, rollout_lp, mask, rollout_is=rc.rollout_is,
                                      rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
                                      rollout_rs_threshold=rc.rollout_rs_threshold,
                                      sequence_index=pb.sequence_index().to(device))
            mask, is_weights, corr_metrics = corr.mask.to(mask.dtype), corr.weights, corr.metrics
            if pb.trajectory_ids is not None:  # a rejected token no longer counts in its trajectory's share
                seq_weights = sequence_weights(mask, pb.trajectory_ids).to(device)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.model.train()
        history: list[dict[str, float]] = []
        for _ in range(cfg.ppo_epochs):
            for start in range(0, B, mb):
                mini = list(range(start, min(B, start + mb)))
                local = self.local_rows(mini)
                packed = self._packs(pb, local, grad=True)
                parts = self._micro(pb, local, cfg.ppo_micro_batch_size_per_gpu, packed, grad=True)
                total_n = self._share(mask, mini, mini, seq_weights)[1]
                total_tokens = float(mask[mini].sum())
                keys = ("actor/pg_loss",) + self._TOKEN_MEANS
                sums = dict.fromkeys(keys, 0.0)
                seen: set[str] = set()
                gap = torch.zeros(1, dtype=torch.float64)
                self.optimizer.zero_grad(set_to_none=True)
                prefix = self._step_prefix(self.model, pb, local, parts, grad=True, packed=packed)
                for rows in parts:
                    logp = self._forward(self.model, pb, rows, grad=True, packed=packed, prefix=prefix)
                    if not rows:  # a stand-in pass: same collectives, no contribution
                        (logp.sum() * 0.0).backward()
                        continue
                    old = logp.detach() if old_log_probs is None else old_log_probs[rows]
                    weight = None if is_weights is None else is_weights[rows]
                    if cfg.tis_cap is not None and rollout_lp is not None:
                        weight = truncated_importance_weight(old, rollout_lp[rows], cfg.tis_cap)
                    loss, metrics = ppo_clip_loss(
                        logp, old, advantages[rows], mask[rows],
                        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                        loss_agg_mode=cfg.loss_agg_mode, importance_weight=weight,
                        seq_weight=seq_weights[rows] if seq_weights is not None else None,
                        loss_mode=cfg.policy_loss.loss_mode,
                    )
                    if weight is not None and is_weights is None:
                        metrics["actor/tis_weight_mean"] = float(masked_mean(weight, mask[rows]))
                    if rollout_lp is not None:
                        gap = torch.maximum(gap, ((old - rollout_lp[rows]).abs() * mask[rows]).max().double().cpu())
                    # This pass's share of the mini-batch: its loss is a mean over its own rows,
                    # and the gradient FSDP averages over ranks must be the whole mini-batch's.
                    local_n = self._share(mask, rows, mini, seq_weights)[0]
                    share = float(mask[rows].sum()) / max(total_tokens, 1e-9)
                    scaled = loss * (self.world_size * local_n / max(total_n, 1e-9))
                    sums["actor/pg_loss"] += float(loss.detach()) * local_n / max(total_n, 1e-9)
                    if cfg.use_kl_loss and ref_log_probs is not None:  # not None with KL: checked above
                        # The KL term is a token mean over the whole mini-batch whatever the mode.
                        kl = masked_mean(kl_k3(logp, ref_log_probs[rows]), mask[rows])
                        metrics["actor/kl_loss"] = float(kl.detach())
                        scaled = scaled + cfg.kl_loss_coef * kl * (self.world_size * share)
                    for k in self._TOKEN_MEANS:
                        if k in metrics:
                            sums[k] += metrics[k] * share
                            seen.add(k)
                    scaled.backward()
                if prefix is not None:  # the micro-batches' gradient through the prefix's one pass
                    prefix.backward()
                if self.world_size > 1:
                    flags = torch.tensor([k in seen for k in keys[1:]], dtype=torch.float64)
                    total = self._all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()
                    sums = dict(zip(keys, total, strict=True))
                    seen = {k for k, f in zip(keys[1:], self._all_reduce(flags, "max").tolist(), strict=True) if f}
                    gap = self._all_reduce(gap, "max")
                metrics = {k: v for k, v in sums.items() if k == "actor/pg_loss" or k in seen}
                if rollout_lp is not None:
                    metrics["rollout/logprob_abs_diff_max"] = float(gap[0])
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                full_tensor = getattr(grad_norm, "full_tensor", None)
                if full_tensor is not None:  # a DTensor under FSDP2
                    grad_norm = full_tensor()
                metrics["actor/grad_norm"] = float(grad_norm)
                metrics["actor/micro_batches"] = float(len(parts))
                self.optimizer.step()
                history.append(metrics)
        # The rollout and evaluation that come next need no gradients (0.54 GB on SmolLM2-135M).
        self.optimizer.zero_grad(set_to_none=True)
        keys_all = {k for m in history for k in m}
        means = {k: sum(m.get(k, 0.0) for m in history) / len(history) for k in sorted(keys_all)}
        means["actor/num_updates"] = float(len(history))
        return {**means, **corr_metrics}
