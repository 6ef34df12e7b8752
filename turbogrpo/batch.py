"""The ragged layout of a GRPO batch, stated once: K groups (one prompt each) with N completions in
group-major order.

Every per-completion list or tensor of a step (tokens, log-probs, hidden states, advantages, rewards)
is flat in this order; ``Groups`` holds the host offsets that say where each group's completions are,
and is the one place that regroups a flat list, flattens a nested one, or picks groups out.

    groups = Groups([3, 2])            # group 0 has completions 0..2, group 1 has 3..4
    groups.split(flat)                 # [[c0, c1, c2], [c3, c4]]
    sub, index = groups.select([1])    # Groups([2]), [3, 4]
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import TypeVar

T = TypeVar("T")


class Groups:
    """Sizes and host offsets of K groups of completions (group-major; no device data)."""

    __slots__ = ("sizes", "offsets")

    def __init__(self, sizes: Sequence[int]):
        self.sizes = tuple(int(s) for s in sizes)
        """Completions per group, ``[K]``."""
        self.offsets = (0, *accumulate(self.sizes))
        """``[K + 1]``: group k's completions are ``offsets[k]:offsets[k + 1]`` of the flat order."""

    @classmethod
    def of(cls, nested: Sequence[Sequence]) -> Groups:
        """The layout of a per-group nested list."""
        return cls([len(group) for group in nested])

    @classmethod
    def uniform(cls, num_groups: int, size: int) -> Groups:
        """K groups of G completions each (a rollout's layout)."""
        return cls([size] * num_groups)

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    @property
    def num_completions(self) -> int:
        return self.offsets[-1]

    def group(self, g: int) -> range:
        """Flat positions of group ``g``'s completions."""
        return range(self.offsets[g], self.offsets[g + 1])

    def split(self, flat: Sequence[T]) -> list[list[T]]:
        """A flat per-completion sequence (length N) as per-group lists."""
        if len(flat) != self.num_completions:
            raise ValueError(f"got {len(flat)} items for {self.num_completions} completions")
        return [list(flat[start:stop]) for start, stop in zip(self.offsets, self.offsets[1:])]

    @staticmethod
    def flatten(nested: Sequence[Sequence[T]]) -> list[T]:
        """Per-group lists as one flat, group-major list."""
        return [item for group in nested for item in group]

    def select(self, keep: Sequence[int]) -> tuple[Groups, list[int]]:
        """The layout of groups ``keep`` (in that order) and their completions' flat positions here."""
        return Groups([self.sizes[g] for g in keep]), [i for g in keep for i in self.group(g)]

    def __eq__(self, other) -> bool:
        return isinstance(other, Groups) and self.sizes == other.sizes

    def __repr__(self) -> str:
        return f"Groups({list(self.sizes)})"
