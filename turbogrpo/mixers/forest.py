"""The layout a stateful token mixer (linear attention, Mamba-2, short convolution) runs shared.

Attention layers see a shared prompt or trie node through their attention plan; a recurrent layer sees it
through its *state*. A pack (or a trie) is a forest of *segments*, contiguous runs of the flat token axis:
a root segment (a prompt, a trie root) starts from the zero state, and every other segment continues from
its parent's final state (a completion from its prompt's, a trie child from its parent node's). That is
exact: a segment's final state depends on its own path alone, and every child of a segment continues from
the same state, so it is computed once and read by all of them (its gradient sums over the children).

:class:`SegmentForest` holds what the mixers need, on the device, built once per pack or trie:

* ``levels``: the segments level by level (roots first), each level as blocks of padded ``[R, W]`` rows of
  flat indices, plus the row of each segment's parent in the level above. A recurrent mixer runs one batched
  call per block (:func:`scan_levels`), from the final states of the level above. A level's segments are
  bucketed by length (powers of two), so that padding at most doubles a row, as the tree attention's cascade
  does;
* ``taps(K)``: for every token, the flat indices of the ``K`` tokens ending at it along its path (-1 before a
  root's first token). A causal convolution of width ``K`` reads them in one gather for the whole forest:
  the taps of a child's first tokens reach into its parent's last ones, which is the convolution's state.

Host syncs: none. Every index is built on the host from host ints (the segment lengths) and uploaded once.

Shape legend: N flat tokens, S segments, R rows (segments) of one block, W its longest segment, K a
convolution's width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from turbogrpo.device_index import upload


class Block(NamedTuple):
    """Segments of one depth of the forest, of similar lengths, as padded rows (right-padded: a pad slot follows
    every real token of its row, so a causal recurrence never carries it into a real token)."""

    rows: torch.Tensor                # [R, W] flat index of each slot (pad slots read token 0)
    valid: torch.Tensor               # [R, W] bool: real slots
    slots: torch.Tensor               # [n] the real slots of ``rows.flatten()``, row by row
    parent_rows: torch.Tensor | None  # [R] row of each segment's parent among the level above's (None: roots)


Level = tuple[Block, ...]   # a depth's blocks; its rows are theirs in turn


@dataclass(frozen=True, eq=False)
class SegmentForest:
    """Segments of a flat token axis, each continuing its parent's state (see the module docstring)."""

    num_tokens: int
    predecessor: torch.Tensor         # [N] host long: the token before each token on its path, -1 at a root's first
    levels: tuple[Level, ...]
    order: torch.Tensor               # [N] device long: where each flat token sits in the levels' real slots, in turn
    device: torch.device
    _taps: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def build(starts, lengths, parents, device: torch.device) -> SegmentForest:
        """The forest of segments ``[starts[s], starts[s] + lengths[s])`` with parent segment ``parents[s]``
        (-1: a root); a parent precedes its children. Host ints in, device indices out."""
        depth: list[int] = []
        predecessor = torch.empty(sum(lengths), dtype=torch.long)
        for s, (start, length, parent) in enumerate(zip(starts, lengths, parents)):
            assert parent < s, "a parent segment precedes its children"
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
            before = starts[parent] + lengths[parent] - 1 if parent >= 0 else -1
            predecessor[start:start + length] = torch.arange(start - 1, start + length - 1)
            predecessor[start] = before
        # Per depth, the segments bucketed by length: (length - 1).bit_length() is the power of two it rounds to.
        by_level: list[dict[int, list[int]]] = [{} for _ in range(max(depth) + 1)]
        for s, d in enumerate(depth):
            by_level[d].setdefault((lengths[s] - 1).bit_length(), []).append(s)
        by_level_block = [[blocks[key] for key in sorted(blocks)] for blocks in by_level]
        row_of = {s: row for blocks in by_level_block for row, s in enumerate(s for block in blocks for s in block)}
        levels = [tuple(_block(segments, starts, lengths, parents, row_of, device) for segments in blocks)
                  for blocks in by_level_block]
        real = torch.cat([torch.arange(starts[s], starts[s] + lengths[s])
                          for blocks in by_level_block for block in blocks for s in block])
        order = torch.empty_like(real)
        order[real] = torch.arange(real.numel())
        return SegmentForest(int(real.numel()), predecessor, tuple(levels), upload(order, device), device)

    def conv(self, module, x_NC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None) -> torch.Tensor:
        """``registry.TokenLayout.conv``: the convolution along each token's path (:func:`path_conv`)."""
        return path_conv(x_NC, self.taps(weight_CK.shape[1]), weight_CK, bias_C)

    def scan(self, module, inputs: tuple[torch.Tensor, ...], *, chunked: Step, recurrent: Step) -> torch.Tensor:
        """``registry.TokenLayout.scan``: the chunked recurrence level by level (:func:`scan_levels`)."""
        return scan_levels(self, inputs, chunked)

    def taps(self, width: int) -> torch.Tensor:
        """``[N, width]`` flat indices of the ``width`` tokens ending at each token along its path, oldest
        first (-1 where the path has fewer tokens); built on the host once per width."""
        if width not in self._taps:
            chain = torch.cat([self.predecessor, torch.tensor([-1])])   # chain[-1] = -1: before a root stays -1
            columns = [torch.arange(self.num_tokens)]
            for _ in range(width - 1):
                columns.append(chain[columns[-1]])
            self._taps[width] = upload(torch.stack(columns[::-1], 1), self.device)
        return self._taps[width]


def _block(segments, starts, lengths, parents, row_of, device) -> Block:
    width = max(lengths[s] for s in segments)
    rows = torch.zeros(len(segments), width, dtype=torch.long)
    valid = torch.zeros(len(segments), width, dtype=torch.bool)
    for row, s in enumerate(segments):
        rows[row, :lengths[s]] = torch.arange(starts[s], starts[s] + lengths[s])
        valid[row, :lengths[s]] = True
    slots = torch.nonzero(valid.flatten()).squeeze(1)
    parent_rows = None
    if parents[segments[0]] >= 0:
        parent_rows = upload(torch.tensor([row_of[parents[s]] for s in segments]), device)
    return Block(upload(rows, device), upload(valid, device), upload(slots, device), parent_rows)


States = tuple[torch.Tensor, ...]
Step = Callable[..., tuple[torch.Tensor, States]]


def scan_levels(forest: SegmentForest, inputs: tuple[torch.Tensor, ...], step: Step) -> torch.Tensor:
    """Run a recurrent mixer over the forest, one batched call per block of a level.

    Args:
        inputs: per-token tensors ``[N, ...]`` (the mixer's inputs after its projections).
        step: ``step(*rows, valid=[R, W], initial_state=States | None) -> (out [R, W, ...], final_state)``
            with ``rows`` the inputs as ``[R, W, ...]`` padded rows; ``initial_state`` is None for the roots
            (the zero state) and each state tensor is ``[R, ...]``. Pad slots follow every real token of their
            row: the step must leave the final state at each row's last real token (e.g. no decay, no write).

    Returns:
        ``[N, ...]`` the step's outputs in flat token order (differentiable through every shared state).
    """
    outputs, states = [], None
    for level in forest.levels:
        level_states = []
        for block in level:
            initial = None if block.parent_rows is None else tuple(s[block.parent_rows] for s in states)
            out, final = step(*(x[block.rows] for x in inputs), valid=block.valid, initial_state=initial)
            outputs.append(out.flatten(0, 1)[block.slots])
            level_states.append(final)
        # The level's final states, row by row: what its children's parent_rows index.
        states = level_states[0] if len(level) == 1 else tuple(torch.cat(parts) for parts in zip(*level_states))
    return torch.cat(outputs)[forest.order]


def path_conv(x: torch.Tensor, taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A causal depthwise convolution along each token's path: ``[N, C]`` -> ``[N, C]``.

    ``taps`` ``[N, K]`` from :meth:`SegmentForest.taps`, ``weight`` ``[C, K]`` (an ``nn.Conv1d``'s ``weight[:, 0]``),
    ``bias`` ``[C]``. Token t's output is ``sum_k weight[:, k] * x[taps[t, k]] + bias``, what ``F.conv1d`` with
    ``K - 1`` zeros of left padding gives along one sequence: taps before a root read zeros.
    """
    out = PathConv.apply(x, weight.to(x.dtype), taps)
    return out if bias is None else out + bias


class PathConv(torch.autograd.Function):
    """``sum_k weight[:, k] * x[taps[:, k]]``, one tap at a time, keeping only ``x`` for the backward: autograd
    would keep each tap's ``[N, C]`` gather (K copies of the input), this recomputes them there."""

    @staticmethod
    def forward(ctx, x, weight, taps):
        rows = taps.remainder(x.shape[0] + 1)   # -1 (before a root) -> row N, the zero row
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        out = padded[rows[:, 0]] * weight[:, 0]
        for k in range(1, weight.shape[1]):
            out += padded[rows[:, k]] * weight[:, k]
        ctx.save_for_backward(x, weight, rows)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rows = ctx.saved_tensors
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        grad_padded = torch.zeros_like(padded)
        grad_weight = torch.empty_like(weight)
        for k in range(weight.shape[1]):
            grad_weight[:, k] = (grad_out * padded[rows[:, k]]).sum(0)
            grad_padded.index_add_(0, rows[:, k], grad_out * weight[:, k])
        return grad_padded[:-1], grad_weight, None
