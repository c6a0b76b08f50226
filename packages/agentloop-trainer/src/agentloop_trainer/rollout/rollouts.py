"""Rollouts for training and evaluation: dataset rows through ``AgentLoopManager`` and the
configured engine, with the configured loops, tools and reward.

The trainer owns one asyncio event loop for the whole run, so the engine's scheduler, the
rollouts and ``update_weights`` all happen on the same loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentloop_core.vision.processor import load_vision_processor
from agentloop_trainer.data.rows import normalize_messages
from agentloop_trainer.reward.group_judge import GroupJudge
from agentloop_trainer.rollout.settings import RaySection, RolloutSection, uses_ray

if TYPE_CHECKING:
    from agentloop_core.engine_registry import EngineConfig
    from agentloop_core.settings import RolloutConfig


def make_rows(records: Sequence[Mapping[str, Any]], n: int, step: int = 0, tag: str = "train") -> list[dict[str, Any]]:
    """Loop rows for dataset ``records``, each repeated ``n`` times with a shared group id.

    Every column reaches the loop and the reward: ``prompt`` (as ``raw_prompt``), ``agent_name``,
    ``data_source``, ``reward_model``, ``extra_info`` and, from it (or a top-level column),
    ``tools_kwargs`` (all four lifecycle parts) and ``interaction_kwargs``.

    Args:
        records: Parquet-layout rows.
        n: Samples per record.
        step: Mixed into request ids so every trajectory of a run has its own.
        tag: Also mixed in (``train``/``eval``). Ids are deterministic, so a resumed run's
            trajectories get the sampling seeds the uninterrupted run's got.
    """
    rows = []
    for i, rec in enumerate(records):
        extra = dict(rec.get("extra_info") or {})
        tools_kwargs = {k: v for k, v in dict(extra.get("tools_kwargs") or rec.get("tools_kwargs") or {}).items()
                        if v is not None}
        interaction_kwargs = dict(extra.get("interaction_kwargs") or rec.get("interaction_kwargs") or {})
        reward_model = dict(rec.get("reward_model") or {})
        group = f"{tag}-{step}-{i}"
        prompt = normalize_messages(rec["prompt"], f"row {extra.get('index', i)} prompt")
        for k in range(n):
            row = {
                "raw_prompt": [dict(m) for m in prompt],
                "data_source": rec.get("data_source"),
                "reward_model": reward_model,
                "ground_truth": reward_model.get("ground_truth"),
                "extra_info": extra,
                "tools_kwargs": tools_kwargs,
                "interaction_kwargs": interaction_kwargs,
                "index": extra.get("index", i),
                "template": extra.get("template"),
                "group_id": group,
                "rollout_n": k,
                "request_id": f"{group}-{k}",
            }
            if rec.get("agent_name"):
                row["agent_name"] = rec["agent_name"]
            rows.append(row)
    return rows


def attach_rewards(batch: Any) -> np.ndarray:
    """The batch's rewards (set per trajectory by the reward hook as it finished); failed
    samples get 0 and no reward."""
    batch.has_reward = ~np.asarray(batch.failed, dtype=bool)
    batch.rewards = np.where(batch.has_reward, batch.rewards, 0.0).astype(np.float32)
    return batch.rewards


@dataclass
class EvalResult:
    """Greedy accuracy on a held-out split."""

    accuracy: float
    """Fraction of problems answered correctly."""
    n: int
    """Problems evaluated."""
    per_template: dict[int, float] = field(default_factory=dict)
    """Accuracy per problem template (synthetic task only)."""
    generated_tokens: int = 0
    """Tokens the engine generated."""
    seconds: float = 0.0
    """Wall time."""
    num_failed: int = 0
    """Samples whose trajectory or reward failed (counted as 0)."""
    errors: list[str] = field(default_factory=list)
    """The error of each failed sample."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The rollout's batch metrics (``rollout/truncated/*``, tool calls...)."""
    rollout: Any = field(default=None, repr=False, compare=False)
    """``(rows, batch)`` as rolled out, for diagnostics (:mod:`agentloop_trainer.rollout.diagnostics`)."""


class RolloutFleet:
    """The rollout engine(s) plus an ``AgentLoopManager``, driven from synchronous code.

    In-process (default): the engine named by ``rollout.name`` on this process's event loop
    (or a routing client over ``rollout.server_urls``). On Ray (``rollout.backend=ray`` or
    ``ray.address``): engine replicas as Ray actors in a placement group, one shared routing
    client actor, and rollout workers spread over the cluster's nodes. Weight updates go to
    every engine.

    Args:
        rollout: The ``actor_rollout_ref.rollout`` section.
        model_path: The starting checkpoint (engines that load by path, Ray replicas).
        tokenizer: The tokenizer.
        engine_model: The in-process engine's own copy of the policy (weights are pushed into
            it after updates) instead of loading ``model_path`` again; used only by an engine
            whose plug-in declares ``capabilities.policy_copy``.
        name: Prefix of the Ray replica actors' names.
        tracer: The rollout tracer (:func:`agentloop_trainer.rollout.tracing.rollout_tracer`); None:
            no tracing.
        record: What the manager (and through it every worker and loop) runs with
            (:func:`agentloop_trainer.rollout.run_config.rollout_config`).
        engine: What the engine (each replica) is built from
            (:func:`agentloop_trainer.rollout.engines.engine_config`).
        ray: The ``ray`` section (used on Ray: ``rollout.backend=ray`` or ``ray.address``).
        mode: ``trainer.mode``: sync, or an asynchronous mode whose weight updates interrupt
            or wait for generations.
        tokenizer_path: ``model.tokenizer_path`` (None: ``model_path``), for workers and the
            vision processor that load it by path.
    """

    def __init__(self, rollout: RolloutSection, model_path: str | Path, tokenizer: Any, engine_model: Any = None,
                 name: str = "agentloop", tracer: Any = None, *, record: RolloutConfig, engine: EngineConfig,
                 ray: RaySection, mode: str = "sync", tokenizer_path: str | None = None) -> None:
        from agentloop_core.runtime import AgentLoopManager
        from agentloop_trainer.rollout.engines import build_engine, remote_engines

        self.tokenizer = tokenizer
        self.replicas: list[Any] = []
        r = rollout
        self.n = r.n
        self.val_n = r.val_kwargs.n
        on_ray = uses_ray(r, ray)
        self.rollout_config = record
        """The record the manager (and through it every worker and loop) runs with."""
        self.scorer = self.rollout_config.reward_fn
        # A wrong reward path or signature fails here, not in every sample of the first step.
        self.scorer.function_for(None)
        self.engine_config = engine
        self.loop = asyncio.new_event_loop()
        self.server: Any = None
        """The engine, a routing client over remote servers or Ray replicas, or a wrapper over one
        of them (set below; None only while starting)."""
        self._remote: list[Any] = []
        """The clients of ``server_urls``' servers, which this object made and closes."""
        try:
            if r.server_urls:
                self.server = remote_engines(r)
                self._remote = list(self.server.replicas)
            elif on_ray:
                self.server = self._start_ray(ray, r.num_replicas, mode)
            else:
                # The policy copy reaches only an engine declaring capabilities.policy_copy.
                self.server = build_engine(self.engine_config, model=engine_model, tokenizer=tokenizer)
        except BaseException:
            self.loop.close()
            raise
        self.control: Any = None
        """The asynchronous driver's :class:`~agentloop_core.partial_rollout.RolloutControl`
        (None in ``trainer.mode=sync``)."""
        if mode != "sync":
            from agentloop_core.partial_rollout import LocalRolloutControl, PartialRolloutServer

            # Weight updates then happen between engine calls: interrupted and resumed (async),
            # or after in-flight calls finish (one_step_off); tokens record their policy version
            # (in the ledger only for the request ids the driver tracks: not evaluation ones).
            # On Ray the wrapper lives in the shared client actor (_start_ray), where every
            # worker's calls pass; a wrapper here would be pickled into each worker, one gate
            # and one ledger per worker, none of them the one the driver pauses.
            if on_ray:
                self.control = self.server
            else:
                self.server = PartialRolloutServer(self.server, interrupt=mode == "async")
                self.control = LocalRolloutControl(self.server)
        elif not on_ray:
            from agentloop_core.server_wrapper import BusyTimeServer

            # Times the engine's work for each step's rollout/engine_idle_fraction. On Ray the
            # calls come from the workers' processes: the shared client actor times them.
            self.server = BusyTimeServer(self.server)
        self.group_judge = GroupJudge.of(self.scorer)
        """Judges each group after its rollout (``reward.judge.mode=group``); None otherwise."""
        judge = self.scorer.judge_client
        if judge is not None and judge.settings.url == "policy":
            # Through the wrappers, so weight updates pause judge calls as they pause rollouts.
            # The in-process workers share this scorer (url=policy is refused on Ray at load).
            judge.policy_server = self.server
        try:
            if on_ray:
                self.manager = AgentLoopManager(self.server, str(tokenizer_path or model_path),
                                                self.rollout_config,
                                                num_workers=r.agent.num_workers, backend="ray",
                                                placement=ray.worker_placement, tracer=tracer)
            else:
                # Ray workers load the vision processor with the tokenizer, from the folder.
                processor = load_vision_processor(str(tokenizer_path or model_path), tokenizer)
                self.manager = AgentLoopManager(self.server, tokenizer, self.rollout_config,
                                                num_workers=r.agent.num_workers, processor=processor,
                                                tracer=tracer)
        except BaseException:
            self._stop_engines()
            self.loop.close()
            raise

    def _start_ray(self, rc: RaySection, num: int, mode: str) -> Any:
        from agentloop_engines.fleet.hosting import (
            bundle_for,
            check_resources,
            client_actor,
            connect_ray,
            start_replicas,
        )
        from agentloop_trainer.rollout.engines import engine_factory

        connect_ray(rc.address, num_cpus=rc.num_cpus, listen_on_network=rc.listen_on_network)
        # Everything is checked before anything starts: Ray would leave a replica pending forever.
        check_resources([bundle_for(rc.replica_num_cpus, rc.replica_num_gpus)] * num, strategy=rc.placement_strategy,
                        what=f"{num} engine replicas (actor_rollout_ref.rollout.num_replicas, "
                             "ray.replica_num_cpus, ray.replica_num_gpus)")
        self.replicas = start_replicas(engine_factory(self.engine_config), num, num_cpus=rc.replica_num_cpus,
                                       num_gpus=rc.replica_num_gpus, name_prefix=f"{self.engine_config.name}-engine",
                                       placement_strategy=rc.placement_strategy)
        try:
            import ray

            # One routing view for every worker (global least-in-flight), on the driver's node:
            # a worker node going away must not take the router with it.
            return client_actor(self.replicas, node_id=ray.get_runtime_context().get_node_id(),
                                partial_rollout=mode != "sync", interrupt=mode == "async")
        except BaseException:
            self._stop_engines()
            raise

    def _stop_engines(self) -> None:
        if self.replicas:
            from agentloop_engines.fleet.hosting import stop_replicas

            stop_replicas(self.replicas)
            self.replicas = []
            actor = getattr(self.server, "actor", None)
            if actor is not None:
                import ray

                ray.kill(actor)
        elif self.server is not None:
            self.loop.run_until_complete(self.server.close())
            for client in self._remote:  # sends what it still has to (forget_session ids), closes its connections
                self.loop.run_until_complete(client.close())

    def generate(self, rows: Sequence[Mapping[str, Any]], validate: bool = False, step: int | None = None) -> Any:
        """Roll out ``rows``; returns the ``RolloutBatch`` with rewards (0 for failed samples),
        one row per trajectory segment (``batch.trajectory_index`` maps rows back to ``rows``)."""
        if self.group_judge is not None:  # the group judge needs the outputs before they are padded
            return self.batch_from_outputs(self.generate_outputs(rows, step=step, validate=validate))
        batch = self.loop.run_until_complete(self.manager.agenerate_sequences(rows, validate=validate, step=step))
        attach_rewards(batch)
        return batch

    def generate_outputs(self, rows: Sequence[Mapping[str, Any]], step: int | None = None,
                         validate: bool = False) -> list[Any]:
        """Roll out training ``rows`` into their ``AgentLoopOutput`` records (each with its
        ``trajectory_index`` into ``rows``), for a caller that looks at whole groups before
        batching them (:mod:`agentloop_trainer.rollout.dynamic_sampling`): then
        :meth:`batch_from_outputs`. With the group judge, each group is judged here."""
        outputs = self.loop.run_until_complete(self.manager.agenerate_outputs(rows, validate=validate, step=step))
        if self.group_judge is not None:
            self.loop.run_until_complete(self.group_judge.score(rows, outputs, self.tokenizer))
        return outputs

    def batch_from_outputs(self, outputs: Sequence[Any]) -> Any:
        """Pad outputs into a ``RolloutBatch`` as :meth:`generate` does (the run's prompt and
        response widths), with rewards (0 for failed samples)."""
        from agentloop_core.batch import RolloutBatch

        config = self.rollout_config
        batch = RolloutBatch.from_outputs(
            outputs, prompt_length=config.prompt_length, response_length=config.response_length,
            pad_token_id=config.pad_token_id, tokenizer=self.tokenizer, truncate=config.truncate)
        attach_rewards(batch)
        return batch

    def busy_seconds(self) -> float | None:
        """Wall seconds so far with at least one engine call in flight: measured where every
        call passes (a wrapper in this process, or on Ray the shared client actor); None for
        a server that does not measure it."""
        busy: Callable[[], float | Awaitable[float]] | None = getattr(self.server, "busy_seconds", None)
        if not callable(busy):
            return None
        out = busy()
        return float(self.loop.run_until_complete(out) if inspect.isawaitable(out) else out)

    @property
    def can_sleep(self) -> bool:
        """Whether the engine frees its memory on ``sleep`` (HFServer: on CUDA only)."""
        caps = getattr(self.server, "capabilities", None)
        return bool(caps is not None and caps.sleep)

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the update (no-op when unsupported)."""
        if self.can_sleep:
            self.loop.run_until_complete(self.server.sleep())

    def wake_up(self) -> None:
        """Bring a sleeping engine back (no-op when unsupported)."""
        if self.can_sleep:
            self.loop.run_until_complete(self.server.wake_up())

    def update_weights(self, named_tensors: Any) -> None:
        """Push new policy weights into the engine (every replica)."""
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        self.loop.run_until_complete(self.server.update_weights(items))

    def evaluate(self, records: Sequence[Mapping[str, Any]]) -> EvalResult:
        """Held-out mean reward (the accuracy for 0/1 rewards) with the full multi-turn loop,
        the run's tools and reward, and ``rollout.val_kwargs`` sampling."""
        import time

        from agentloop_trainer.reward.judge_client import judge_step_metrics
        from agentloop_trainer.rollout.diagnostics import batch_errors

        start = time.perf_counter()
        rows = make_rows(records, self.val_n, tag="eval")
        batch = self.generate(rows, validate=True)
        last = batch.last_segment_rows()
        rewards = batch.rewards[last]  # one per trajectory, in row order
        per: dict[int, list[float]] = {}
        for t, r in zip(batch.trajectory_index[last].tolist(), rewards, strict=True):
            row = rows[t]
            if row.get("template") is not None:
                per.setdefault(int(row["template"]), []).append(float(r))
        return EvalResult(
            accuracy=round(float(np.mean(rewards, dtype=np.float64)), 6) if len(rows) else 0.0,
            n=len(rows),
            per_template={k: round(float(np.mean(v)), 6) for k, v in sorted(per.items())},
            generated_tokens=int(batch.response_mask.sum()),
            seconds=time.perf_counter() - start,
            num_failed=int(batch.num_failed),
            errors=batch_errors(batch),
            metrics={**batch.metrics, **judge_step_metrics(batch)},
            rollout=(rows, batch),
        )

    def close(self) -> None:
        """Stop the engine(s) and the event loop."""
        try:
            self._stop_engines()
        finally:
            self.manager.shutdown()
            self.loop.close()
