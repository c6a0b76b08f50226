"""The GRPO training loop: rollout -> rewards -> advantages -> PPO-clip update -> weight sync,
with held-out evaluation, metrics, checkpoints and the run summary."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.config_base import plain_dict
from agentloop_trainer.data.iterator import DataIterator
from agentloop_trainer.eval.sets import result_metrics
from agentloop_trainer.reward.judge_client import judge_step_metrics
from agentloop_trainer.rollout.dynamic_sampling import overlong_metrics
from agentloop_trainer.rollout.rollouts import make_rows
from agentloop_trainer.stages.memory import end_of_phase, peak_memory_metrics
from agentloop_trainer.stages.ppo import build_critic, uses_critic
from agentloop_trainer.stages.rollout_setup import (
    dynamic_sampler,
    rollout_fleet,
    rollout_tracer,
    rollout_watch,
)
from agentloop_trainer.stages.teacher import build_distiller
from agentloop_trainer.update.actor import ActorConfig, PolicyGradientActor, policy_batch_from_rollout
from agentloop_trainer.update.settings import ActorFSDPSection, PolicyLossSection, RolloutCorrectionSection
from agentloop_trainer.update.turn_credit import CreditSettings, credit_advantages
from agentloop_trainer.view.metrics import idle_fraction, plot_reward_curve


def actor_config(cfg: TrainConfig) -> ActorConfig:
    """The :class:`ActorConfig` of a :class:`~agentloop_trainer.config.sections.TrainConfig`."""
    section = plain_dict(cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor")
    fsdp = plain_dict(section["fsdp_config"], "actor_rollout_ref.actor.fsdp_config")
    section["fsdp_config"] = ActorFSDPSection(**fsdp)
    section["policy_loss"] = PolicyLossSection(**plain_dict(section["policy_loss"], "actor_rollout_ref.actor.policy_loss"))
    correction = plain_dict(cfg.algorithm.rollout_correction, "algorithm.rollout_correction")
    r = cfg.actor_rollout_ref.rollout
    return ActorConfig(**section, temperature=r.temperature, rollout_n=r.n, compute_dtype=cfg.model.dtype,
                       share_prefix_with_grad=not cfg.model.enable_gradient_checkpointing,
                       rollout_correction=RolloutCorrectionSection(**correction))


class PolicyGradientTrainer:
    """Runs policy-gradient steps on one process (the FSDP2 path: :mod:`agentloop_trainer.update.fsdp`).

    Args:
        cfg: The training config.
        model: The policy, loaded from the starting checkpoint.
        engine_model: A separate copy of the same weights for the rollout engine.
        tokenizer: The tokenizer.
        train_records: Training rows.
        test_records: Held-out rows.
        run_dir: Where metrics, checkpoints, plots and the summary go.
        log: Console printer.
        model_path: The starting checkpoint folder (engines that load by path and Ray replicas
            load it).
        ref_model: The frozen reference policy for the KL loss. None: a copy of ``model`` when
            ``use_kl_loss`` on one process; under FSDP the caller passes one sharded like the
            policy (:func:`agentloop_trainer.update.fsdp.load_reference`).
    """

    def __init__(self, cfg: TrainConfig, model: Any, engine_model: Any, tokenizer: Any, train_records: Sequence[dict],
                 test_records: Sequence[dict], run_dir: Path, log: Any = print,
                 model_path: str | Path | None = None, ref_model: Any = None) -> None:
        import torch

        self.cfg, self.tokenizer, self.log = cfg, tokenizer, log
        model_path = model_path if model_path is not None else cfg.model.path
        self.run_dir = Path(run_dir)
        from agentloop_trainer.update.fsdp import is_sharded

        self.device = torch.device(cfg.trainer.device)
        sharded = is_sharded(model)
        # Sharded parameters are placed by FSDP (host memory when offloaded): leave them there.
        self.model = model if sharded else model.to(self.device)
        self.actor_cfg = actor_config(cfg)
        if sharded:  # FSDP2's mixed-precision policy casts; no autocast on top
            self.actor_cfg.compute_dtype = None
        self.owns_process_group = False
        ref = ref_model if self.actor_cfg.use_kl_loss else None
        lora = hasattr(model, "disable_adapter")
        if self.actor_cfg.use_kl_loss and ref is None and not lora:
            import torch.distributed as dist

            if sharded or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                raise ValueError("use_kl_loss under FSDP needs ref_model=, the reference sharded like the policy "
                                 "(agentloop_trainer.update.fsdp.load_reference); a copy of a sharded policy is not one")
            import copy

            ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.actor = PolicyGradientActor(self.model, self.actor_cfg, ref_model=ref, device=self.device)
        self.distiller = build_distiller(cfg.distillation, cfg.model, tokenizer, model_path, sharded=sharded,
                                         device=self.device)
        """On-policy distillation's frozen teacher (``distillation.enabled``), or None."""
        self.critic = build_critic(cfg, model_path) if uses_critic(cfg) else None
        """PPO's value model (``algorithm.adv_estimator=gae``; stages/ppo.py), or None."""
        self.bucket_bytes = max(1, int(cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20))
        self.last_sync: dict[str, float] = {}
        self.rank, self.world_size = self.actor.rank, self.actor.world_size
        self.n = cfg.actor_rollout_ref.rollout.n
        self.free_cache_engine = bool(cfg.actor_rollout_ref.rollout.free_cache_engine)
        # Rank 0 hosts the engine; the other ranks only hold policy shards.
        self.fleet = None
        if self.rank == 0:
            if model_path is None:
                raise ValueError("PolicyGradientTrainer needs the starting checkpoint the engine loads: pass model_path= or "
                                 "set model.path")
            self.fleet = rollout_fleet(cfg, model_path, tokenizer, engine_model, name=f"agentloop-{self.run_dir.name}",
                                       tracer=rollout_tracer(cfg, self.run_dir))
        self.data = DataIterator(train_records, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.test_records = list(test_records)
        self.step = 0
        self.watch = rollout_watch(cfg, tokenizer, log, active=self.rank == 0)
        """Warns about all-zero rewards and turns cut by the cap (rank 0)."""
        self.history: list[dict[str, Any]] = []
        self.sampler = dynamic_sampler(cfg)
        """Over-long shaping and dynamic sampling (``reward_model.overlong_buffer``, ``algorithm.filter_groups``)."""
        # trainer.mode=one_step_off|async: the steps come from the asynchronous driver.
        self.async_driver = None
        if self.fleet is not None and cfg.trainer.mode != "sync":
            from agentloop_trainer.stages.async_driver import AsyncDriver

            self.async_driver = AsyncDriver(self)
        self.metrics = None
        """The run's loggers (``trainer.logger``; rank 0)."""
        if self.rank == 0:
            from agentloop_trainer.loggers import Tracking

            self.metrics = Tracking.from_config(cfg.trainer, self.run_dir, log, plain_dict(cfg, "config"))

    # -- pieces ---------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Push the policy's weights into the rollout engine, a bucket at a time (LoRA merged).

        Under FSDP every rank takes part (each tensor is gathered on its own); rank 0 pushes.
        ``last_sync`` keeps the push's bucket count and largest bucket (the memory it held
        beyond the model).
        """
        from agentloop_trainer.update.weights import iter_policy_weights

        buckets = largest = 0
        for bucket in iter_policy_weights(self.model, self.bucket_bytes):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            buckets, largest = buckets + 1, max(largest, size)
            if self.fleet is not None:
                self.fleet.update_weights(bucket)
        self.last_sync = {"perf/sync_buckets": float(buckets), "perf/sync_bucket_peak_mb": largest / 2**20}

    def evaluate(self) -> Any:
        """Held-out accuracy with the current engine weights (rank 0; None elsewhere), with every
        validation set's pass@k/avg@k/maj@k in its ``metrics`` (``val/<data_source>/...``)."""
        if self.fleet is None:
            return None
        result = self.fleet.evaluate(self.test_records)
        end_of_phase(self.device)
        result.metrics.update(result_metrics(result, self.fleet.tokenizer, self.fleet.scorer))
        return result

    def train_step(self) -> dict[str, Any]:
        """One GRPO step; returns its metrics."""
        if self.async_driver is not None:
            return self.async_driver.train_step()
        t0 = time.perf_counter()
        rows = batch = None
        busy_start = self.fleet.busy_seconds() if self.fleet is not None else None
        sampling: dict[str, float] = {}
        if self.fleet is not None:
            if self.sampler.active:
                rows, batch, sampling = self.sampler.sample(self.fleet, self.data, self.n, self.step, self.log)
            else:
                rows = make_rows(self.data.next_batch(), self.n, step=self.step)
                batch = self.fleet.generate(rows, step=self.step)
            if batch.failed.all():
                from agentloop_trainer.rollout.diagnostics import batch_errors, failure_breakdown

                raise RuntimeError(
                    f"all {batch.num_trajectories} rollout samples of step {self.step} failed, so there is "
                    "nothing to train on; the errors:\n" + "\n".join(failure_breakdown(batch_errors(batch))))
        if self.world_size > 1:
            from agentloop_trainer.update.fsdp import broadcast_object

            rows, batch = broadcast_object((rows, batch))
        t_gen = time.perf_counter() - t0
        # Rank 0 rolled out (it hosts the fleet); the other ranks got its batch above.
        assert rows is not None, "every rank has the step's rollout rows by now"
        assert batch is not None, "every rank has the step's rollout batch by now"
        can_sleep = self.fleet is not None and self.free_cache_engine and self.fleet.can_sleep
        sleeping = self.fleet if can_sleep else None
        slept = sleeping is not None
        if sleeping is not None:
            sleeping.sleep()  # the update gets the accelerator memory the engine held
        end_of_phase(self.device)  # the rollout's decode buffers
        learned = self._learn(rows, batch)
        end_of_phase(self.device)  # the update's activations, before the engine decodes again
        t2 = time.perf_counter()
        if sleeping is not None:
            sleeping.wake_up()
        self.sync_weights()
        t_sync = time.perf_counter() - t2
        return {**self._step_metrics(rows, batch, learned, t0=t0, t_gen=t_gen, t_sync=t_sync, slept=slept,
                                     busy_start=busy_start), **sampling}

    def _learn(self, rows: Sequence[dict], batch: Any) -> dict[str, Any]:
        """Advantages and the PPO-clip update on a rolled-out batch (every rank)."""
        import torch

        # A batch row is one segment of a trajectory (usually the whole of it): the advantage is
        # the trajectory's ([B]), computed over its prompt's group once per trajectory, or with
        # per-turn credit each turn's ([B, R]); see update/turn_credit.py.
        groups = [rows[t]["group_id"] for t in batch.trajectory_index.tolist()]
        pure_distillation = self.distiller is not None and not self.distiller.loss.use_task_rewards
        advantages = torch.zeros(len(batch)) if pure_distillation or self.critic else credit_advantages(
            CreditSettings.from_config(self.cfg.algorithm), batch, groups)
        last = batch.last_segment_rows()
        rewards = torch.as_tensor(batch.rewards[last])  # one per trajectory
        pb = policy_batch_from_rollout(batch, self.cfg.algorithm.mask_truncated)
        scored = self.critic.score(pb, batch.rewards) if self.critic is not None else None  # PPO: GAE, [B, R]
        advantages = scored.advantages if scored is not None else advantages
        if self.world_size > 1:
            # Segments make the row count vary; every rank must run the same number of rows.
            pb = pb.padded(self.world_size)
            advantages = torch.cat([advantages, advantages.new_zeros((len(pb.sequences) - len(advantages),
                                                                       *advantages.shape[1:]))])
        t1 = time.perf_counter()
        a = self.actor_cfg
        one_step = a.ppo_epochs == 1 and a.mini_batch_samples(len(pb.sequences)) >= len(pb.sequences)
        # One optimizer step per batch: the update's own forward is the old policy (saves a pass).
        old = None if one_step else self.actor.compute_log_probs(pb)
        ref = self.actor.reference_log_probs(pb) if self.actor.has_reference else None
        distilled: dict[str, float] = {}
        if self.distiller is not None:  # the teacher's per-token signal (update/distill.py)
            old, advantages, distilled = self.distiller.apply(self.actor, pb, old, advantages)
        critic_only = scored is not None and self.step < self.cfg.trainer.critic_warmup
        metrics = {**({} if critic_only else self.actor.update(pb, advantages, old, ref)), **distilled}
        if self.critic is not None and scored is not None:
            metrics.update(self.critic.update(pb, scored))
        return {"metrics": metrics, "advantages": advantages, "last": last, "rewards": rewards, "pb": pb,
                "t_update": time.perf_counter() - t1}

    def _step_metrics(self, rows: Sequence[dict], batch: Any, learned: dict[str, Any], *, t0: float, t_gen: float,
                      t_sync: float, slept: bool, busy_start: float | None = None) -> dict[str, Any]:
        """Finish a step: count it, check rewards, write its trajectories, return its metrics.

        ``busy_start``: the engine's :meth:`~agentloop_trainer.rollout.rollouts.RolloutFleet.busy_seconds`
        at ``t0``; with it the metrics get ``rollout/engine_idle_fraction`` over the step."""
        metrics, advantages, last = learned["metrics"], learned["advantages"], learned["last"]
        rewards, pb, t_update = learned["rewards"], learned["pb"], learned["t_update"]
        mask = pb.response_mask
        generated = int(mask.sum())
        self.step += 1
        metrics.update({
            "step": self.step,
            "reward/mean": float(rewards.mean()),
            "train/accuracy": float((rewards > 0.5).float().mean()),
            "rollout/generated_tokens": generated,
            "rollout/response_length_mean": float(batch.attention_mask[:, batch.prompts.shape[1]:].sum(1).mean()),
            "rollout/num_failed": int(batch.num_failed),
            "rollout/engine_slept": int(bool(slept)),
            "rollout/groups_with_signal": float(_groups_with_signal(
                [rows[t] for t in batch.trajectory_index[last]], batch.rewards[last])),
            "timing_s/generate": t_gen, "timing_s/update": t_update, "timing_s/sync_weights": t_sync,
            "timing_s/step": time.perf_counter() - t0,
            "perf/generate_tokens_per_s": generated / max(t_gen, 1e-9),
            **self.last_sync, **peak_memory_metrics(self.device),
            **(overlong_metrics(batch) if self.sampler.shaping else {}),
        })
        self.watch.after_step(rows, batch, rewards, self.step, getattr(self.fleet, "scorer", None))
        if self.rank == 0:
            from agentloop_trainer.view.viewer import (
                step_trajectory_path,
                step_trajectory_records,
                write_jsonl,
            )

            records = step_trajectory_records(batch, rows, self.tokenizer, self.cfg.trainer.log_trajectories_per_step,
                                              self.step, _row_advantages(advantages, mask).tolist())
            if records:
                write_jsonl(records, step_trajectory_path(self.run_dir, self.step))
                if self.metrics is not None:
                    self.metrics.log_trajectories(records, self.step)
        busy_end = self.fleet.busy_seconds() if busy_start is not None and self.fleet is not None else None
        if busy_start is not None and busy_end is not None:
            metrics["rollout/engine_idle_fraction"] = idle_fraction(busy_end - busy_start, time.perf_counter() - t0)
        # The rollout's own batch metrics too: per-loop timings, tool counters and what tools
        # report (agent_loop/...), failures and worker losses on the Ray backend; and what the
        # judge cost (judge/..., summed over the step's trajectories).
        return {**batch.metrics, **judge_step_metrics(batch), **metrics}

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> Path:
        """Checkpoint the run (:func:`~agentloop_trainer.checkpoint.run.save_run_checkpoint`): the
        policy and optimizer, the data position and history, and in the asynchronous modes the
        groups started and not yet trained
        (:meth:`~agentloop_trainer.stages.async_driver.AsyncDriver.state`), which the data position
        alone would skip. Every rank must call it (a collective)."""
        from agentloop_trainer.checkpoint.run import save_run_checkpoint

        tc = self.cfg.trainer
        state = {"data": self.data.state(), "history": self.history,
                 **({"async": self.async_driver.state()} if self.async_driver else {})}
        path = save_run_checkpoint(self.run_dir, self.step, self.model, self.actor.optimizer, state,
                                   tokenizer=self.tokenizer, save_hf=bool(tc.save_hf),
                                   hf_max_shard_bytes=int(tc.hf_max_shard_megabytes) * 2**20, rank=self.rank)
        if self.critic is not None:  # PPO's value model and its optimizer, beside the policy's
            self.critic.save(path)
        return path

    def final_hf_folder(self) -> Path:
        """The policy at the end of the run as a Hugging Face folder
        (:func:`~agentloop_trainer.checkpoint.hf_folder.final_hf_folder`). Every rank must call it."""
        from agentloop_trainer.checkpoint.hf_folder import final_hf_folder

        return final_hf_folder(self.model, self.tokenizer, self.run_dir, self.step,
                               int(self.cfg.trainer.hf_max_shard_megabytes) * 2**20, rank=self.rank)

    def resume(self) -> bool:
        """Load the run's latest checkpoint as ``trainer.resume`` says
        (:func:`~agentloop_trainer.checkpoint.run.load_run_checkpoint`) and continue from its
        state; returns whether one was loaded. Every rank must call this."""
        from agentloop_trainer.checkpoint.common import set_rng_state
        from agentloop_trainer.checkpoint.run import load_run_checkpoint

        loaded = load_run_checkpoint(self.run_dir, self.cfg.trainer.resume, self.model, self.actor.optimizer,
                                     self.world_size)
        if loaded is None:
            return False
        path, state = loaded
        self.step = int(state["step"])
        self.data.load_state(state["data"])
        if self.async_driver is not None:
            self.async_driver.load_state(state.get("async"))
        elif state.get("async") and (state["async"]["open_groups"] or state["async"]["next_records"]) and self.rank == 0:
            lost = len(state["async"]["open_groups"]) + len(state["async"]["next_records"])
            self.log(f"WARNING: {path} was written in an asynchronous trainer.mode with {lost} prompts drawn but not "
                     "yet trained; trainer.mode=sync resumes from the data position and skips them. Resume with the "
                     "trainer.mode it was written with to train them")
        self.history = list(state.get("history", []))
        if self.critic is not None:
            self.critic.load(path)
        set_rng_state(state["rng"])
        self.sync_weights()
        self.log(f"resumed from {path} at step {self.step}")
        return True

    # -- the run --------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Evaluate, train ``trainer.total_steps`` steps, evaluate; write the summary.

        Returns:
            The summary dict (also written to ``summary.json``).
        """
        from tqdm import tqdm

        tc = self.cfg.trainer
        start = time.perf_counter()
        resumed = self.resume()
        end_of_phase(self.device)  # loading's leftovers (checkpoint reads, state-dict copies)
        before = None
        # Rank 0 evaluates (it hosts the fleet).
        if self.fleet is not None and tc.val_before_train and (not resumed or not any("eval/accuracy" in h for h in self.history)):
            before = self.evaluate()
            self.log(f"held-out accuracy before RL: {before.accuracy:.3f} (n={before.n})")
            self._record({"step": self.step, "eval/accuracy": before.accuracy, **_per_template(before)})
            self.watch.after_eval(before, "the held-out evaluation before RL", self.fleet.scorer)
        gen_tokens = gen_seconds = 0.0
        bar = tqdm(total=tc.total_steps, initial=self.step, desc="GRPO", disable=not tc.progress_bar or self.rank != 0)
        while self.step < tc.total_steps:
            m = self.train_step()
            gen_tokens += m["rollout/generated_tokens"]
            gen_seconds += m["timing_s/generate"]
            if self.rank == 0 and tc.test_freq > 0 and self.step % tc.test_freq == 0 and self.step < tc.total_steps:
                ev = self.evaluate()
                m.update({"eval/accuracy": ev.accuracy, **_per_template(ev)})
            self._record(m)
            bar.update(1)
            postfix = {"reward": f"{m['reward/mean']:.3f}"}
            if "eval/accuracy" in m:
                postfix["eval"] = f"{m['eval/accuracy']:.3f}"
            bar.set_postfix(postfix)
            if tc.save_freq > 0 and self.step % tc.save_freq == 0:
                self.save()
        bar.close()
        if tc.save_freq > 0 and self.step % tc.save_freq:
            self.save()  # the end of the run is saved too (with its Hugging Face folder)
        final_hf = self.final_hf_folder()
        if self.rank != 0:
            return {}
        self.log(f"final policy (Hugging Face folder): {final_hf}")
        after = self.evaluate()
        after.rollout = None
        self._record({"step": self.step, "eval/accuracy": after.accuracy, **_per_template(after)})
        self.log(f"held-out accuracy after RL: {after.accuracy:.3f} (n={after.n})")
        # Before RL: this process's evaluation, or the one a resumed run recorded before its
        # first step; none when trainer.val_before_train=false (not the after-RL one).
        first = ({"eval/accuracy": before.accuracy, **_per_template(before)} if before is not None
                 else _pre_rl_record(self.history))
        summary = {
            "eval_accuracy_before": first["eval/accuracy"] if first else None,
            "eval_accuracy_after": after.accuracy,
            "steps": self.step,
            "wall_seconds": time.perf_counter() - start,
            "tokens_per_second": gen_tokens / gen_seconds if gen_seconds else None,
            "held_out_size": after.n,
            "seed": tc.seed,
            "per_template_before": _templates(first) if first else None,
            "per_template_after": after.per_template,
            "fsdp_ranks": tc.fsdp_ranks,
            "final_hf_dir": str(final_hf),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        task = "the calculator task" if not self.cfg.data.train_files else ", ".join(
            sorted({str(r.get("data_source")) for r in self.test_records[:1000]}))
        curve = plot_reward_curve(self.history, self.run_dir / "reward_curve.png",
                                  title=f"agentloop GRPO: {task} ({self.run_dir.name})")
        if self.metrics is not None:
            self.metrics.log_artifact(curve)
            self.metrics.close()
            self.metrics = None
        return summary

    def _record(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        if self.metrics is not None:
            self.metrics.log(metrics, step=int(metrics.get("step", self.step)))

    def close(self) -> None:
        """Stop the engine, end the loggers' runs (a run that failed before the end of
        :meth:`fit`) and leave the one-rank process group an offloaded run joined."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.async_driver is not None:
            self.async_driver.stop()
        if self.fleet is not None:
            self.fleet.close()
        if self.owns_process_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_process_group = False


def _row_advantages(advantages: Any, mask: Any) -> Any:
    """``[B]`` one advantage per row for the trajectory records: the row's own, or with per-turn
    credit (``[B, R]``) the mean over its generated tokens."""
    if advantages.dim() == 1:
        return advantages
    mask = mask.to(advantages.dtype)
    return (advantages * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def _groups_with_signal(rows: Sequence[dict], rewards: np.ndarray) -> float:
    groups: dict[str, list[float]] = {}
    for row, r in zip(rows, rewards, strict=True):
        groups.setdefault(row["group_id"], []).append(float(r))
    return float(np.mean([len(set(v)) > 1 for v in groups.values()]))


def _pre_rl_record(history: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation recorded before the first training step (the pre-RL one), or None."""
    for h in history:
        if "reward/mean" in h:
            return None
        if "eval/accuracy" in h:
            return h
    return None


def _templates(record: dict[str, Any]) -> dict[Any, float]:
    """An evaluation record's per-template accuracies by template (as ``EvalResult.per_template``)."""
    out = {}
    for key, value in record.items():
        if key.startswith("eval/template_"):
            name = key.removeprefix("eval/template_")
            out[int(name) if name.isdigit() else name] = value
    return out


def _per_template(ev: Any) -> dict[str, float]:
    """Accuracy per template (the synthetic task) and each validation set's metrics."""
    return {**{f"eval/template_{k}": v for k, v in ev.per_template.items()},
            **{k: v for k, v in ev.metrics.items() if k.startswith("val/")}}
