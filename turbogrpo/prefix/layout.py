"""Packing GRPO groups into one flat sequence with each prompt stored once.

A group is a prompt ``p`` (length P) and completions ``c_1..c_G`` (lengths S_i). A pack of many
groups is one flat token sequence of length ``T = sum(P_g) + sum(S_gi)`` with no padding:

    [p_1, p_2, ..., p_n,  c_11, ..., c_1G1,  c_21, ...]      (prompts first, then completions)

Only attention mixes tokens, so the order of tokens in the flat sequence is free; putting all
prompts first makes the prompt part and the completion part two contiguous slices.

* position ids: prompt tokens ``0..P-1``; every completion restarts at ``P`` (``c_i[j]`` is at
  ``P + j``), so RoPE sees exactly the positions of the unshared layout;
* attention rule: a prompt token attends causally within its prompt; a token of ``c_i`` attends
  to its whole prompt and causally within ``c_i``, never to another completion;
* the log-prob of ``c_i[0]`` is read at the last prompt token (shared by the group's G members),
  that of ``c_i[j]`` at the position of ``c_i[j-1]``.

Host syncs: none. Every index tensor is built on the host from host ints (the lengths) and
copied to the device once per pack with :func:`upload` (pinned memory, ``non_blocking``), so
building a pack never waits for the device.

Shape legend: Ng groups, Nc completions, Np prompt tokens, Nq completion tokens, T = Np + Nq,
P_max / S_max / Q_max the longest prompt / completion / completions-of-one-group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from turbogrpo.device_index import upload   # also imported from here across the package
from turbogrpo.mixers.forest import SegmentForest


@dataclass(frozen=True, eq=False)
class PackedGroups:
    """Flat token layout of many GRPO groups plus the index tensors the attention backends need.

    Host-side lengths are plain ints (they fix the padded shapes); index tensors live on ``device``.
    """

    input_ids: torch.Tensor          # [T] long
    position_ids: torch.Tensor       # [T] long
    prompt_lengths: tuple[int, ...]  # [Ng]
    completion_lengths: tuple[tuple[int, ...], ...]  # per group, [G_g]
    predictor_index: torch.Tensor    # [Nq] flat position whose hidden state predicts each completion token
    target_ids: torch.Tensor         # [Nq] the completion tokens, in flat completion order

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_groups(self) -> int:
        return len(self.prompt_lengths)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def num_completion_tokens(self) -> int:
        return sum(sum(lengths) for lengths in self.completion_lengths)

    @property
    def flat_completion_lengths(self) -> list[int]:
        return [s for lengths in self.completion_lengths for s in lengths]

    @property
    def max_sequence_length(self) -> int:
        """Longest prompt + completion, i.e. the largest position id + 1."""
        return max(p + max(ss) for p, ss in zip(self.prompt_lengths, self.completion_lengths))

    # ---- padded views used by the cascade backend (built lazily, once per pack) ----

    @cached_property
    def prompt_padded(self) -> PaddedIndex:
        """Prompt tokens as ``[Ng, P_max]`` indices into the prompt slice ``[0, Np)``."""
        return PaddedIndex.build(list(self.prompt_lengths), self.device)

    @cached_property
    def group_queries_padded(self) -> PaddedIndex:
        """Each group's completion tokens as ``[Ng, Q_max]`` indices into the completion slice."""
        return PaddedIndex.build([sum(ss) for ss in self.completion_lengths], self.device)

    @cached_property
    def completions_padded(self) -> PaddedIndex:
        """Each completion's tokens as ``[Nc, S_max]`` indices into the completion slice."""
        return PaddedIndex.build(self.flat_completion_lengths, self.device)

    # ---- packed (cu_seqlens) views used by the varlen backend (built lazily, once per pack) ----

    @cached_property
    def prompt_segments(self) -> VarlenSegments:
        """Each prompt as one segment of the prompt slice ``[0, Np)``."""
        return VarlenSegments.build(self.prompt_lengths, self.device)

    @cached_property
    def group_query_segments(self) -> VarlenSegments:
        """Each group's completion tokens (all G completions) as one segment of the completion slice;
        segment g pairs with segment g of :attr:`prompt_segments`."""
        return VarlenSegments.build([sum(ss) for ss in self.completion_lengths], self.device)

    @cached_property
    def completion_segments(self) -> VarlenSegments:
        """Each completion as one segment of the completion slice ``[0, Nq)``."""
        return VarlenSegments.build(self.flat_completion_lengths, self.device)

    @cached_property
    def segment_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per flat token: group id ``[T]`` and completion id ``[T]`` (-1 for prompt tokens)."""
        group_of_prompt = torch.repeat_interleave(
            torch.arange(self.num_groups), torch.tensor(self.prompt_lengths))
        group_of_completion = torch.repeat_interleave(
            torch.arange(self.num_groups),
            torch.tensor([sum(ss) for ss in self.completion_lengths]))
        completion_of_completion = torch.repeat_interleave(
            torch.arange(len(self.flat_completion_lengths)), torch.tensor(self.flat_completion_lengths))
        group = torch.cat([group_of_prompt, group_of_completion])
        completion = torch.cat([torch.full((self.num_prompt_tokens,), -1), completion_of_completion])
        return upload(group, self.device), upload(completion, self.device)

    @cached_property
    def group_query_positions_padded(self) -> torch.Tensor:
        """Position id of each slot of :attr:`group_queries_padded`, ``[Ng, Q_max]`` long; pad slots
        take their group's last prompt position (so a windowed pad query still sees a key)."""
        width = self.group_queries_padded.width
        rows = []
        for p_len, s_lens in zip(self.prompt_lengths, self.completion_lengths):
            row = torch.full((width,), p_len - 1)
            row[:sum(s_lens)] = torch.cat([torch.arange(p_len, p_len + s) for s in s_lens])
            rows.append(row)
        return upload(torch.stack(rows), self.device)

    @cached_property
    def segment_forest(self) -> SegmentForest:
        """The layout of the recurrent layers (``turbogrpo.mixers``): each prompt a root segment, each
        completion a child of its group's prompt, continuing from the prompt's final state."""
        prompt_starts = [0, *accumulate(self.prompt_lengths)][:-1]
        completion_starts = [self.num_prompt_tokens + start
                             for start in [0, *accumulate(self.flat_completion_lengths)][:-1]]
        parents = [g for g, lengths in enumerate(self.completion_lengths) for _ in lengths]
        return SegmentForest.build(prompt_starts + completion_starts,
                                   list(self.prompt_lengths) + self.flat_completion_lengths,
                                   [-1] * self.num_groups + parents, self.device)

    def dense_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """The attention rule as a dense boolean ``[T, T]`` mask (query, key): the reference. Under a
        sliding window a query also skips keys ``window`` or more positions behind it."""
        group, completion = self.segment_ids
        pos = self.position_ids
        same_group = group[:, None] == group[None, :]
        key_is_prompt = (completion == -1)[None, :]
        same_completion = completion[:, None] == completion[None, :]
        distance = pos[:, None] - pos[None, :]
        causal = distance >= 0
        if sliding_window is not None:
            causal = causal & (distance < sliding_window)
        return same_group & causal & (key_is_prompt | same_completion)


@dataclass(frozen=True, eq=False)
class VarlenSegments:
    """Consecutive segments of a flat ``[N]`` axis, as variable-length attention kernels take them.

    ``cu_seqlens`` ``[n + 1]`` int32 on the device: segment i is ``[cu_seqlens[i], cu_seqlens[i + 1])``;
    ``lengths`` / ``max_length``: the segment lengths and the longest one as host ints, so no kernel
    or loop ever reads ``cu_seqlens`` back from the device.
    """

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    max_length: int

    @staticmethod
    def build(lengths, device: torch.device) -> VarlenSegments:
        # Lengths are host ints: the prefix sum is taken on the host and copied over once.
        cu_seqlens = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)
        return VarlenSegments(upload(cu_seqlens, device), tuple(lengths), max(lengths))


@dataclass(frozen=True, eq=False)
class PaddedIndex:
    """Rows of varying length laid out as a padded ``[R, W]`` grid over a flat ``[N]`` axis.

    ``gather`` ``[R, W]``: flat index of each slot (pads point at index 0 so gathers stay in range);
    ``valid`` ``[R, W]``: real slots; ``slot_of_flat`` ``[N]``: where each flat item sits in the
    grid's ``R * W`` slots (to read padded results back in flat order).
    """

    gather: torch.Tensor
    valid: torch.Tensor
    slot_of_flat: torch.Tensor
    width: int
    is_dense: bool   # every row full: padded views are plain reshapes, no gathers

    @staticmethod
    def build(lengths: list[int], device: torch.device) -> PaddedIndex:
        width = max(lengths)
        lengths_t = torch.tensor(lengths)
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        cols = torch.arange(width)
        valid = cols[None, :] < lengths_t[:, None]
        gather = torch.where(valid, starts[:, None] + cols[None, :], torch.zeros((), dtype=torch.long))
        slot_of_flat = torch.nonzero(valid.flatten(), as_tuple=False).squeeze(1)
        is_dense = all(n == width for n in lengths)
        return PaddedIndex(upload(gather, device), upload(valid, device), upload(slot_of_flat, device),
                           width, is_dense)

    def to_padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` -> ``[R, W, ...]`` (pad slots hold copies of item 0)."""
        if self.is_dense:
            return flat.unflatten(0, self.gather.shape)
        return flat[self.gather]

    def to_flat(self, padded: torch.Tensor) -> torch.Tensor:
        """``[R, W, ...]`` -> ``[N, ...]``."""
        if self.is_dense:
            return padded.flatten(0, 1)
        return padded.flatten(0, 1)[self.slot_of_flat]


def pack_groups(prompts: list[torch.Tensor], completions: list[list[torch.Tensor]]) -> PackedGroups:
    """Build the shared-prefix layout (inputs must already be validated).

    Lengths come from tensor shapes (host metadata), so nothing here reads the device.
    """
    device = prompts[0].device
    prompt_lengths = tuple(int(p.numel()) for p in prompts)
    completion_lengths = tuple(tuple(int(c.numel()) for c in cs) for cs in completions)
    num_prompt_tokens = sum(prompt_lengths)

    flat_completions = [c for cs in completions for c in cs]
    input_ids = torch.cat([*prompts, *flat_completions])

    positions, predictors = [], []
    prompt_end = 0            # flat index one past the current group's prompt
    completion_start = num_prompt_tokens
    for p_len, s_lens in zip(prompt_lengths, completion_lengths):
        prompt_end += p_len
        for s_len in s_lens:
            positions.append(torch.arange(p_len, p_len + s_len))
            # c[0] is predicted by the last prompt token, c[j] by c[j-1].
            predictors.append(torch.tensor([prompt_end - 1]))
            predictors.append(torch.arange(completion_start, completion_start + s_len - 1))
            completion_start += s_len
    prompt_positions = [torch.arange(p) for p in prompt_lengths]
    # One host buffer, one copy: positions [T] then predictors [Nq].
    indices = upload(torch.cat(prompt_positions + positions + predictors), device)
    position_ids, predictor_index = indices.split([len(input_ids), len(indices) - len(input_ids)])
    target_ids = input_ids[num_prompt_tokens:]
    return PackedGroups(input_ids, position_ids, prompt_lengths, completion_lengths,
                        predictor_index, target_ids)
