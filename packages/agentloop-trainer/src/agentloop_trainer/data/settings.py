"""The ``data`` section: the run's train and held-out rows (verl: ``data``), and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import DEFAULT_RESPONSE_LENGTH
from agentloop_trainer.config_base import require


@dataclass
class DataSection:
    """Datasets (verl: ``data``)."""

    train_files: Any = None
    """Parquet file (or list of files) of training rows; None: the built-in calculator task."""
    val_files: Any = None
    """Parquet file (or list of files) of held-out rows; None: the built-in calculator task.
    Each ``data_source`` among the rows is one validation set, scored by its own scorer and
    reported on its own (``val/<data_source>/pass@k``, ``avg@k``, ``maj@k`` and their ``/se``)."""
    train_size: int = 20000
    """Synthetic training problems."""
    val_size: int = 200
    """Synthetic held-out problems."""
    train_seed: int = 1
    """Seed of the synthetic training split."""
    val_seed: int = 2
    """Seed of the synthetic held-out split (disjoint questions from training are enforced)."""
    train_batch_size: int = 16
    """Prompts per GRPO step."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, counted with the chat template and the rollout's tool schemas."""
    filter_overlong_prompts: bool = True
    """Drop longer prompts (the count is logged and kept in summary.json); false: a longer
    prompt is an error naming the row."""
    max_response_length: int = DEFAULT_RESPONSE_LENGTH
    """Token budget of a trajectory's response (generated, tool and user tokens) and the padded
    response width: the loops' ``response_length`` (verl: ``rollout.response_length``)."""
    shuffle: bool = True
    """Shuffle training rows each epoch."""
    image_key: str = "images"
    """The column holding each row's images (verl's multimodal rows: encoded bytes or paths, as
    ``{"bytes": ..., "path": ...}`` cells); each ``<image>`` marker in the prompt's text takes
    the next one. Rows may also hold image content parts in the prompt itself."""
    return_multi_modal_inputs: bool = True
    """verl's key, accepted for its configs: the rollout's processed images (pixel values and
    grids, computed once per image) always travel with the batch to the update."""



def check(data: DataSection) -> None:
    """Range checks of ``data`` (``reward_model.overlong_buffer.len`` against
    ``max_response_length`` is the reward's check).

    Raises:
        ConfigError: naming the key and what it must be.
    """
    require([("data.train_batch_size", data.train_batch_size >= 1, "at least 1")])
