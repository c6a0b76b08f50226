"""The value model PPO's GAE reads (``algorithm.adv_estimator=gae``) and its update.

**A separate model, not a head on the policy's trunk.** verl's critic is a second model,
initialised from a checkpoint (usually the policy's) with a scalar head, and so is this one:

- the two losses never fight over one trunk: a shared trunk needs a value-loss coefficient
  tuned against the policy loss, and a value gradient moves the policy (which then drifts from
  the weights the engine sampled with, so the PPO ratio is no longer 1 on the first step);
- the critic keeps its own optimizer, learning rate, epochs and mini-batches (verl's
  ``critic.*`` keys), and ``trainer.critic_warmup`` can train it alone;
- the policy's code paths (weight sync, LoRA merge, the KL reference, the exported Hugging Face
  folder) are unchanged: they never see a value head.

The cost is a second copy of the weights and a second forward pass, which a tiny or small
model affords; a head on the shared trunk would save both and is the option to add for large
models. With LoRA (``model.lora_rank > 0``) the critic trains its own adapter over its own
frozen copy of the base weights, plus the value head in full.

Values are per response token, ``[B, R]`` like the log-probs: ``values[:, j]`` is the value
of the state before response token ``j`` (the head on the hidden state at position
``prompt_length + j - 1``, the position whose logits sample token ``j``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentloop_trainer.config.critic import CriticSection
from agentloop_trainer.update.gae import (
    clipped_value_loss,
    compute_gae_advantage_return,
    explained_variance,
    masked_mean,
    token_level_rewards,
)

__all__ = ["CRITIC_FILE", "Critic", "ScoredBatch", "ValueModel"]

CRITIC_FILE = "critic.pt"
"""The critic's weights and optimizer state inside a checkpoint's step folder."""


class ValueModel(torch.nn.Module):
    """A causal LM's trunk with a scalar head: ``[b, L]`` ids -> ``[b, L]`` values.

    Args:
        backbone: A transformers causal LM (or a peft one); its trunk is ``get_decoder()``.

    Raises:
        ValueError: the model's config has no ``hidden_size``.
    """

    def __init__(self, backbone: Any) -> None:
        super().__init__()
        config = getattr(backbone, "config", None)
        hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None),
                                                                 "hidden_size", None)
        if not hidden:
            raise ValueError(f"the critic needs a model with config.hidden_size; {type(backbone).__name__} has none "
                             "(set critic.model.path to a transformers causal LM folder)")
        self.backbone = backbone
        self.value_head = torch.nn.Linear(int(hidden), 1)
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (int(hidden) + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def trunk(self) -> Any:
        """The backbone without its vocabulary projection (None: a model without ``get_decoder``)."""
        decoder = getattr(self.backbone, "get_decoder", None)
        return decoder() if callable(decoder) else None

    def forward(self, input_ids: Any, attention_mask: Any) -> Any:
        trunk = self.trunk()
        if trunk is not None:  # skips the vocabulary projection the values do not need
            hidden = trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        else:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden = out.hidden_states[-1]
        return self.value_head(hidden.float()).squeeze(-1)


@dataclass
class ScoredBatch:
    """A batch as the critic scored it before any update."""

    advantages: Any
    """``[B, R]`` GAE advantages, whitened over the model tokens."""
    values: Any
    """``[B, R]`` the critic's values (the clip's centre)."""
    returns: Any
    """``[B, R]`` ``advantages + values`` before whitening (the critic's target)."""


class Critic:
    """Owns the value model and its optimizer.

    Args:
        model: A :class:`ValueModel`.
        section: ``critic`` (lr, epochs, mini-batches, clip).
        gamma: ``algorithm.gamma``.
        lam: ``algorithm.lam``.
        actor_ppo_epochs: The actor's, for ``critic.ppo_epochs=null``.
        actor_mini_batch_size: The actor's ``ppo_mini_batch_size``, for the critic's null.
        rollout_n: ``rollout.n`` (a mini-batch counts prompts, as verl's).
        device: Where the model runs.
        compute_dtype: Autocast dtype (``model.dtype``); None or float32: none.
    """

    def __init__(self, model: Any, section: CriticSection, *, gamma: float = 1.0, lam: float = 1.0,
                 actor_ppo_epochs: int = 1, actor_mini_batch_size: int | None = None, rollout_n: int = 1,
                 device: Any = "cpu", compute_dtype: str | None = None) -> None:
        if section.optim.lr is None:
            raise ValueError("the critic needs a learning rate: set critic.optim.lr (e.g. critic.optim.lr=1e-4)")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.section, self.gamma, self.lam = section, gamma, lam
        self.ppo_epochs = section.ppo_epochs or actor_ppo_epochs
        mini = section.ppo_mini_batch_size or actor_mini_batch_size
        self.mini_batch_rows = None if mini is None else mini * rollout_n
        self.compute_dtype = compute_dtype
        trunk = model.trunk()
        # The vocabulary projection never gets a gradient: keep it out of the optimizer's state.
        source = [*trunk.parameters(), *model.value_head.parameters()] if trunk is not None else model.parameters()
        self.params = [p for p in source if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=section.optim.lr, weight_decay=section.optim.weight_decay)

    # -- forward ----------------------------------------------------------------------------------

    def _values(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], R: int) -> Any:
        """``[b, R]`` values of the rows' response tokens (with grad when grad is on)."""
        seqs = [list(s) if len(s) >= 2 else [0, 0] for s in sequences]
        L = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), L), dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        dtype = self.compute_dtype
        cast = (torch.autocast(self.device.type, dtype=getattr(torch, dtype))
                if dtype and dtype != "float32" else contextlib.nullcontext())
        with cast:
            v = self.model(ids.to(self.device), attn.to(self.device)).float()
        out = torch.zeros((len(seqs), R), dtype=torch.float32, device=self.device)
        for i, (s, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
            n = min(len(s) - p, R)
            if n > 0 and p > 0:
                out[i, :n] = v[i, p - 1 : p - 1 + n]
        return out

    def _parts(self, rows: list[int]) -> list[list[int]]:
        size = self.section.ppo_micro_batch_size_per_gpu
        if size is None or size >= len(rows):
            return [rows]
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def compute_values(self, pb: Any) -> Any:
        """``[B, R]`` values of a :class:`~agentloop_trainer.update.actor.PolicyBatch`, no grad."""
        R = pb.response_mask.shape[1]
        out = torch.zeros(pb.response_mask.shape, dtype=torch.float32, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for part in self._parts(list(range(len(pb.sequences)))):
                out[part] = self._values([pb.sequences[r] for r in part], [pb.prompt_lengths[r] for r in part], R)
        return out * pb.response_mask.to(self.device)

    def score(self, pb: Any, rewards: Any) -> ScoredBatch:
        """Values, then GAE advantages and returns, of a batch whose row ``b`` earned ``rewards[b]``.

        Raises:
            ValueError: a trajectory spans several rows (a loop that splits trajectories into
                segments): GAE here runs within a row; or rows carry images.
        """
        if pb.trajectory_ids is not None:
            raise ValueError("algorithm.adv_estimator=gae needs each trajectory in one row, but this batch's loop "
                             "split some into segments (rows of one trajectory_id); use an estimator without a "
                             "critic (grpo, rloo) with this loop")
        if pb.images is not None:
            raise ValueError("algorithm.adv_estimator=gae does not score rows with images yet (the critic's forward "
                             "takes token ids only); use grpo or rloo for vision tasks")
        mask = pb.response_mask.to(self.device)
        values = self.compute_values(pb)
        token_rewards = token_level_rewards(rewards, mask)
        advantages, returns = compute_gae_advantage_return(token_rewards, values, mask, self.gamma, self.lam)
        return ScoredBatch(advantages, values, returns)

    # -- update -----------------------------------------------------------------------------------

    def update(self, pb: Any, scored: ScoredBatch) -> dict[str, float]:
        """The clipped value loss over ``ppo_epochs`` passes of mini-batches (gradients
        accumulated over micro-batches, each scaled by its share of the mini-batch's tokens).

        Returns:
            ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/grad_norm`` (means over the
            optimizer steps), ``critic/values_mean``, ``critic/returns_mean`` and
            ``critic/vf_explained_var`` (of the values the batch was scored with),
            ``critic/num_updates``.
        """
        mask = pb.response_mask.to(self.device)
        B = len(pb.sequences)
        mb = B if self.mini_batch_rows is None else min(B, self.mini_batch_rows)
        R = mask.shape[1]
        c = self.section
        history: list[tuple[float, float, float]] = []
        self.model.train()
        for _ in range(self.ppo_epochs):
            for start in range(0, B, mb):
                mini = list(range(start, min(B, start + mb)))
                tokens = float(mask[mini].sum())
                if tokens == 0:
                    continue  # every row failed: nothing to fit (the rollout counts the failures)
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = clipped = 0.0
                for part in self._parts(mini):
                    v = self._values([pb.sequences[r] for r in part], [pb.prompt_lengths[r] for r in part], R)
                    term = clipped_value_loss(v, scored.values[part], scored.returns[part], mask[part],
                                              c.cliprange_value, normaliser=tokens)
                    term.loss.backward()
                    loss_sum += float(term.loss.detach())
                    clipped += term.clipped_tokens
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip)
                self.optimizer.step()
                history.append((loss_sum, clipped / tokens, float(grad_norm)))
        n = max(len(history), 1)
        return {
            "critic/vf_loss": sum(h[0] for h in history) / n,
            "critic/vf_clipfrac": sum(h[1] for h in history) / n,
            "critic/grad_norm": sum(h[2] for h in history) / n,
            "critic/values_mean": float(masked_mean(scored.values, mask)),
            "critic/returns_mean": float(masked_mean(scored.returns, mask)),
            "critic/vf_explained_var": explained_variance(scored.values, scored.returns, mask),
            "critic/num_updates": float(len(history)),
        }

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self, step_dir: str | Path) -> Path:
        """Write the critic's weights and optimizer state to ``<step_dir>/critic.pt``."""
        path = Path(step_dir) / CRITIC_FILE
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, path)
        return path

    def load(self, step_dir: str | Path) -> None:
        """Restore what :meth:`save` wrote.

        Raises:
            FileNotFoundError: the checkpoint has no critic (it was written by a run without one).
        """
        path = Path(step_dir) / CRITIC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint {step_dir} was written without a critic "
                                    "(algorithm.adv_estimator was not gae); resume it with the estimator it was "
                                    "written with, or start a new run")
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
