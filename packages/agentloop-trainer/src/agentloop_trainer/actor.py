"""The GRPO actor: recomputes log-probs of a rollout batch and takes PPO-clip updates.

It works on a plain module or an FSDP2-sharded one (``fully_shard``) through the same code:
sharding changes where parameters live, not what the loss is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_trainer.algos import (
    kl_k3,
    masked_mean,
    ppo_clip_loss,
    sequence_weights,
    truncated_importance_weight,
)
from agentloop_trainer.config import ActorSection
from agentloop_trainer.forward import sequence_log_probs


@dataclass
class ActorConfig(ActorSection):
    """Optimisation settings of the GRPO actor: the config's ``actor_rollout_ref.actor``
    section (see :class:`~agentloop_trainer.config.ActorSection` for its fields) plus what the
    actor takes from elsewhere."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    temperature: float = 1.0
    """Sampling temperature (``rollout.temperature``); log-probs are of ``logits / temperature``."""
    rollout_n: int = 1
    """Samples per prompt (``rollout.n``): ``ppo_mini_batch_size`` counts prompts, as in verl."""

    def mini_batch_samples(self, batch_samples: int) -> int:
        """Rows per optimizer step for a batch of ``batch_samples`` rows:
        ``ppo_mini_batch_size * rollout_n``. A row is a sample, or one segment of a sample whose
        loop split it, so a batch of split trajectories takes more optimizer steps."""
        if self.ppo_mini_batch_size is None:
            return batch_samples
        return min(batch_samples, self.ppo_mini_batch_size * self.rollout_n)


@dataclass
class PolicyBatch:
    """A rollout batch unpadded into sequences, with per-token tensors aligned to responses."""

    sequences: list[list[int]]
    """Prompt + response ids of each sample, without padding."""
    prompt_lengths: list[int]
    """Prompt tokens of each sample."""
    response_mask: Any
    """``[B, R]`` 1 on generated tokens."""
    rollout_log_probs: Any
    """``[B, R]`` engine log-probs, or None."""
    seq_weights: Any = None
    """``[B]`` fraction of its trajectory's generated tokens each row holds
    (:func:`~agentloop_trainer.algos.sequence_weights`), for the ``seq-mean`` loss modes;
    None when every trajectory is one row (each row with tokens is then a whole sequence)."""

    def padded(self, multiple: int) -> PolicyBatch:
        """This batch with empty rows (no tokens, mask 0) appended up to a multiple of
        ``multiple`` rows, so a batch of segments splits evenly over FSDP ranks. The empty
        rows add nothing to the loss, its normaliser or the metrics."""
        import torch

        extra = -len(self.sequences) % multiple
        if not extra:
            return self
        R = self.response_mask.shape[1]

        def grow(t: Any, shape: tuple[int, ...]) -> Any:
            return None if t is None else torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)])

        return PolicyBatch(
            sequences=self.sequences + [[] for _ in range(extra)],
            prompt_lengths=self.prompt_lengths + [0] * extra,
            response_mask=grow(self.response_mask, (extra, R)),
            rollout_log_probs=grow(self.rollout_log_probs, (extra, R)),
            seq_weights=grow(self.seq_weights, (extra,)),
        )


def policy_batch_from_rollout(batch: Any) -> PolicyBatch:
    """Unpad a :class:`agentloop_core.batch.RolloutBatch` (left-padded prompts, right-padded
    responses) into token sequences, one per row (a sample, or a segment of one). Failed
    samples keep their prompt and get an all-zero mask.
    """
    import numpy as np
    import torch

    P = batch.prompts.shape[1]
    sequences, prompt_lengths = [], []
    for b in range(len(batch)):
        attn = batch.attention_mask[b]
        prompt = batch.prompts[b][attn[:P] == 1].tolist()
        response = batch.responses[b][attn[P:] == 1].tolist()
        sequences.append(prompt + response)
        prompt_lengths.append(len(prompt))
    mask = torch.from_numpy(np.ascontiguousarray(batch.response_mask)).float()
    mask[torch.from_numpy(np.asarray(batch.failed, dtype=bool))] = 0.0
    rollout = None
    if batch.rollout_log_probs is not None:
        rollout = torch.from_numpy(np.ascontiguousarray(batch.rollout_log_probs)).float()
    weights = None
    trajectories = np.asarray(batch.trajectory_index)
    if np.unique(trajectories).size < len(trajectories):
        weights = sequence_weights(mask, trajectories.tolist())
    return PolicyBatch(sequences, prompt_lengths, mask, rollout, weights)


def response_log_probs(model: Any, pb: PolicyBatch, temperature: float = 1.0, rows: Sequence[int] | None = None) -> Any:
    """Log-probs of each response token under ``model``, shaped like ``pb.response_mask``.

    Args:
        model: The policy (plain or FSDP-sharded).
        pb: The unpadded batch.
        temperature: The sampling temperature.
        rows: Subset of rows (a mini-batch); None: all.
    """
    import torch

    rows = list(range(len(pb.sequences))) if rows is None else list(rows)
    # A failed sample can come back with no tokens at all; it is masked out, but the forward
    # still needs a row, so give it a 2-token stand-in (pad ids) instead of crashing the step.
    seqs = [pb.sequences[r] if len(pb.sequences[r]) >= 2 else (list(pb.sequences[r]) * 2 or [0, 0]) for r in rows]
    first = min((pb.prompt_lengths[r] for r in rows if pb.prompt_lengths[r] > 0), default=1)
    logp = sequence_log_probs(model, seqs, temperature=temperature, first_scored=first)
    R = pb.response_mask.shape[1]
    out = torch.zeros((len(rows), R), dtype=logp.dtype, device=logp.device)
    for i, r in enumerate(rows):
        p = pb.prompt_lengths[r]
        n = min(len(pb.sequences[r]) - p, R)
        if n > 0 and p > 0:
            # logp[t] scores token t+1, so response token j (at position p+j) is logp[p+j-1].
            out[i, :n] = logp[i, p - 1 : p - 1 + n]
    return out


class GRPOActor:
    """Owns the policy and its optimizer.

    Args:
        model: The policy module (already sharded when running under FSDP2).
        config: Optimisation settings.
        ref_model: Frozen reference policy for the KL loss (needed when ``use_kl_loss``).
    """

    def __init__(self, model: Any, config: ActorConfig, ref_model: Any = None) -> None:
        import torch

        if config.use_kl_loss and ref_model is None:
            raise ValueError("use_kl_loss=True needs a reference model; pass ref_model= or set use_kl_loss=False")
        self.model = model
        self.config = config
        self.ref_model = ref_model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay
        )
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1

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

    def _all_reduce_sum(self, tensor: Any) -> Any:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def compute_log_probs(self, pb: PolicyBatch, model: Any = None) -> Any:
        """Log-probs of the batch's responses under the current (or given) model, no grad."""
        import torch

        model = model or self.model
        was_training = model.training
        model.eval()
        rows = self.local_rows(range(len(pb.sequences)))
        with torch.no_grad():
            local = response_log_probs(model, pb, self.config.temperature, rows)
        model.train(was_training)
        if self.world_size == 1:
            return local
        full = torch.zeros(pb.response_mask.shape, dtype=local.dtype, device=local.device)
        full[rows] = local
        return self._all_reduce_sum(full)

    def _share(self, mask: Any, rows: list[int], mini: list[int], seq_weights: Any = None) -> tuple[float, float]:
        """(this rank's, the whole mini-batch's) normaliser under the loss aggregation mode."""
        if self.config.loss_agg_mode == "token-mean":
            return float(mask[rows].sum()), float(mask[mini].sum())
        has = (mask.sum(-1) > 0).float() if seq_weights is None else seq_weights
        return float(has[rows].sum()), float(has[mini].sum())

    _TOKEN_MEANS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/ratio_mean", "actor/tis_weight_mean", "actor/kl_loss")

    def _reduce_metrics(self, metrics: dict[str, float], pg_loss_part: float, token_share: float) -> None:
        """Turn this rank's metrics into the whole mini-batch's, in one all-reduce: the loss
        parts add up, and the token means are weighted by this rank's share of the tokens."""
        import torch

        keys = [k for k in self._TOKEN_MEANS if k in metrics]
        parts = torch.tensor([pg_loss_part] + [metrics[k] * token_share for k in keys], dtype=torch.float64)
        total = self._all_reduce_sum(parts).tolist()
        metrics["actor/pg_loss"] = total[0]
        metrics.update(zip(keys, total[1:], strict=True))

    def update(self, pb: PolicyBatch, advantages: Any, old_log_probs: Any = None, ref_log_probs: Any = None) -> dict[str, float]:
        """PPO-clip updates on one rollout batch.

        Args:
            pb: The batch.
            advantages: ``[B]`` per-row advantages (a trajectory's, on each of its segments).
            old_log_probs: ``[B, R]`` recomputed log-probs of the policy that generated it.
                None (on-policy, one optimizer step per batch): the update's own forward pass,
                detached, is the old policy, which saves a forward pass over the batch.
            ref_log_probs: ``[B, R]`` reference log-probs (when ``use_kl_loss``).

        Returns:
            Mean metrics over the optimizer steps: ``actor/pg_loss``, ``actor/grad_norm``,
            ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/kl_loss``, ``actor/tis_weight_mean``.
        """
        import torch

        cfg = self.config
        B = len(pb.sequences)
        mb = cfg.mini_batch_samples(B)
        device = next(self.model.parameters()).device
        advantages = advantages.to(device)
        on_policy = old_log_probs is None
        if on_policy and (cfg.ppo_epochs != 1 or mb < B):
            raise ValueError("old_log_probs=None needs exactly one optimizer step per batch (ppo_epochs=1, no "
                             "mini-batches); compute them with compute_log_probs first")
        if not on_policy:
            old_log_probs = old_log_probs.to(device)
        mask = pb.response_mask.to(device)
        rollout_lp = pb.rollout_log_probs.to(device) if pb.rollout_log_probs is not None else None
        seq_weights = pb.seq_weights.to(device) if pb.seq_weights is not None else None
        self.model.train()
        history: list[dict[str, float]] = []
        for _ in range(cfg.ppo_epochs):
            for start in range(0, B, mb):
                mini = list(range(start, min(B, start + mb)))
                rows = self.local_rows(mini)
                logp = response_log_probs(self.model, pb, cfg.temperature, rows)
                old = logp.detach() if on_policy else old_log_probs[rows]
                weight = None
                if cfg.tis_cap is not None and rollout_lp is not None:
                    weight = truncated_importance_weight(old, rollout_lp[rows], cfg.tis_cap)
                loss, metrics = ppo_clip_loss(
                    logp, old, advantages[rows], mask[rows],
                    clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                    loss_agg_mode=cfg.loss_agg_mode, importance_weight=weight,
                    seq_weight=seq_weights[rows] if seq_weights is not None else None,
                )
                metrics["actor/pg_loss"] = float(loss.detach())
                if weight is not None:
                    metrics["actor/tis_weight_mean"] = float(masked_mean(weight, mask[rows]))
                if rollout_lp is not None:
                    gap = ((old - rollout_lp[rows]).abs() * mask[rows]).max().reshape(1)
                    if self.world_size > 1:
                        import torch.distributed as dist

                        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
                    metrics["rollout/logprob_abs_diff_max"] = float(gap[0])
                if cfg.use_kl_loss:
                    if ref_log_probs is None:
                        raise ValueError("use_kl_loss=True needs ref_log_probs; compute them with "
                                         "compute_log_probs(pb, actor.ref_model)")
                    kl = masked_mean(kl_k3(logp, ref_log_probs.to(device)[rows]), mask[rows])
                    metrics["actor/kl_loss"] = float(kl.detach())
                if self.world_size > 1:
                    # Each rank's loss is a mean over its rows; FSDP averages gradients over
                    # ranks. Rescale so the result is the mean over the whole mini-batch, exactly
                    # what one process computes (token-mean: weight by this rank's token share).
                    local_n, total_n = self._share(mask, rows, mini, seq_weights)
                    loss = loss * (self.world_size * local_n / max(total_n, 1e-9))
                    # The KL term and the diagnostics are token means over the whole mini-batch
                    # whatever the aggregation mode: weight them by this rank's token share.
                    share = float(mask[rows].sum()) / max(float(mask[mini].sum()), 1e-9)
                    if cfg.use_kl_loss:
                        kl = kl * (self.world_size * share)
                    self._reduce_metrics(metrics, float(loss.detach()) / self.world_size, share)
                if cfg.use_kl_loss:
                    loss = loss + cfg.kl_loss_coef * kl
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                    grad_norm = grad_norm.full_tensor()
                metrics["actor/grad_norm"] = float(grad_norm)
                self.optimizer.step()
                history.append(metrics)
        keys = {k for m in history for k in m}
        means = {k: sum(m.get(k, 0.0) for m in history) / len(history) for k in sorted(keys)}
        means["actor/num_updates"] = float(len(history))
        return means
