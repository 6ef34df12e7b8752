"""Splitting a step's groups into micro-batches by token budget, and padding their log-probs.

A micro-batch is a list of chunks; a chunk is one group's prompt with a run of its completions, so
with the shared-prefix forward it costs ``P + sum(S_i)`` tokens. Whole groups are packed while they
fit; a group larger than the budget is cut into runs of completions, each carrying the prompt again
(the gradient is a sum over completions, so any cut gives the same total).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from turbogrpo.batch import Layout as Groups


class Chunk(NamedTuple):
    """Completions ``start..stop-1`` of group ``group``."""

    group: int
    start: int
    stop: int


class MicroBatch(NamedTuple):
    """One forward/backward's share of the step batch.

    chunks: the (group, completion run) pieces it holds.
    index: [B] positions of its completions in the step's flat, group-major completion order.
    weight: 1.0, or 0.0 for a filler micro-batch that only keeps collective calls matched across ranks.
    """

    chunks: list[Chunk]
    index: list[int]
    weight: float


def plan_micro_batches(prompt_lengths: Sequence[int], completion_lengths: Sequence[Sequence[int]],
                       token_budget: int) -> list[MicroBatch]:
    """Greedy packing of groups, in order, into micro-batches of at most ``token_budget`` tokens.

    A group is kept whole when it fits in a fresh micro-batch; a larger one is cut into runs of
    completions that fit with the prompt. A prompt plus one completion over the budget runs alone.
    """
    offsets = Groups.of(completion_lengths).offsets
    batches: list[MicroBatch] = []
    current: list[Chunk] = []
    used = 0

    def add(chunk: Chunk, cost: int) -> None:
        nonlocal used
        current.append(chunk)
        used += cost

    def close() -> None:
        nonlocal current, used
        if current:
            index = [offsets[c.group] + i for c in current for i in range(c.start, c.stop)]
            batches.append(MicroBatch(current, index, 1.0))
        current, used = [], 0

    for group, (prompt_len, lengths) in enumerate(zip(prompt_lengths, completion_lengths)):
        whole = prompt_len + sum(lengths)
        if used + whole > token_budget:
            close()
        if whole <= token_budget:
            add(Chunk(group, 0, len(lengths)), whole)
            continue
        start = 0
        while start < len(lengths):
            stop, cost = start, prompt_len
            while stop < len(lengths) and cost + lengths[stop] <= token_budget:
                cost += lengths[stop]
                stop += 1
            if stop == start:  # one completion alone is over budget: it still has to run
                cost += lengths[stop]
                stop += 1
            close()
            add(Chunk(group, start, stop), cost)
            start = stop
    close()
    return batches


def pad_to_count(batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """Append zero-weight copies of the last micro-batch up to ``count`` (ranks must run equally many)."""
    assert batches and count >= len(batches)
    filler = batches[-1]._replace(weight=0.0)
    return batches + [filler] * (count - len(batches))


def pad_ragged(rows: Sequence[Tensor]) -> Tensor:
    """Right-pad 1-D tensors with 0 into ``[B, L]`` (L = the longest row); differentiable."""
    return pad_sequence(list(rows), batch_first=True, padding_value=0.0)


def length_mask(lengths: Sequence[int], device: torch.device) -> Tensor:
    """``[B, L]`` float mask, 1 on the first ``lengths[b]`` positions of row b."""
    lengths_B = torch.tensor(lengths, device=device)
    positions_L = torch.arange(max(lengths), device=device)
    return (positions_L[None, :] < lengths_B[:, None]).float()
