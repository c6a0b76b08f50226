"""Datasets in verl's layout: parquet rows checked, GSM8K converted, the run's train and held-out
rows, and the training batches.

- :mod:`~agentloop_trainer.data.rows`: reading, checking and writing rows; prompt lengths.
- :mod:`~agentloop_trainer.data.gsm8k`: ``agentloop data gsm8k``.
- :mod:`~agentloop_trainer.data.records`: the run's rows (:func:`load_records`).
- :mod:`~agentloop_trainer.data.iterator`: :class:`DataIterator`.
"""

from agentloop_trainer.data.gsm8k import (
    GSM8K_HUB_FILES,
    GSM8K_SYSTEM,
    convert_gsm8k,
    gsm8k_row,
    parse_gsm8k_answer,
    read_gsm8k_jsonl,
)
from agentloop_trainer.data.iterator import DataIterator
from agentloop_trainer.data.records import load_records
from agentloop_trainer.data.rows import (
    check_row,
    limit_prompt_length,
    normalize_content,
    normalize_messages,
    prompt_lengths,
    read_parquet_files,
    read_parquet_rows,
    write_parquet_rows,
)

__all__ = [
    "DataIterator",
    "GSM8K_HUB_FILES",
    "GSM8K_SYSTEM",
    "check_row",
    "convert_gsm8k",
    "gsm8k_row",
    "limit_prompt_length",
    "load_records",
    "normalize_content",
    "normalize_messages",
    "parse_gsm8k_answer",
    "prompt_lengths",
    "read_gsm8k_jsonl",
    "read_parquet_files",
    "read_parquet_rows",
    "write_parquet_rows",
]
