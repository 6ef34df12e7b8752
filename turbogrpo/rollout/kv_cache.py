"""The rollout KV cache: each prompt's K/V once per group, each sequence's generated K/V on its own.

Shapes (per attention layer): ``G`` live groups (prompts with a live sample), ``B`` live sequences,
``Hkv`` key/value heads, ``P`` longest prompt, ``C`` slots (capacity) for generated tokens, ``D`` head dim.

* prompt K/V ``[G, Hkv, P, D]``, valid up to
  ``prompt_lengths_G``; written once by the prefill and never copied per sample.
* generated K/V ``[B, Hkv, C, D]``, preallocated at the rollout's full size; slots ``< lengths_B[b]``
  hold sequence b's committed tokens, at positions ``prompt_length + slot``. A forward writes its n new
  tokens into slots ``lengths_B .. lengths_B + n - 1``; ``commit_all``/``commit_live``/``commit`` then
  keep all of them, those of live rows, or a subset (speculative verification's accepted path).

Live sequences stay sorted by group, and finished ones are dropped by ``keep`` (rows move up in
place, so the storage is never reallocated and step cost follows the decoding batch). ``fork`` copies a
row into consecutive rows (a branching multi-turn rollout's conversation splitting at a turn boundary);
the storage is allocated up front for ``row_capacity`` rows so that forks never reallocate either.

A hybrid model's recurrent layers keep their states beside the K/V, row for row (``states``, a
``states.RecurrentStates``): ``keep`` and ``fork`` move them with the K/V rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbogrpo.rollout.states import RecurrentStates


def write_slots(cache_BKCD: torch.Tensor, slots_Bn: torch.Tensor, new_BKnD: torch.Tensor) -> None:
    """``cache_BKCD[b, :, slots_Bn[b, j]] = new_BKnD[b, :, j]`` in place (slots distinct within a row).

    One ``index_put_`` on the slot-major view, not ``scatter_`` along the slot dim: on the CPU, scatter
    of bfloat16 copies the whole destination to float32 and back (``[64, 3, 128, 64]``: 14-27x slower,
    about 1 ms per write; float32 about the same either way; ``bench/decode_ops.py``). A rollout writes
    twice per layer and step. The rows are indexed in the whole buffer, not in a slice of its first B rows: compiled,
    a slice short of the buffer made inductor copy those rows' every slot before writing, each layer and step (a
    compiled SmolLM2 step at 56 of 64 rows took 219 ms against 146 at 64, float32)."""
    rows_B1 = torch.arange(slots_Bn.shape[0], device=slots_Bn.device)[:, None]
    cache_BKCD.transpose(1, 2).index_put_((rows_B1, slots_Bn), new_BKnD.transpose(1, 2))


def read_slots(cache_BKCD: torch.Tensor, slots_Bn: torch.Tensor) -> torch.Tensor:
    """``cache_BKCD[b, :, slots_Bn[b, j]]`` as ``[B, K, n, D]`` (a copy)."""
    rows_B1 = torch.arange(slots_Bn.shape[0], device=slots_Bn.device)[:, None]
    return cache_BKCD.transpose(1, 2)[rows_B1, slots_Bn].transpose(1, 2)


@dataclass(frozen=True)
class LiveLayout:
    """Where each live sequence sits among its group's live samples (rows sorted by group).

    The decode plan scatters queries into a ``[G, Hkv, max_per_group * rows_per_sequence, D]`` block so
    that all samples of a group attend to the group's prompt K/V in one product.
    """

    group_B: torch.Tensor
    """[B] int64: the sequence's group, as a row of the prompt K/V."""
    slot_B: torch.Tensor
    """[B] int64: the sequence's index among its group's live sequences."""
    num_groups: int
    max_per_group: int
    dense: bool
    """Every group has ``max_per_group`` rows: stacking queries per group is a reshape."""

    @staticmethod
    def from_group_rows(group_rows: list[int], device: torch.device,
                        block: tuple[int, int] | None = None) -> LiveLayout:
        """``group_rows``: each live sequence's prompt row, non-decreasing (host list). ``block``: (groups, rows
        per group) of the stacked queries, at least the live ones (None: exactly the live ones)."""
        slots, previous, run = [], None, 0
        for row in group_rows:
            run = run + 1 if row == previous else 0
            slots.append(run)
            previous = row
        num_groups, max_per_group = block or (group_rows[-1] + 1 if group_rows else 0, max(slots) + 1 if slots else 0)
        return LiveLayout(
            group_B=torch.tensor(group_rows, dtype=torch.long, device=device),
            slot_B=torch.tensor(slots, dtype=torch.long, device=device),
            num_groups=num_groups, max_per_group=max_per_group,
            dense=bool(group_rows) and len(group_rows) == num_groups * max_per_group)


class GroupedKVCache:
    """K/V of one rollout for every attention layer; see the module docstring for the layout."""

    def __init__(self, prompt_lengths: list[int], num_samples: int, capacity: int, device: torch.device,
                 static_slots: bool = False, row_capacity: int | None = None, slot_block: int | None = None):
        """Sequence ``i`` belongs to group ``i // num_samples``; ``capacity`` generated slots each.
        ``static_slots``: decoding attends over a number of slots that does not follow ``max_length`` step by
        step (masked by ``lengths_B``), so that a step's graph holds from step to step (compiled or captured
        steps): all ``capacity`` of them, or with ``slot_block`` the slots in use rounded up to a multiple of
        ``slot_block`` (``slot_index_L``, a size a compiled step treats as dynamic: one graph reads 16 slots
        early in a rollout and 256 late, where reading all 256 every step took a SmolLM2 step at 64 rows
        22% of its time, profiled); eager decoding reads only the slots in use. ``row_capacity``: rows of generated
        slots to allocate (None: the initial ``len(prompt_lengths) * num_samples``; more leaves room for
        ``fork``)."""
        self.capacity = capacity
        self.static_slots = static_slots
        self.slot_block = slot_block if static_slots and slot_block is not None and slot_block < capacity else None
        """Slots a static step's read grows by (None: the whole capacity from the start)."""
        self.slot_index_L = torch.arange(self.slot_block or capacity, device=device)
        """[L] the generated slots a static step reads (their indices): L = ``capacity``, or the slots in use
        (``max_length + 1``) rounded up to ``slot_block``; grown on the host as ``max_length`` passes it."""
        self._num_samples = num_samples
        self.prompt_width = max(prompt_lengths)
        """P: the prompt K/V's slot count (longest prompt)."""
        self.device = device
        self._prompt_lengths_host = list(prompt_lengths)
        self._live_groups: list[int] = list(range(len(prompt_lengths)))  # group id of each prompt row
        self._sequence_groups: list[int] = [g for g in range(len(prompt_lengths)) for _ in range(num_samples)]
        self._prompt_keys: dict[int, torch.Tensor] = {}
        self._prompt_values: dict[int, torch.Tensor] = {}
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self.lengths_B = torch.zeros(len(self._sequence_groups), dtype=torch.long, device=device)
        self.row_capacity = max(len(self._sequence_groups), row_capacity or 0)
        self.states = RecurrentStates(self.row_capacity)
        """A hybrid's recurrent states, one row per sequence (empty for an attention model)."""
        # A static step's query block depends on the batch size alone (``_static_block``); forks would pass it.
        self._static_block = static_slots and self.row_capacity == len(self._sequence_groups)
        self._max_length = 0
        self._refresh_layout()

    @property
    def max_length(self) -> int:
        """Host-side upper bound on ``lengths_B``: attention reads slots ``< max_length + n`` only (a static
        step's ``slot_index_L`` holds at least ``max_length + 1``: a plain step's next read)."""
        return self._max_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        self._max_length = value
        if self.slot_block is not None and value + 1 > self.slot_index_L.shape[0]:
            needed = -(-(value + 1) // self.slot_block) * self.slot_block
            self.slot_index_L = torch.arange(min(needed, self.capacity), device=self.device)

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._sequence_groups)

    def prompt(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt keys and values ``[G, Hkv, P, D]`` of the live groups."""
        rows = self.layout.num_groups
        return self._prompt_keys[layer][:rows], self._prompt_values[layer][:rows]

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor a decoding step reads whose size follows the prompt width P, or the generated slots it
        reads (``slot_index_L`` with a ``slot_block``), with that dimension: a compiled step treats these as
        dynamic sizes, so that new prompts and a longer read do not compile the step again."""
        prompt_kv = [(t, 2) for store in (self._prompt_keys, self._prompt_values) for t in store.values()]
        slots = [(self.slot_index_L, 0)] if self.slot_block is not None else []
        return [*prompt_kv, (self.prompt_visible_GP, 1), *slots]

    def generated(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Generated K/V of the live sequences, first ``num_slots`` slots, ``[B, Hkv, num_slots, D]``."""
        rows = self.num_live
        return self._keys[layer][:rows, :, :num_slots], self._values[layer][:rows, :, :num_slots]

    def slot_index(self, num_new: int) -> torch.Tensor:
        """``[L]`` the generated slots a forward of ``num_new`` new tokens per sequence attends over (their
        indices 0 .. L-1): ``slot_index_L`` for a static step (see ``__init__``), else the slots in use."""
        if self.static_slots:
            return self.slot_index_L
        return torch.arange(min(self.max_length + num_new, self.capacity), device=self.device)

    def next_positions(self, depths_Bn: torch.Tensor) -> torch.Tensor:
        """Position ids ``[B, n]`` of new tokens at ``depths_Bn`` past each sequence's committed tokens."""
        return (self.prompt_lengths_B + self.lengths_B).unsqueeze(-1) + depths_Bn

    # -- writing ---------------------------------------------------------------------------------
    def store_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep the prefill's K/V ``[G, Hkv, P, D]`` and allocate this layer's generated slots."""
        self._prompt_keys[layer] = key.contiguous()
        self._prompt_values[layer] = value.contiguous()
        # With a slot_block, one spare slot (never written or read) keeps a static step's read strictly inside
        # the buffer: inductor's slice guards on a read shorter than the buffer, and a read of all of it (the last
        # block) compiled the step again with that size fixed.
        spare = 1 if self.slot_block is not None else 0
        slots_shape = (self.row_capacity, key.shape[1], self.capacity + spare, key.shape[3])
        # Zeros, not empty: unused slots are masked out, but a masked weight of 0 times a NaN from
        # uninitialised memory would still be NaN.
        self._keys[layer] = key.new_zeros(slots_shape)
        self._values[layer] = value.new_zeros(slots_shape)

    def write(self, layer: int, key_BKnD: torch.Tensor, value_BKnD: torch.Tensor, slots_Bn: torch.Tensor) -> None:
        """Put new tokens' K/V ``[B, Hkv, n, D]`` into generated slots ``slots_Bn [B, n]``."""
        # The whole slot dim, not a slice of it: a compiled step writes into a view of the buffer in place only
        # where the view spans it (a slice short of the spare slot made inductor copy every layer's buffer).
        write_slots(self._keys[layer], slots_Bn, key_BKnD)
        write_slots(self._values[layer], slots_Bn, value_BKnD)

    def commit_all(self, num_new: int) -> None:
        """Keep every one of the last forward's ``num_new`` tokens per sequence."""
        self.lengths_B += num_new
        self.max_length += num_new

    def commit_live(self, active_B: torch.Tensor) -> None:
        """Keep the last forward's one new token of each active row (``[B]`` bool; device only: the
        caller advances the host bound ``max_length``, so a compiled step reads no changing host int)."""
        self.lengths_B += active_B.long()

    def commit_first(self, num_kept_B: torch.Tensor, max_kept: int) -> None:
        """Keep the first ``num_kept_B[b]`` of the last forward's new tokens of each sequence (``[B]`` int64;
        the rest, padding of a ragged forward, lie past the new length and are never read). ``max_kept``:
        host bound on ``num_kept_B``."""
        self.lengths_B += num_kept_B
        self.max_length += max_kept

    def commit(self, chosen_Bk: torch.Tensor, num_chosen_B: torch.Tensor, max_chosen: int | None = None) -> None:
        """Keep a subset of the last forward's new tokens: for sequence b, the new tokens
        ``chosen_Bk[b, :num_chosen_B[b]]`` (indices among the n new ones, in the order they become
        committed). ``max_chosen`` (host int), if known, tightens ``max_length``; otherwise it
        grows by ``k``.
        """
        num_rows, k = chosen_Bk.shape
        source_Bk = self.lengths_B.unsqueeze(-1) + chosen_Bk
        target_Bk = self.lengths_B.unsqueeze(-1) + torch.arange(k, device=self.device)
        for store in (self._keys, self._values):
            for layer, slots in store.items():
                live = slots[:num_rows]
                # Targets past num_chosen get leftovers; they are beyond the new length, so unread.
                write_slots(live, target_Bk, read_slots(live, source_Bk))
        self.states.commit_lengths(num_chosen_B)   # a chain's: chosen_Bk[b, :num_chosen_B[b]] is 0, 1, ...
        self.lengths_B += num_chosen_B
        self.max_length += k if max_chosen is None else max_chosen

    def keep(self, rows: list[int]) -> None:
        """Drop every live sequence except ``rows`` (host list of current row indices, increasing)."""
        rows_device = torch.tensor(rows, dtype=torch.long, device=self.device)
        used = min(self.max_length, self.capacity)
        # Rows before the first dropped one stay where they are: only the rows after it move up.
        first = next((i for i, row in enumerate(rows) if row != i), len(rows))
        moved = rows_device[first:]
        for store in (self._keys, self._values):
            for slots in store.values():
                slots[first:len(rows), :, :used] = slots[moved, :, :used]
        self.states.keep(first, moved)
        self.lengths_B = self.lengths_B[rows_device]
        self._sequence_groups = [self._sequence_groups[r] for r in rows]
        still_live = sorted(set(self._sequence_groups))
        if len(still_live) < len(self._live_groups):
            prompt_rows = torch.tensor([self._live_groups.index(g) for g in still_live], device=self.device)
            for store in (self._prompt_keys, self._prompt_values):
                for prompt in store.values():
                    prompt[:len(still_live)] = prompt[prompt_rows]
            self._live_groups = still_live
        self._refresh_layout()

    def fork(self, copies: list[int]) -> None:
        """Live row b becomes ``copies[b]`` consecutive rows holding the same committed K/V (host list of
        ints >= 1, one per live row; rows stay sorted by group). The copies are exact: each is a row of its
        own from here on, so later tokens never touch its siblings'."""
        if len(copies) != self.num_live or min(copies, default=1) < 1:
            raise ValueError(f"fork needs one count >= 1 per live row ({self.num_live}), got {copies}")
        total = sum(copies)
        if total > self.row_capacity:
            raise ValueError(f"fork to {total} rows passes the cache's row_capacity={self.row_capacity}")
        source = torch.repeat_interleave(torch.arange(self.num_live, device=self.device),
                                         torch.tensor(copies, device=self.device))
        used = min(self.max_length, self.capacity)
        for store in (self._keys, self._values):
            for slots in store.values():
                slots[:total, :, :used] = slots[source, :, :used]  # the gather copies before the write
        self.states.fork(source)
        self.lengths_B = self.lengths_B[source]
        self._sequence_groups = [g for g, n in zip(self._sequence_groups, copies) for _ in range(n)]
        self._refresh_layout()

    def _refresh_layout(self) -> None:
        row_of_group = {g: row for row, g in enumerate(self._live_groups)}
        group_rows = [row_of_group[g] for g in self._sequence_groups]
        # Static slots (a compiled step): the stacked query block is (min(G, B), min(S, B)) groups x rows,
        # which holds every layout of B live rows, so that the step's graph depends on B alone (one graph per
        # bucket), not on which groups are still live. Its extra prompt rows hold earlier groups' K/V (finite),
        # read as fully visible and by no query of a live row.
        block = (min(len(self._prompt_lengths_host), len(group_rows)), min(self._num_samples, len(group_rows))) \
            if self._static_block and group_rows else None
        self.layout = LiveLayout.from_group_rows(group_rows, self.device, block)
        lengths = [self._prompt_lengths_host[g] for g in self._live_groups]
        lengths += [self.prompt_width] * (self.layout.num_groups - len(lengths))
        self.prompt_lengths_G = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.prompt_lengths_B = self.prompt_lengths_G[self.layout.group_B] if group_rows else \
            torch.zeros(0, dtype=torch.long, device=self.device)
        # Built here, not by each forward: a compiled step then reads the prompt width off this tensor's
        # shape (inductor fails to bind a size that enters a dynamic graph only as a host int).
        self.prompt_visible_GP = torch.arange(self.prompt_width, device=self.device) < self.prompt_lengths_G[:, None]
        """[G, P] bool: which prompt K/V slots of each live group hold a real token."""
        # A bool kept here, not a property reading the host lengths: a compiled step guards on what it reads,
        # and comparing the lengths themselves would compile the step again for every new set of prompts.
        self.prompts_fill_width = all(self._prompt_lengths_host[g] == self.prompt_width for g in self._live_groups)
        """Whether every live group's prompt is P tokens long (no padded prompt slots to hide)."""
