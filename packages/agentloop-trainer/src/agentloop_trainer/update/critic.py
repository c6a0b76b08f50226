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

**FSDP** (``trainer.fsdp_ranks > 1``): the critic is sharded as the policy is (each decoder layer
of its trunk, then the root with the value head: :func:`shard_critic`), and each rank scores and
trains its own slice of every batch, as the actor does. Every value is computed on one rank and
summed over the ranks, so the values, advantages and returns are the one-process ones on every
rank; each micro-batch's loss is scaled by its share of the whole mini-batch's tokens, so the
gradient FSDP averages is the one-process gradient. ``critic.pt`` holds full (unsharded) state
dicts keyed by parameter name, written by rank 0, so a run resumes on any number of ranks.

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
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from agentloop_trainer.update.critic_settings import CriticSection
from agentloop_trainer.update.fsdp import is_sharded, shard_policy
from agentloop_trainer.update.gae import (
    clipped_value_loss,
    compute_gae_advantage_return,
    explained_variance,
    masked_mean,
    token_level_rewards,
)

__all__ = ["CRITIC_FILE", "Critic", "ScoredBatch", "ValueModel", "shard_critic"]

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

    def decoder_layers(self) -> list[Any]:
        """The trunk's decoder layers (what FSDP shards one by one); [] when it has none."""
        return list(getattr(self.trunk(), "layers", None) or [])

    def forward(self, input_ids: Any, attention_mask: Any) -> Any:
        trunk = self.trunk()
        if trunk is not None:  # skips the vocabulary projection the values do not need
            hidden = trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        else:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden = out.hidden_states[-1]
        return self.value_head(hidden.float()).squeeze(-1)


def shard_critic(model: ValueModel, device: str = "cpu", dtype: str = "float32") -> ValueModel:
    """FSDP2-shard a value model over the process group, as the policy is: each decoder layer of
    its trunk, then the root (embeddings, final norm and the value head). ``dtype`` bfloat16:
    mixed precision with float32 shards, as the policy's."""
    return shard_policy(model.to(device), device, dtype, layers=model.decoder_layers())


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
        compute_dtype: Autocast dtype (``model.dtype``); None or float32: none. A sharded model
            (:func:`shard_critic`) casts through its mixed-precision policy instead.

    Under a process group of several ranks the model must already be sharded
    (:func:`shard_critic`), and every rank must make the same calls (they are collectives).
    """

    def __init__(self, model: Any, section: CriticSection, *, gamma: float = 1.0, lam: float = 1.0,
                 actor_ppo_epochs: int = 1, actor_mini_batch_size: int | None = None, rollout_n: int = 1,
                 device: Any = "cpu", compute_dtype: str | None = None) -> None:
        if section.optim.lr is None:
            raise ValueError("the critic needs a learning rate: set critic.optim.lr (e.g. critic.optim.lr=1e-4)")
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        sharded = is_sharded(model)
        if self.world_size > 1 and not sharded:
            raise ValueError(f"the critic runs on {self.world_size} ranks but its model is not sharded; shard it "
                             "first (agentloop_trainer.update.critic.shard_critic)")
        self.device = torch.device(device)
        # Sharded parameters are placed by FSDP; its mixed-precision policy casts, no autocast on top.
        self.model = model if sharded else model.to(self.device)
        compute_dtype = None if sharded else compute_dtype
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

    def _all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def _parts(self, rows: list[int]) -> list[list[int]]:
        """This rank's micro-batches of ``rows``: a contiguous slice of them (the ranks' slices
        may differ by a row: each loss is normalised by the whole mini-batch's tokens, so no
        even split is needed), in ``ppo_micro_batch_size_per_gpu`` rows, padded with empty
        micro-batches to the most any rank has (FSDP ranks must make the same passes)."""
        k = -(-len(rows) // self.world_size)
        local = rows[self.rank * k : (self.rank + 1) * k]
        size = self.section.ppo_micro_batch_size_per_gpu
        parts = [local] if size is None or size >= len(local) else [local[i : i + size] for i in range(0, len(local), size)]
        parts = [p for p in parts if p]
        if self.world_size > 1:
            most = int(self._all_reduce(torch.tensor([len(parts)], device=self.device), "max")[0])
            parts += [[] for _ in range(most - len(parts))]
        return parts

    def _part_values(self, pb: Any, part: list[int], R: int) -> Any:
        """``_values`` of the rows ``part``; an empty part runs a stand-in row (its result is
        discarded) so every rank makes the same collective calls."""
        if not part:
            return self._values([[0, 0]], [1], R)
        return self._values([pb.sequences[r] for r in part], [pb.prompt_lengths[r] for r in part], R)

    def compute_values(self, pb: Any) -> Any:
        """``[B, R]`` values of a :class:`~agentloop_trainer.update.actor.PolicyBatch`, no grad
        (under FSDP each rank scores its slice, and the sum over ranks is every row's)."""
        R = pb.response_mask.shape[1]
        out = torch.zeros(pb.response_mask.shape, dtype=torch.float32, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for part in self._parts(list(range(len(pb.sequences)))):
                v = self._part_values(pb, part, R)
                if part:
                    out[part] = v
        return self._all_reduce(out) * pb.response_mask.to(self.device)

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
        scored = _padded(scored, B)  # the trainer pads the batch to a multiple of the ranks after scoring it
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
                sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, clipped tokens
                for part in self._parts(mini):
                    v = self._part_values(pb, part, R)
                    if not part:  # a stand-in pass: same collectives, no contribution
                        (v.sum() * 0.0).backward()
                        continue
                    term = clipped_value_loss(v, scored.values[part], scored.returns[part], mask[part],
                                              c.cliprange_value, normaliser=tokens)
                    # FSDP averages the ranks' gradients; each loss is already this part's share
                    # of the whole mini-batch's, so the ranks' sum is the one-process loss.
                    (term.loss * self.world_size).backward()
                    sums += torch.tensor([float(term.loss.detach()), term.clipped_tokens], dtype=torch.float64,
                                         device=self.device)
                loss_sum, clipped = self._all_reduce(sums).tolist()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip)
                full_tensor = getattr(grad_norm, "full_tensor", None)
                if full_tensor is not None:  # a DTensor under FSDP2
                    grad_norm = full_tensor()
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
        """Write the critic's weights and optimizer state to ``<step_dir>/critic.pt``: full state
        dicts keyed by parameter name (gathered from the shards under FSDP; every rank must call
        it, rank 0 writes), so any number of ranks can load them."""
        path = Path(step_dir) / CRITIC_FILE
        model_state, optim_state = get_state_dict(self.model, self.optimizer,
                                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            partial = path.with_suffix(".pt.partial")
            torch.save({"model": model_state, "optimizer": optim_state}, partial)
            partial.replace(path)  # a crash mid-write leaves no truncated critic.pt to resume from
        if self.world_size > 1:
            dist.barrier()  # the file is whole before any rank may read it
        return path

    def load(self, step_dir: str | Path) -> None:
        """Restore what :meth:`save` wrote, on any number of ranks: each rank reads the file (in
        the step folder every rank reads the policy's shards from) and keeps its shards of it.
        Every rank must call it.

        Raises:
            FileNotFoundError: the checkpoint has no critic (it was written by a run without one).
        """
        path = Path(step_dir) / CRITIC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint {step_dir} was written without a critic "
                                    "(algorithm.adv_estimator was not gae); resume it with the estimator it was "
                                    "written with, or start a new run")
        state = torch.load(path, map_location="cpu", weights_only=True)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))


def _padded(scored: ScoredBatch, rows: int) -> ScoredBatch:
    """``scored`` with zero rows appended up to ``rows`` (the empty rows the trainer pads a batch
    with for the FSDP ranks carry no tokens, so their values and returns are never read)."""
    extra = rows - scored.values.shape[0]
    if extra <= 0:
        return scored

    def grow(t: Any) -> Any:
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])

    return ScoredBatch(grow(scored.advantages), grow(scored.values), grow(scored.returns))
