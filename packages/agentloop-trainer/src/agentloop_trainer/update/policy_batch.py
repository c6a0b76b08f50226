"""A rollout batch unpadded into token sequences: what the actor's forward passes and losses read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentloop_trainer.update.losses import sequence_weights


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
    (:func:`~agentloop_trainer.update.losses.sequence_weights`), for the ``seq-mean`` loss modes;
    None when every trajectory is one row (each row with tokens is then a whole sequence)."""
    trajectory_ids: list[int] | None = None
    """The trajectory of each row, where some trajectory spans several rows; None: one row each."""
    images: list[tuple[Any, ...]] | None = None
    """Per row, the images its tokens hold (``ImageItem``\\ s in order, from the rollout's
    ``multi_modal_data``); None when no row has any."""

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
            trajectory_ids=None if self.trajectory_ids is None else
            self.trajectory_ids + [max(self.trajectory_ids, default=-1) + 1 + k for k in range(extra)],
            images=None if self.images is None else self.images + [() for _ in range(extra)],
        )

    def sequence_index(self) -> Any:
        """``[B]`` long: the sequence (trajectory) number of each row, numbered from 0."""
        import torch

        ids = self.trajectory_ids if self.trajectory_ids is not None else range(len(self.sequences))
        number: dict[int, int] = {}
        return torch.tensor([number.setdefault(t, len(number)) for t in ids], dtype=torch.long)


def policy_batch_from_rollout(batch: Any, mask_truncated: bool = False) -> PolicyBatch:
    """Unpad a :class:`agentloop_core.batch.RolloutBatch` (left-padded prompts, right-padded
    responses) into token sequences, one per row (a sample, or a segment of one). Failed
    samples keep their prompt and get an all-zero mask; so do trajectories cut short
    (:meth:`~agentloop_core.batch.RolloutBatch.stopped_on_a_limit`) with ``mask_truncated``
    (``algorithm.mask_truncated``).
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
    if mask_truncated:
        mask[torch.from_numpy(batch.stopped_on_a_limit())] = 0.0
    rollout = None
    if batch.rollout_log_probs is not None:
        rollout = torch.from_numpy(np.ascontiguousarray(batch.rollout_log_probs)).float()
    weights, ids = None, None
    trajectories = np.asarray(batch.trajectory_index)
    if np.unique(trajectories).size < len(trajectories):
        ids = [int(t) for t in trajectories.tolist()]
        weights = sequence_weights(mask, ids)
    images = [tuple((data or {}).get("image") or ()) for data in (batch.multi_modal_data or [None] * len(batch))]
    return PolicyBatch(sequences, prompt_lengths, mask, rollout, weights, ids,
                       images=images if any(images) else None)
