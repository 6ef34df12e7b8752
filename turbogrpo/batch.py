"""One GRPO batch, ragged, stated once: K groups (one prompt each) with N completions in group-major order.

``Groups`` holds the batch's data from rollout to loss to metrics: the prompts, the completions flat and
group-major, and every per-completion field (advantages, rewards, finish reasons) and per-token field
(sampler / old-policy / reference log-probs, hidden states) in the same flat order. It is the one place
that regroups a flat list, picks groups out, cuts micro-batches and pads per-token fields.

Host ints and device tensors are kept apart (as in ``prefix/layout.py``): ``sizes``, ``offsets`` and
``lengths`` are host ints read from tensor shapes, never from tensor values, so no method here waits
for the device; tensor fields stay on their device, and index tensors are built on the host.

Shape legend: K groups, N completions, P_k prompt k's length, S_i completion i's length, Nq = sum S_i,
B completions of one micro-batch, L the longest of them, Hd hidden size.

    batch = Groups.from_nested(prompts, [[c00, c01, c02], [c10, c11]])
    batch.sizes, batch.offsets          # (3, 2), (0, 3, 5)
    batch.nested()                      # [[c00, c01, c02], [c10, c11]]
    batch.select([1])                   # group 1 alone, with every field (group(1) too)
    batch.pick([[0, 2], [1]])           # some completions of each group
    batch.micro_batches(token_budget)   # whole groups (or runs of one group) within the budget

Indices (``select``, ``group``, ``pick``) count as Python's do: ``-1`` is the last group (or the last
completion of a group); an index outside ``-K..K-1`` is a ValueError naming the argument, as is every
other bad argument, at the call that takes it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from turbogrpo.moe_routes import BatchRoutes

T = TypeVar("T")

PER_COMPLETION = ("advantages", "rewards", "finish_reasons", "sampler_logps", "old_logps", "ref_logps", "hidden",
                  "model_mask", "versions", "routes")
"""The optional fields with one entry per completion (flat, group-major)."""
PER_TOKEN = ("sampler_logps", "old_logps", "ref_logps", "hidden", "model_mask", "versions")
"""Those whose entry is one ``[S_i, ...]`` tensor per completion (what :meth:`Groups.padded` pads)."""
PER_GROUP = ("prompt_hidden", "prompt_routes")
"""The optional fields with one entry per group."""


@dataclass(eq=False)
class Groups:
    """K groups of completions with their per-completion and per-token fields (all flat, group-major).

    Group k's completions are ``offsets[k]:offsets[k + 1]`` of every flat field. An optional field is
    None when the batch does not carry it.
    """

    prompts: list[Tensor]
    """K prompt token ids, each ``[P_k]`` (int64)."""
    completions: list[Tensor]
    """N completion token ids, each ``[S_i]`` (int64), group-major."""
    sizes: tuple[int, ...]
    """``[K]`` host ints: completions per group."""
    advantages: Tensor | None = None
    """``[N]`` group-normalised advantages."""
    rewards: Tensor | None = None
    """``[N]`` total (weighted) rewards."""
    finish_reasons: list[str] | None = None
    """N of "stop" / "length" (``rollout.types.FinishReason``)."""
    sampler_logps: list[Tensor] | None = None
    """N ``[S_i]``: log-probs as the sampler computed them while sampling (float32)."""
    old_logps: list[Tensor] | None = None
    """N ``[S_i]``: log-probs under the policy that sampled them, recomputed by the trainer's forward."""
    ref_logps: list[Tensor] | None = None
    """N ``[S_i]``: log-probs under the reference policy."""
    hidden: list[Tensor] | None = None
    """N ``[S_i, Hd]``: the policy's final hidden state that predicted each token (draft training's
    offline data also has the one after the last token: ``[S_i + 1, Hd]``)."""
    model_mask: list[Tensor] | None = None
    """N ``[S_i]`` bool: True on the ids the policy sampled, False on ids an environment added (tool
    replies, feedback) between its turns; None: every completion id was sampled. Only sampled ids reach
    the loss, the KL, the entropy and the token counts (:meth:`mask`)."""
    versions: list[Tensor] | None = None
    """N ``[S_i]`` int64 (host): the policy version (optimizer steps done) whose weights drew each token. A
    rollout done with one set of weights marks every token alike (:meth:`at_version`); a generation that
    continues across weight updates (a partial rollout) marks each token with the version that drew it.
    None: not recorded (the trainer then takes the batch as drawn by its current weights)."""
    prompt_hidden: list[Tensor] | None = None
    """K ``[P_k, Hd]``: the policy's final hidden state at every prompt position (draft training)."""
    routes: list[Tensor] | None = None
    """N ``[R_i, L, k]`` (uint8 up to 256 experts, ``moe_routes.route_dtype``): the MoE experts the sampler's
    routers chose for the completion's first R_i <= S_i tokens at each of the L MoE layers (the last token is
    never run by the sampler); the training forward replays them (algo.routing_replay). None: not recorded."""
    prompt_routes: list[Tensor] | None = None
    """K ``[P_k, L, k]``: the same for each prompt (recorded once, at its prefill)."""
    weight: float = 1.0
    """This batch's share of a step's gradient sum: 1.0, or 0.0 for a filler micro-batch that only keeps
    collective calls matched across ranks (:func:`pad_to_count`)."""

    def __post_init__(self):
        self.sizes = tuple(int(s) for s in self.sizes)
        if any(size < 0 for size in self.sizes):
            raise ValueError(f"Groups sizes must be integers >= 0 (completions per group), got {list(self.sizes)}")
        self.offsets: tuple[int, ...] = (0, *accumulate(self.sizes))
        """``[K + 1]`` host ints: group k's completions are ``offsets[k]:offsets[k + 1]``."""
        if len(self.sizes) != len(self.prompts) or self.offsets[-1] != len(self.completions):
            raise ValueError(f"Groups of sizes {list(self.sizes)} need {len(self.sizes)} prompts and "
                             f"{self.offsets[-1]} completions, got {len(self.prompts)} and {len(self.completions)}")
        # Checked here, not where a wrong length would first index past the end (a later select or loss).
        for name in PER_COMPLETION:
            _check_length(getattr(self, name), name, self.num_completions, "one per completion, flat and group-major")
        _check_length(self.prompt_hidden, "prompt_hidden", self.num_groups, "one [P_k, Hd] per group")
        _check_length(self.prompt_routes, "prompt_routes", self.num_groups, "one [P_k, L, k] per group")
        if (self.routes is None) != (self.prompt_routes is None):
            raise ValueError("Groups fields routes and prompt_routes go together (the sampler's MoE routes of the "
                             "completions and of their prompts); got only one of them")

    @classmethod
    def from_nested(cls, prompts: Sequence[Tensor], completions: Sequence[Sequence[Tensor]],
                    **fields) -> Groups:
        """A batch from per-group lists: ``completions`` and any per-completion field given per group
        (lists of lists; ``advantages`` / ``rewards`` may be given flat ``[N]``, ``prompt_hidden`` is
        per group already)."""
        flat = {name: flatten(value) if name in PER_COMPLETION and isinstance(value, (list, tuple)) else value
                for name, value in fields.items()}
        return cls(list(prompts), flatten(completions), [len(group) for group in completions], **flat)

    # -- the layout (host ints) ---------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    @property
    def num_completions(self) -> int:
        return self.offsets[-1]

    @property
    def lengths(self) -> list[int]:
        """``[N]`` host ints: each completion's length (from its shape)."""
        return [c.numel() for c in self.completions]

    @property
    def trained_lengths(self) -> list[int]:
        """``[N]`` host ints: each completion's tokens that reach the loss (its sampled ones; all of them
        without ``model_mask``). Reads the masks' values: they are host tensors from the rollout."""
        if self.model_mask is None:
            return self.lengths
        return [int(m.sum()) for m in self.model_mask]

    @property
    def prompt_lengths(self) -> list[int]:
        """``[K]`` host ints: each prompt's length."""
        return [p.numel() for p in self.prompts]

    def positions(self, g: int) -> range:
        """Flat positions of group ``g``'s completions."""
        return range(self.offsets[g], self.offsets[g + 1])

    def split(self, flat: Sequence[T]) -> list[list[T]]:
        """A flat per-completion sequence (length N) as per-group lists."""
        if len(flat) != self.num_completions:
            raise ValueError(f"got {len(flat)} items for {self.num_completions} completions")
        return [list(flat[start:stop]) for start, stop in zip(self.offsets, self.offsets[1:])]

    def nested(self) -> list[list[Tensor]]:
        """The completions per group (the layout ``turbogrpo.completion_logprobs`` takes)."""
        return self.split(self.completions)

    def per_completion(self, flat_Nq: Tensor) -> list[Tensor]:
        """A ``[Nq, ...]`` tensor over every completion token (what the shared-prefix forward returns)
        as N ``[S_i, ...]`` views, flat like ``completions``."""
        return list(flat_Nq.split(self.lengths))

    # -- views and sub-batches ----------------------------------------------------------------------
    def group(self, g: int) -> Groups:
        """Group ``g`` alone, with every field."""
        return self.select([g])

    def select(self, keep: Sequence[int]) -> Groups:
        """The batch restricted to groups ``keep`` (indices as Python's: -1 is the last group), in that
        order, with every field."""
        keep = [_index(g, self.num_groups, "select: keep", "group") for g in keep]
        return self._take(keep, [self.sizes[g] for g in keep], [i for g in keep for i in self.positions(g)])

    def pick(self, chosen: Sequence[Sequence[int]]) -> Groups:
        """Per group, the completions ``chosen[g]`` (indices within the group, as Python's: -1 is its
        last completion; in order); ``chosen`` has one list per group, and groups with none chosen are
        left out."""
        if len(chosen) != self.num_groups:
            raise ValueError(f"pick: chosen must hold one list of completion indices per group ({self.num_groups}), "
                             f"got {len(chosen)}")
        chosen = [[_index(i, self.sizes[g], f"pick: chosen[{g}]", f"completion of group {g}") for i in members]
                  for g, members in enumerate(chosen)]
        keep = [g for g, members in enumerate(chosen) if members]
        return self._take(keep, [len(chosen[g]) for g in keep],
                          [self.offsets[g] + i for g in keep for i in chosen[g]])

    @classmethod
    def concat(cls, batches: Sequence[Groups]) -> Groups:
        """The groups of ``batches`` (at least one) one after the other (each field kept only where every
        batch has it)."""
        batches = list(batches)
        if not batches or not all(isinstance(b, Groups) for b in batches):
            raise ValueError(f"concat: batches must be a non-empty sequence of Groups, got "
                             f"{[type(b).__name__ for b in batches] or 'none'}; an empty batch is Groups([], [], [])")
        fields = {}
        for name in (*PER_COMPLETION, *PER_GROUP):
            values = [getattr(b, name) for b in batches]
            if any(v is None for v in values):
                fields[name] = None
            elif isinstance(values[0], Tensor):
                fields[name] = torch.cat(values)
            else:
                fields[name] = flatten(values)
        return cls(flatten([b.prompts for b in batches]), flatten([b.completions for b in batches]),
                   flatten([b.sizes for b in batches]), **fields)

    def micro_batches(self, token_budget: int, common_prefixes: Sequence[Sequence[Sequence[int]]] | None = None
                      ) -> list[Groups]:
        """The batch cut into micro-batches of at most ``token_budget`` tokens, each a ``Groups``.

        With the shared-prefix forward a group costs ``P + sum(S_i)`` tokens. With ``common_prefixes`` (per
        group ``[G_k][G_k]`` host ints: the leading tokens completions i and j have in common,
        ``tree.trie.common_prefix_lengths``) the count is the tree forward's trie tokens instead: a
        completion costs only its tokens past its longest common start with an earlier completion of its
        run (sharing across groups is not counted, so a micro-batch's trie is at most the count). Groups are packed greedily
        in order while they fit; a group larger than the budget is cut into runs of completions that
        fit with the prompt, each carrying the prompt again (the gradient is a sum over completions,
        so any cut gives the same total); a prompt plus one completion over the budget runs alone.
        The micro-batches hold every completion exactly once and in the batch's flat order, so their
        results concatenated are the whole batch's, and their losses (each divided by whole-batch
        totals) sum exactly to the whole batch's loss.
        """
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
            raise ValueError(f"micro_batches: token_budget must be an integer >= 1 (tokens per micro-batch), "
                             f"got {token_budget!r}")
        if common_prefixes is not None and [len(c) for c in common_prefixes] != list(self.sizes):
            raise ValueError(f"micro_batches: common_prefixes must hold one [G_k][G_k] table per group (sizes "
                             f"{list(self.sizes)}), got {[len(c) for c in common_prefixes]} rows")
        return [self._take([g for g, _, _ in runs], [stop - start for _, start, stop in runs],
                           [self.offsets[g] + i for g, start, stop in runs for i in range(start, stop)])
                for runs in _plan(self.prompt_lengths, self.split(self.lengths), token_budget, common_prefixes)]

    def at_version(self, version: int) -> Groups:
        """This batch (every field kept) with each token marked as drawn by policy version ``version``."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"at_version: version must be an integer >= 0 (optimizer steps done), got {version!r}")
        versions = [torch.full((length,), version, dtype=torch.int64) for length in self.lengths]
        return dataclasses.replace(self, versions=versions)

    def padded(self, name: str) -> Tensor | None:
        """``[B, L]``: per-token field ``name`` right-padded with 0 (None when the batch lacks it)."""
        if name not in PER_TOKEN:
            raise ValueError(f"{name!r} is not a per-token field; one of {PER_TOKEN}")
        rows = getattr(self, name)
        return None if rows is None else pad_ragged(rows)

    def mask(self, device: torch.device) -> Tensor:
        """``[B, L]`` float mask on ``device``: 1 on each completion's sampled tokens, 0 on the padding and
        on environment tokens (``model_mask``)."""
        lengths = length_mask(self.lengths, device)
        if self.model_mask is None:
            return lengths
        return lengths * pad_ragged([m.to(device=device, dtype=lengths.dtype) for m in self.model_mask])

    def _take(self, groups: list[int], sizes: list[int], index: list[int]) -> Groups:
        """A batch of the prompts of ``groups`` with the completions at flat positions ``index``
        (``sizes[k]`` of them for ``groups[k]``)."""
        fields = {}
        for name in PER_COMPLETION:
            value = getattr(self, name)
            if isinstance(value, Tensor):
                value = value[torch.tensor(index, dtype=torch.long, device=value.device)]
            elif value is not None:
                value = [value[i] for i in index]
            fields[name] = value
        for name in PER_GROUP:
            value = getattr(self, name)
            fields[name] = None if value is None else [value[g] for g in groups]
        return Groups([self.prompts[g] for g in groups], [self.completions[i] for i in index], sizes, **fields,
                      weight=self.weight)

    @property
    def batch_routes(self) -> BatchRoutes | None:
        """The sampler's MoE routes as the training forward takes them (None: not recorded)."""
        return None if self.routes is None else BatchRoutes(self.prompt_routes, self.routes)

    def __repr__(self) -> str:
        present = [name for name in (*PER_COMPLETION, *PER_GROUP) if getattr(self, name) is not None]
        return f"Groups(sizes={list(self.sizes)}, fields={present})"


def _index(index: int, length: int, argument: str, what: str) -> int:
    """``index`` into ``length`` items as Python counts it (negative from the end), as a non-negative int;
    a ValueError naming ``argument`` when it is no integer or outside ``-length..length-1``."""
    try:
        if isinstance(index, bool):
            raise TypeError
        index = operator.index(index)  # ints, numpy ints, one-element integer tensors
    except TypeError:
        raise ValueError(f"{argument} must hold integer indices, got {index!r}") from None
    if not -length <= index < length:
        allowed = f"-{length}..{length - 1}" if length else "none (it is empty)"
        raise ValueError(f"{argument}: index {index} is out of range; a {what} index is one of {allowed}")
    return index % length


def _check_length(value, name: str, expected: int, what: str) -> None:
    """ValueError naming field ``name`` unless it is None or holds ``expected`` entries."""
    if value is None:
        return
    if isinstance(value, Tensor) and value.dim() == 0:
        raise ValueError(f"Groups field {name} must hold {expected} entries ({what}), got a 0-d tensor")
    if len(value) != expected:
        raise ValueError(f"Groups field {name} must hold {expected} entries ({what}), got {len(value)}")


def flatten(nested: Sequence[Sequence[T]]) -> list[T]:
    """Per-group lists as one flat, group-major list."""
    return [item for group in nested for item in group]


def pad_to_count(batches: list[Groups], count: int) -> list[Groups]:
    """Append zero-weight copies of the last micro-batch up to ``count`` (ranks must run equally many)."""
    assert batches and count >= len(batches)
    filler = dataclasses.replace(batches[-1], weight=0.0)
    return batches + [filler] * (count - len(batches))


def pad_ragged(rows: Sequence[Tensor]) -> Tensor:
    """Right-pad 1-D tensors with 0 into ``[B, L]`` (L = the longest row); differentiable."""
    return pad_sequence(list(rows), batch_first=True, padding_value=0.0)


def length_mask(lengths: Sequence[int], device: torch.device) -> Tensor:
    """``[B, L]`` float mask, 1 on the first ``lengths[b]`` positions of row b."""
    lengths_B = torch.tensor(lengths, device=device)
    positions_L = torch.arange(max(lengths), device=device)
    return (positions_L[None, :] < lengths_B[:, None]).float()


def _plan(prompt_lengths: Sequence[int], completion_lengths: Sequence[Sequence[int]],
          token_budget: int, common_prefixes=None) -> list[list[tuple[int, int, int]]]:
    """Per micro-batch, its runs ``(group, start, stop)``: completions ``start..stop-1`` of ``group``
    (see :meth:`Groups.micro_batches`)."""
    batches: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            batches.append(current)
        current, used = [], 0

    for group, (prompt_len, lengths) in enumerate(zip(prompt_lengths, completion_lengths)):
        common = None if common_prefixes is None else common_prefixes[group]
        whole = prompt_len + sum(_added(lengths, common, i, 0) for i in range(len(lengths)))
        if used + whole > token_budget:
            close()
        if whole <= token_budget:
            current.append((group, 0, len(lengths)))
            used += whole
            continue
        start = 0
        while start < len(lengths):
            stop, cost = start, prompt_len
            while stop < len(lengths) and cost + _added(lengths, common, stop, start) <= token_budget:
                cost += _added(lengths, common, stop, start)
                stop += 1
            if stop == start:  # one completion alone is over budget: it still has to run
                cost += lengths[stop]
                stop += 1
            close()
            current.append((group, start, stop))
            used = cost
            start = stop
    close()
    return batches


def _added(lengths: Sequence[int], common: Sequence[Sequence[int]] | None, i: int, start: int) -> int:
    """Tokens completion ``i`` adds to a run of its group's completions ``start..i-1``: all of them, or
    (``common``: the group's common-prefix table) those past its longest common start with one of them."""
    return lengths[i] - (max(common[i][start:i]) if common is not None and i > start else 0)
