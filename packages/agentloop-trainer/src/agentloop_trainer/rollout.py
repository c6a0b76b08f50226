"""Rollouts for training and evaluation: dataset rows through ``AgentLoopManager`` and an
in-process ``HFServer``, with the ``tool_agent`` loop calling the real calculator.

The trainer owns one asyncio event loop for the whole run, so the engine's scheduler, the
rollouts and ``update_weights`` all happen on the same loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop_trainer.reward import answer_reward


@dataclass
class RolloutConfig:
    """How samples are rolled out (verl: ``actor_rollout_ref.rollout``)."""

    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_k: int = 0
    """0: no top-k, so rollout log-probs are of the full distribution the trainer recomputes."""
    top_p: float = 1.0
    """1.0: no nucleus filtering, for the same reason."""
    max_tokens_per_turn: int = 64
    """Most tokens one assistant turn may generate."""
    response_length: int = 128
    """Token budget of the whole response (generated + tool tokens)."""
    prompt_length: int = 512
    """Longest rendered prompt; a longer one fails its sample with an error saying so."""
    max_assistant_turns: int = 3
    """Most model turns per trajectory (a call, then an answer, fits in 2)."""
    sanity_check: str = "ignore_strippable"
    """Delta-tokenization check mode of the tool agent loop."""
    max_batch_size: int = 128
    """Requests the engine decodes together."""
    num_workers: int = 1
    """Rollout workers the manager splits a batch over (verl: ``agent.num_workers``)."""


def rollout_settings(cfg: RolloutConfig, tools: Mapping[str, Any], seed: int | None = None) -> dict[str, Any]:
    """The ``AgentLoopManager`` config for ``cfg`` (tool agent keys included).

    ``seed`` becomes the workers' ``sampling_seed``: each trajectory's sampling seeds then
    follow from it, the step and the row's request id, whichever replica or node serves it.
    """
    return {
        "sampling_seed": seed,
        "default_agent_loop": "tool_agent",
        "tools": dict(tools),
        "tool_reward": "none",
        "response_length": cfg.response_length,
        "prompt_length": cfg.prompt_length,
        "max_assistant_turns": cfg.max_assistant_turns,
        "sanity_check": cfg.sanity_check,
        "sampling_params": {
            "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
            "max_tokens": cfg.max_tokens_per_turn, "logprobs": True,
        },
        "val_sampling_params": {"temperature": 0.0},
        "truncate": True,
    }


def make_rows(records: Sequence[Mapping[str, Any]], n: int, step: int = 0, tag: str = "train") -> list[dict[str, Any]]:
    """Loop rows for dataset ``records``, each repeated ``n`` times with a shared group id.

    Args:
        records: Parquet-layout rows (``prompt``, ``agent_name``, ``reward_model``, ``extra_info``).
        n: Samples per record.
        step: Mixed into request ids so every trajectory of a run has its own.
        tag: Also mixed in (``train``/``eval``). Ids are deterministic, so a resumed run's
            trajectories get the sampling seeds the uninterrupted run's got.
    """
    rows = []
    for i, rec in enumerate(records):
        extra = dict(rec.get("extra_info") or {})
        group = f"{tag}-{step}-{i}"
        for k in range(n):
            rows.append({
                "raw_prompt": list(rec["prompt"]),
                "agent_name": rec.get("agent_name") or "tool_agent",
                "tools_kwargs": dict(extra.get("tools_kwargs") or {}),
                "ground_truth": str(rec["reward_model"]["ground_truth"]),
                "index": extra.get("index", i),
                "template": extra.get("template"),
                "group_id": group,
                "rollout_n": k,
                "request_id": f"{group}-{k}",
            })
    return rows


def score_batch(batch: Any, rows: Sequence[Mapping[str, Any]], tokenizer: Any) -> np.ndarray:
    """0/1 rewards: the generated text (mask-1 tokens only, so a tool result cannot answer for
    the model) must end in ``#### <ground truth>``. Also writes them into ``batch.rewards``."""
    rewards = np.zeros(len(rows), dtype=np.float32)
    for b, row in enumerate(rows):
        if batch.failed[b]:
            continue
        generated = batch.responses[b][batch.response_mask[b] == 1]
        text = tokenizer.decode(generated.tolist(), skip_special_tokens=True)
        rewards[b] = answer_reward(text, row["ground_truth"])
    batch.rewards = rewards
    batch.has_reward = ~np.asarray(batch.failed, dtype=bool)
    return rewards


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


@dataclass
class RayRollout:
    """Where and how the ray backend runs (from the config's ``ray`` section)."""

    model_path: str
    """Checkpoint every replica loads at start (weights are pushed after each update)."""
    tokenizer_path: str
    """Tokenizer folder the rollout workers load."""
    address: str | None = None
    """Cluster to join; None: start a local one."""
    num_cpus: int | None = None
    """CPUs of a local cluster."""
    num_replicas: int = 1
    """Engine replicas."""
    replica_num_cpus: float = 1.0
    """CPUs per replica."""
    replica_num_gpus: float = 0.0
    """GPUs per replica."""
    placement_strategy: str = "PACK"
    """Placement-group strategy of the replicas."""
    worker_placement: str = "spread"
    """Rollout worker placement (see ``AgentLoopManager``)."""
    name: str = "agentloop"
    """Prefix of the replica actors' names."""


class RolloutEngine:
    """The rollout engine(s) plus an ``AgentLoopManager``, driven from synchronous code.

    In-process (default): one ``HFServer`` on this process's event loop. With ``ray``: engine
    replicas as Ray actors in a placement group, one shared routing client actor, and rollout
    workers spread over the cluster's nodes; weight updates go to every replica.

    Args:
        model: The engine's own copy of the policy (in-process; weights are pushed into it
            after updates). Ignored with ``ray`` (replicas load ``ray.model_path``).
        tokenizer: The tokenizer.
        cfg: Rollout settings.
        tools: Tools by name (default: the calculator).
        device: Engine device.
        seed: The run's sampling seed (per-trajectory seeds derive from it).
        ray: Run on Ray instead of in-process.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: RolloutConfig, tools: Mapping[str, Any] | None = None,
                 device: str = "cpu", seed: int = 0, ray: RayRollout | None = None) -> None:
        import agentloop_tools.agent_loop  # noqa: F401  registers "tool_agent"
        from agentloop_core.runtime import AgentLoopManager

        if tools is None:
            from agentloop_trainer.task import calculator_tool

            tools = {"calculator": calculator_tool()}
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.replicas: list[Any] = []
        self.client_actor: Any = None
        settings = rollout_settings(cfg, tools, seed)
        if ray is None:
            from agentloop_engines.hf import HFServer

            self.server = HFServer(model, tokenizer, device=device, max_batch_size=cfg.max_batch_size, seed=seed)
            self.manager = AgentLoopManager(self.server, tokenizer, settings, num_workers=cfg.num_workers)
        else:
            self.server = self._start_ray(ray, cfg, device, seed)
            try:
                self.manager = AgentLoopManager(self.server, ray.tokenizer_path, settings, num_workers=cfg.num_workers,
                                                backend="ray", placement=ray.worker_placement)
            except BaseException:
                self._stop_ray()
                raise

    def _start_ray(self, ray_cfg: RayRollout, cfg: RolloutConfig, device: str, seed: int) -> Any:
        import functools

        from agentloop_engines.hf import HFServer
        from agentloop_engines.ray_hosting import (
            bundle_for,
            check_resources,
            client_actor,
            connect_ray,
            start_replicas,
        )

        connect_ray(ray_cfg.address, num_cpus=ray_cfg.num_cpus)
        # Everything is checked before anything starts: Ray would leave a replica pending forever.
        check_resources([bundle_for(ray_cfg.replica_num_cpus, ray_cfg.replica_num_gpus)] * ray_cfg.num_replicas,
                        strategy=ray_cfg.placement_strategy,
                        what=f"{ray_cfg.num_replicas} engine replicas (actor_rollout_ref.rollout.num_replicas, "
                             "ray.replica_num_cpus, ray.replica_num_gpus)")
        factory = functools.partial(HFServer, ray_cfg.model_path, device=device, max_batch_size=cfg.max_batch_size,
                                    seed=seed)
        self.replicas = start_replicas(factory, ray_cfg.num_replicas, num_cpus=ray_cfg.replica_num_cpus,
                                       num_gpus=ray_cfg.replica_num_gpus, name_prefix=f"{ray_cfg.name}-engine",
                                       placement_strategy=ray_cfg.placement_strategy)
        try:
            import ray

            # One routing view for every worker (global least-in-flight), on the driver's node:
            # a worker node going away must not take the router with it.
            return client_actor(self.replicas, node_id=ray.get_runtime_context().get_node_id())
        except BaseException:
            self._stop_ray()
            raise

    def _stop_ray(self) -> None:
        if self.replicas:
            from agentloop_engines.ray_hosting import stop_replicas

            stop_replicas(self.replicas)
            self.replicas = []
        actor = getattr(self.server, "actor", None)
        if actor is not None:
            import ray

            ray.kill(actor)

    def generate(self, rows: Sequence[Mapping[str, Any]], validate: bool = False, step: int | None = None) -> Any:
        """Roll out ``rows``; returns the scored ``RolloutBatch``."""
        batch = self.loop.run_until_complete(self.manager.agenerate_sequences(rows, validate=validate, step=step))
        score_batch(batch, rows, self.tokenizer)
        return batch

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
        """Greedy accuracy on ``records`` with the full multi-turn loop and the real tool."""
        import time

        start = time.perf_counter()
        rows = make_rows(records, 1, tag="eval")
        batch = self.generate(rows, validate=True)
        per: dict[int, list[float]] = {}
        for row, r in zip(rows, batch.rewards, strict=True):
            if row.get("template") is not None:
                per.setdefault(int(row["template"]), []).append(float(r))
        return EvalResult(
            accuracy=round(float(np.mean(batch.rewards, dtype=np.float64)), 6) if len(rows) else 0.0,
            n=len(rows),
            per_template={k: round(float(np.mean(v)), 6) for k, v in sorted(per.items())},
            generated_tokens=int(batch.response_mask.sum()),
            seconds=time.perf_counter() - start,
        )

    def close(self) -> None:
        """Stop the engine(s) and the event loop."""
        try:
            if self.replicas:
                self._stop_ray()
            else:
                self.loop.run_until_complete(self.server.close())
        finally:
            self.manager.shutdown()
            self.loop.close()
