"""``agentloop eval`` and ``agentloop rollout``: a checkpoint on the held-out split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop_trainer.rollout import EvalResult, RolloutEngine, make_rows


def _tokenizer(cfg: Any, checkpoint: str | Path) -> Any:
    from transformers import AutoTokenizer

    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
    return AutoTokenizer.from_pretrained(str(cfg.model.tokenizer_path or path))


def _engine(cfg: Any, checkpoint: str | Path, tokenizer: Any) -> RolloutEngine:
    """In-process, or replicas on Ray (``ray.address`` / ``rollout.backend=ray``; the caller
    holds a :func:`~agentloop_trainer.trainer.ray_session`)."""
    return RolloutEngine(cfg, checkpoint, tokenizer, name="agentloop-eval")


def evaluate_checkpoint(cfg: Any, checkpoint: str | Path) -> EvalResult:
    """Greedy accuracy of ``checkpoint`` on the config's held-out split."""
    from agentloop_trainer.assets import load_records
    from agentloop_trainer.trainer import ray_session

    tokenizer = _tokenizer(cfg, checkpoint)
    _, test = load_records(cfg, tokenizer, print)
    with ray_session(cfg, print):
        engine = _engine(cfg, checkpoint, tokenizer)
        try:
            return engine.evaluate(test)
        finally:
            engine.close()


def write_rollouts(cfg: Any, checkpoint: str | Path, out: str | Path, num_prompts: int = 16) -> Path:
    """Sample ``rollout.n`` trajectories for the first ``num_prompts`` held-out prompts and
    write one JSON object per trajectory (token ids, mask, log-probs, reward, messages), or per
    segment of a trajectory whose loop split it (``segment_index`` 0, 1, ...)."""
    from agentloop_trainer.assets import load_records
    from agentloop_trainer.trainer import ray_session

    tokenizer = _tokenizer(cfg, checkpoint)
    _, test = load_records(cfg, tokenizer, print)
    with ray_session(cfg, print):
        engine = _engine(cfg, checkpoint, tokenizer)
        try:
            rows = make_rows(test[:num_prompts], cfg.actor_rollout_ref.rollout.n, tag="rollout")
            batch = engine.generate(rows)
        finally:
            engine.close()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    P = batch.prompts.shape[1]
    with out.open("w") as fh:
        for b in range(len(batch)):
            row = rows[int(batch.trajectory_index[b])]
            attn = batch.attention_mask[b]
            n = int(attn[P:].sum())
            record = {
                "group_id": row["group_id"], "rollout_n": row["rollout_n"], "ground_truth": row["ground_truth"],
                "segment_index": int(batch.segment_index[b]),
                "data_source": row.get("data_source"),
                "reward": float(batch.rewards[b]), "failed": bool(batch.failed[b]),
                "prompt_ids": batch.prompts[b][attn[:P] == 1].tolist(),
                "response_ids": batch.responses[b][:n].tolist(),
                "response_mask": batch.response_mask[b][:n].tolist(),
                "rollout_log_probs": None if batch.rollout_log_probs is None else [round(float(x), 6) for x in batch.rollout_log_probs[b][:n]],
                "messages": batch.extra_fields[b].get("messages"),
                "metrics": batch.sample_metrics[b] if batch.sample_metrics else {},
                "reported_metrics": batch.extra_fields[b].get("reported_metrics", []),
            }
            # default=str: what a tool reported is kept even when it is not JSON (a path, a date)
            fh.write(json.dumps(record, default=str) + "\n")
    return out
