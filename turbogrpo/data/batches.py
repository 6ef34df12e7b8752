"""Seeded, endless, resumable batches of prompts.

Each epoch visits every example once in an order fixed by (seed, epoch). A batch that runs past
the end of an epoch continues into the next one, so every batch is full. The position is two ints
(epoch, offset), so a checkpoint stores it and a resumed run yields exactly the batches the
uninterrupted run would have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The visiting order of epoch ``epoch``; the same on every platform and Python version."""
    order = list(range(num_examples))
    random.Random(f"turbogrpo-batches:{seed}:{epoch}").shuffle(order)
    return order


class PromptBatches(Generic[T], Iterator[list[T]]):
    """Endless iterator of ``batch_size`` examples; ``state_dict()`` / ``load_state_dict()`` resume it."""

    def __init__(self, examples: Sequence[T], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if not examples:
            raise ValueError("no prompts to batch: the prompt set is empty (all rows skipped?)")
        if not 1 <= batch_size <= len(examples):
            raise ValueError(f"batch_size must be between 1 and the number of prompts ({len(examples)}), "
                             f"got {batch_size}")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # examples of the current epoch already handed out
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if self.shuffle:
            return epoch_order(len(self.examples), self.seed, self.epoch)
        return list(range(len(self.examples)))

    def __next__(self) -> list[T]:
        batch = []
        while len(batch) < self.batch_size:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._make_order()
            take = self._order[self.offset:self.offset + self.batch_size - len(batch)]
            batch += [self.examples[i] for i in take]
            self.offset += len(take)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset,
                "num_examples": len(self.examples), "batch_size": self.batch_size, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``, which must come from batches over the same prompts and settings."""
        expected = {"seed": self.seed, "num_examples": len(self.examples), "batch_size": self.batch_size,
                    "shuffle": int(self.shuffle)}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"data position was saved with {key}={state.get(key)}, but this run has "
                                 f"{key}={value}; resume with the same data and settings")
        if not 0 <= state["offset"] <= len(self.examples) or state["epoch"] < 0:
            raise ValueError(f"data position epoch={state['epoch']} offset={state['offset']} is out of range")
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._make_order()
