"""Rollouts for training and evaluation: dataset rows through ``AgentLoopManager`` and an
in-process ``HFServer``, with the ``tool_agent`` loop calling the real calculator.

The trainer owns one asyncio event loop for the whole run, so the engine's scheduler, the
rollouts and ``update_weights`` all happen on the same loop.
"""

from __future__ import annotations

import asyncio
import uuid
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


def rollout_settings(cfg: RolloutConfig, tools: Mapping[str, Any]) -> dict[str, Any]:
    """The ``AgentLoopManager`` config for ``cfg`` (tool agent keys included)."""
    return {
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


def make_rows(records: Sequence[Mapping[str, Any]], n: int, step: int = 0) -> list[dict[str, Any]]:
    """Loop rows for dataset ``records``, each repeated ``n`` times with a shared group id.

    Args:
        records: Parquet-layout rows (``prompt``, ``agent_name``, ``reward_model``, ``extra_info``).
        n: Samples per record.
        step: Mixed into request ids so every trajectory has its own.
    """
    rows = []
    for i, rec in enumerate(records):
        extra = dict(rec.get("extra_info") or {})
        group = f"{step}-{i}-{uuid.uuid4().hex[:8]}"
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


class RolloutEngine:
    """An in-process ``HFServer`` plus an ``AgentLoopManager``, driven from synchronous code.

    Args:
        model: The engine's own copy of the policy (weights are pushed into it after updates).
        tokenizer: The tokenizer.
        cfg: Rollout settings.
        tools: Tools by name (default: the calculator).
        device: Engine device.
        seed: Seeds the engine's per-request sampling seeds.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: RolloutConfig, tools: Mapping[str, Any] | None = None,
                 device: str = "cpu", seed: int = 0) -> None:
        import agentloop_tools.agent_loop  # noqa: F401  registers "tool_agent"
        from agentloop_core.runtime import AgentLoopManager
        from agentloop_engines.hf import HFServer

        if tools is None:
            from agentloop_trainer.task import calculator_tool

            tools = {"calculator": calculator_tool()}
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.server = HFServer(model, tokenizer, device=device, max_batch_size=cfg.max_batch_size, seed=seed)
        self.manager = AgentLoopManager(self.server, tokenizer, rollout_settings(cfg, tools), num_workers=cfg.num_workers)

    def generate(self, rows: Sequence[Mapping[str, Any]], validate: bool = False, step: int | None = None) -> Any:
        """Roll out ``rows``; returns the scored ``RolloutBatch``."""
        batch = self.loop.run_until_complete(self.manager.agenerate_sequences(rows, validate=validate, step=step))
        score_batch(batch, rows, self.tokenizer)
        return batch

    def update_weights(self, named_tensors: Any) -> None:
        """Push new policy weights into the engine."""
        self.loop.run_until_complete(self.server.update_weights(named_tensors))

    def evaluate(self, records: Sequence[Mapping[str, Any]]) -> EvalResult:
        """Greedy accuracy on ``records`` with the full multi-turn loop and the real tool."""
        import time

        start = time.perf_counter()
        rows = make_rows(records, 1)
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
        """Stop the engine and the event loop."""
        try:
            self.loop.run_until_complete(self.server.close())
        finally:
            self.manager.shutdown()
            self.loop.close()
