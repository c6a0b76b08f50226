"""``agentloop eval`` and ``agentloop rollout``: a checkpoint on the held-out split."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.rollout.rollouts import EvalResult, RolloutFleet, make_rows, tool_schemas


def _tokenizer(cfg: TrainConfig, checkpoint: str | Path) -> Any:
    """The checkpoint's tokenizer (``model.custom_chat_template`` applied), checked to show the
    run's tools to the model before any data or engine is loaded."""
    from agentloop_trainer.policy.chat_templates import check_template_renders_tools
    from agentloop_trainer.policy.tokenizer import load_tokenizer, tokenizer_source

    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
    tokenizer = load_tokenizer(cfg, path)
    check_template_renders_tools(cfg, tokenizer, tokenizer_source(cfg, path), tool_schemas(cfg))
    return tokenizer


def _fleet(cfg: TrainConfig, checkpoint: str | Path, tokenizer: Any) -> RolloutFleet:
    """In-process, or replicas on Ray (``ray.address`` / ``rollout.backend=ray``; the caller
    holds a :func:`~agentloop_trainer.rollout.ray_session.ray_session`)."""
    return RolloutFleet(cfg, checkpoint, tokenizer, name="agentloop-eval")


def evaluate_checkpoint(cfg: TrainConfig, checkpoint: str | Path) -> EvalResult:
    """Greedy accuracy of ``checkpoint`` on the config's held-out split."""
    from agentloop_trainer.data.records import load_records
    from agentloop_trainer.rollout.ray_session import ray_session

    tokenizer = _tokenizer(cfg, checkpoint)
    _, test = load_records(cfg, tokenizer, print)
    with ray_session(cfg, print):
        fleet = _fleet(cfg, checkpoint, tokenizer)
        try:
            return fleet.evaluate(test)
        finally:
            fleet.close()


def write_rollouts(cfg: TrainConfig, checkpoint: str | Path, out: str | Path, num_prompts: int = 16,
                   on_batch: Callable[[list[dict], Any], None] | None = None) -> Path:
    """Sample ``rollout.n`` trajectories for the first ``num_prompts`` held-out prompts and
    write one JSON object per trajectory (token ids and their decoded text, mask, log-probs,
    reward, messages), or per segment of a trajectory whose loop split it (``segment_index`` 0,
    1, ...); ``agentloop view`` renders the file. ``on_batch(rows, batch)`` sees the rolled-out
    ``RolloutBatch`` (the CLI counts its failed samples)."""
    from agentloop_trainer.data.records import load_records
    from agentloop_trainer.rollout.ray_session import ray_session
    from agentloop_trainer.view.viewer import trajectory_records, write_jsonl

    tokenizer = _tokenizer(cfg, checkpoint)
    _, test = load_records(cfg, tokenizer, print)
    with ray_session(cfg, print):
        fleet = _fleet(cfg, checkpoint, tokenizer)
        try:
            rows = make_rows(test[:num_prompts], cfg.actor_rollout_ref.rollout.n, tag="rollout")
            batch = fleet.generate(rows)
        finally:
            fleet.close()
    if on_batch is not None:
        on_batch(rows, batch)
    return write_jsonl(trajectory_records(batch, rows, tokenizer), out)
