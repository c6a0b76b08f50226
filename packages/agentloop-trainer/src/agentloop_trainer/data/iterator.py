"""The training rows in batches: epoch-shuffled, with a position a checkpoint saves."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Generic, TypeVar

RecordT = TypeVar("RecordT")
"""What one training item is: a row dict (GRPO) or a tokenized conversation (SFT)."""


class DataIterator(Generic[RecordT]):
    """Epoch-shuffled batches of training rows with a resumable position."""

    def __init__(self, records: Sequence[RecordT], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size > len(records):
            raise ValueError(f"data.train_batch_size={batch_size} exceeds the {len(records)} training rows")
        self.records, self.batch_size, self.seed, self.shuffle = list(records), batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        """The next ``batch_size`` rows as indices into ``records`` (a new epoch starts when too
        few remain); the asynchronous trainer checkpoints rows by these indices."""
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return list(idx)

    def next_batch(self) -> list[RecordT]:
        """The next ``batch_size`` rows (a new epoch starts when too few remain)."""
        return [self.records[i] for i in self.next_indices()]

    def state(self) -> dict[str, int]:
        """Position to save in a checkpoint."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
