"""The run's train and held-out rows: parquet files (``data.train_files`` / ``data.val_files``)
filtered by prompt length, or the built-in calculator task."""

from __future__ import annotations

from typing import Any

from agentloop_trainer.config.sections import TrainConfig


def load_records(cfg: TrainConfig, tokenizer: Any = None, log: Any = None,
                 stats: dict[str, int] | None = None) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows: from parquet files when configured, else the synthetic task.

    Held-out synthetic problems whose question also occurs in training are dropped and
    replaced, so the held-out accuracy measures generalisation. With a ``tokenizer``, parquet
    prompts longer than ``data.max_prompt_length`` (rendered with the rollout's tool schemas)
    are dropped with a count (logged, and put in ``stats`` under ``data/dropped_overlong_train``
    and ``data/dropped_overlong_val``), or rejected when ``data.filter_overlong_prompts`` is false.
    """
    if cfg.data.train_files or cfg.data.val_files:
        if not (cfg.data.train_files and cfg.data.val_files):
            raise ValueError("set both data.train_files and data.val_files, or neither (the built-in task)")
        from agentloop_trainer.data.rows import limit_prompt_length, read_parquet_files
        from agentloop_trainer.rollout.rollouts import tool_schemas

        need_truth = cfg.reward.source != "loop"
        train = read_parquet_files(cfg.data.train_files, "data.train_files", need_ground_truth=need_truth,
                                   image_key=cfg.data.image_key)
        test = read_parquet_files(cfg.data.val_files, "data.val_files", need_ground_truth=need_truth,
                                  image_key=cfg.data.image_key)
        if tokenizer is not None:
            schemas = tool_schemas(cfg)
            out = []
            for name, key, rows in (("data.train_files", "train", train), ("data.val_files", "val", test)):
                kept, dropped = limit_prompt_length(rows, tokenizer, schemas, cfg.data.max_prompt_length,
                                                    cfg.data.filter_overlong_prompts, name)
                if stats is not None:
                    stats[f"data/dropped_overlong_{key}"] = dropped
                if dropped and log is not None:
                    log(f"{name}: dropped {dropped} of {len(rows)} prompts longer than "
                        f"data.max_prompt_length={cfg.data.max_prompt_length} tokens")
                if not kept:
                    raise ValueError(f"{name}: every prompt is longer than data.max_prompt_length="
                                     f"{cfg.data.max_prompt_length}; raise it")
                out.append(kept)
            train, test = out
        return train, test
    from agentloop_trainer.task.calculator import dataset_row, make_problems

    train = make_problems(cfg.data.train_size, cfg.data.train_seed)
    seen = {p.question for p in train}
    test, seed = [], cfg.data.val_seed
    while len(test) < cfg.data.val_size:
        fresh = [p for p in make_problems(cfg.data.val_size * 2, seed) if p.question not in seen]
        test.extend(fresh[: cfg.data.val_size - len(test)])
        seed += 1_000_003
    return [dataset_row(p, "train") for p in train], [dataset_row(p, "test") for p in test]
