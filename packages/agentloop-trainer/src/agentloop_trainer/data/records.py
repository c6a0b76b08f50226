"""The run's train and held-out rows: parquet files (``data.train_files`` / ``data.val_files``)
filtered by prompt length, or the built-in calculator task."""

from __future__ import annotations

from typing import Any

from agentloop_trainer.data.settings import DataSection


def load_records(data: DataSection, tokenizer: Any = None, log: Any = None, stats: dict[str, int] | None = None, *,
                 schemas: list[dict[str, Any]] | None = None,
                 need_ground_truth: bool = True) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows: from parquet files when configured, else the synthetic task.

    Held-out synthetic problems whose question also occurs in training are dropped and
    replaced, so the held-out accuracy measures generalisation. With a ``tokenizer``, parquet
    prompts longer than ``data.max_prompt_length`` (rendered with the rollout's tool schemas)
    are dropped with a count (logged, and put in ``stats`` under ``data/dropped_overlong_train``
    and ``data/dropped_overlong_val``), or rejected when ``data.filter_overlong_prompts`` is false.

    Args:
        data: The ``data`` section.
        tokenizer: Renders prompts to count their tokens (None: no length filter).
        log: Where the count of dropped prompts goes (None: nowhere).
        stats: Receives the counts of dropped prompts.
        schemas: The rollout's tool schemas, rendered with each prompt
            (:func:`agentloop_trainer.rollout.run_config.tool_schemas`).
        need_ground_truth: Rows must carry a ground truth (``reward.source`` is not ``loop``).
    """
    if data.train_files or data.val_files:
        if not (data.train_files and data.val_files):
            raise ValueError("set both data.train_files and data.val_files, or neither (the built-in task)")
        from agentloop_trainer.data.rows import limit_prompt_length, read_parquet_files
        need_truth = need_ground_truth
        train = read_parquet_files(data.train_files, "data.train_files", need_ground_truth=need_truth,
                                   image_key=data.image_key)
        test = read_parquet_files(data.val_files, "data.val_files", need_ground_truth=need_truth,
                                  image_key=data.image_key)
        if tokenizer is not None:
            out = []
            for name, key, rows in (("data.train_files", "train", train), ("data.val_files", "val", test)):
                kept, dropped = limit_prompt_length(rows, tokenizer, schemas, data.max_prompt_length,
                                                    data.filter_overlong_prompts, name)
                if stats is not None:
                    stats[f"data/dropped_overlong_{key}"] = dropped
                if dropped and log is not None:
                    log(f"{name}: dropped {dropped} of {len(rows)} prompts longer than "
                        f"data.max_prompt_length={data.max_prompt_length} tokens")
                if not kept:
                    raise ValueError(f"{name}: every prompt is longer than data.max_prompt_length="
                                     f"{data.max_prompt_length}; raise it")
                out.append(kept)
            train, test = out
        return train, test
    from agentloop_trainer.task.calculator import dataset_row, make_problems

    train = make_problems(data.train_size, data.train_seed)
    seen = {p.question for p in train}
    test, seed = [], data.val_seed
    while len(test) < data.val_size:
        fresh = [p for p in make_problems(data.val_size * 2, seed) if p.question not in seen]
        test.extend(fresh[: data.val_size - len(test)])
        seed += 1_000_003
    return [dataset_row(p, "train") for p in train], [dataset_row(p, "test") for p in test]
