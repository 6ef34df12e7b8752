"""The rollout's state cache: a hybrid model's recurrent states, one row per sequence, beside the KV cache.

A hybrid's linear-attention, Mamba-2 and short-convolution layers (``turbogrpo.mixers``) carry a fixed-size state
along the sequence instead of K/V: a gated DeltaNet's ``[Hv, Dk, Dv]`` matrix, a Mamba-2 scan's ``[H, P, Ns]``,
and each layer's convolution window (its last ``K - 1`` inputs, ``[K - 1, C]``). The prefill runs every distinct
prompt once (the chunked algorithm, over right-padded rows whose pad slots leave the state alone) and copies each
prompt's final states to its samples' rows; decoding advances each row's states by its new tokens (token by token,
the recurrent form) and overwrites them in place.

The rows are the KV cache's generated rows (``GroupedKVCache`` owns a ``RecurrentStates`` and keeps both in step):
``keep`` drops retired rows and ``fork`` copies rows, moving rows within storage allocated once for the cache's
``row_capacity`` rows, so decoding never reallocates. Unlike K/V, a state is not written per slot and committed
later: a forward advances it by each row's first ``num_valid`` new tokens (all of them by default; a multi-turn
feed's ragged rows fewer), and the commit that follows has nothing left to do for it.

The two layouts below are what a registered unit runs over (``mixers.registry.TokenLayout``); the attention plans
hand them out (``plans.PrefillPlan`` / ``plans.DecodePlan``). Host syncs: none.

Shapes: ``G`` prompts (groups), ``P`` longest prompt, ``B`` live rows, ``n`` new tokens per row, ``C`` a
convolution's channels, ``K`` its width.
"""

from __future__ import annotations

import torch
from torch import nn

from turbogrpo.mixers.forest import Step

RECURRENT_MAX_TOKENS = 4
"""Forwards of at most this many new tokens per row run the token-by-token form; longer ones (a prompt, a
multi-turn reply) the chunked one, which pads a row to its chunk size (64 tokens for the gated delta rule)."""


class RecurrentStates:
    """Every stateful layer's states, ``[row_capacity, ...]`` each, rows as the KV cache's generated rows: per
    module, its convolution window and its scan's states (a tuple, as the unit's step returns them)."""

    def __init__(self, row_capacity: int):
        self.row_capacity = row_capacity
        self._conv: dict[nn.Module, torch.Tensor] = {}
        self._scan: dict[nn.Module, tuple[torch.Tensor, ...]] = {}
        # A speculative forward's candidates, until its commit picks one per row (DecodeStates.per_length):
        # per module, the convolution's window [B, K - 1 + n, C] and each scan state after 0 .. n tokens
        # [B, n + 1, ...].
        self._pending_conv: dict[nn.Module, torch.Tensor] = {}
        self._pending_scan: dict[nn.Module, tuple[torch.Tensor, ...]] = {}

    def __len__(self) -> int:
        return len(self._conv) + len(self._scan)

    def _allocate(self, state_G: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
        """Storage for ``row_capacity`` rows, each live row ``b`` holding its group's ``state_G[group_B[b]]``."""
        storage = state_G.new_zeros(self.row_capacity, *state_G.shape[1:])
        torch.index_select(state_G, 0, group_B, out=storage[:group_B.shape[0]])
        return storage

    def store_prompt_conv(self, module: nn.Module, window_G: torch.Tensor, group_B: torch.Tensor) -> None:
        """Each prompt's last ``K - 1`` convolution inputs ``[G, K - 1, C]``, given to its rows (``group_B [B]``)."""
        self._conv[module] = self._allocate(window_G, group_B)

    def store_prompt_scan(self, module: nn.Module, states_G: tuple[torch.Tensor, ...], group_B: torch.Tensor) -> None:
        """Each prompt's final scan states (``[G, ...]`` each), given to its rows."""
        self._scan[module] = tuple(self._allocate(state, group_B) for state in states_G)

    def conv_rows(self, module: nn.Module, num_rows: int) -> torch.Tensor:
        """``module``'s convolution windows of the first ``num_rows`` rows ``[B, K - 1, C]`` (a view: writing it
        writes the cache)."""
        return self._conv[module][:num_rows]

    def scan_rows(self, module: nn.Module, num_rows: int) -> tuple[torch.Tensor, ...]:
        """``module``'s scan states of the first ``num_rows`` rows (views, as :meth:`conv_rows`)."""
        return tuple(state[:num_rows] for state in self._scan[module])

    def hold_candidates(self, module: nn.Module, *, conv_window: torch.Tensor | None = None,
                        scan_states: tuple[torch.Tensor, ...] | None = None) -> None:
        """Keep ``module``'s candidates of a speculative forward until :meth:`commit_lengths`: its convolution's
        window ``[B, K - 1 + n, C]``, or its scan states after 0 .. n tokens (``[B, n + 1, ...]`` each)."""
        if conv_window is not None:
            self._pending_conv[module] = conv_window
        if scan_states is not None:
            self._pending_scan[module] = scan_states

    def commit_lengths(self, num_kept_B: torch.Tensor) -> None:
        """Each row's states after its first ``num_kept_B [B]`` tokens (0: as before) of the last speculative
        forward (``DecodeStates.per_length``), into the stored rows; a no-op after any other forward."""
        if not self._pending_conv and not self._pending_scan:  # an attention model, or no chain forward
            return
        rows_B1 = torch.arange(num_kept_B.shape[0], device=num_kept_B.device)[:, None]
        for module, window in self._pending_conv.items():
            stored = self.conv_rows(module, num_kept_B.shape[0])
            stored.copy_(window[rows_B1, num_kept_B[:, None] + torch.arange(stored.shape[1], device=window.device)])
        for module, candidates in self._pending_scan.items():
            for stored, after in zip(self.scan_rows(module, num_kept_B.shape[0]), candidates):
                stored.copy_(after[rows_B1[:, 0], num_kept_B])
        self._pending_conv.clear()
        self._pending_scan.clear()

    def _storages(self):
        yield from self._conv.values()
        for states in self._scan.values():
            yield from states

    def keep(self, first: int, moved_rows: torch.Tensor) -> None:
        """Rows ``moved_rows`` (device, increasing) move up to rows ``first, first + 1, ...``, the rows before
        ``first`` staying: ``GroupedKVCache.keep`` moving its K/V rows."""
        for storage in self._storages():
            storage[first:first + moved_rows.shape[0]] = storage[moved_rows]   # the gather copies before the write

    def fork(self, source_B: torch.Tensor) -> None:
        """Row ``b`` becomes a copy of row ``source_B[b]`` (non-decreasing: ``GroupedKVCache.fork``)."""
        for storage in self._storages():
            storage[:source_B.shape[0]] = storage[source_B]


def conv_window_rows(window_BLC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                     num_new: int) -> torch.Tensor:
    """A causal depthwise convolution over rows ``[B, K - 1 + n, C]`` (the window before the new tokens, then
    them) -> ``[B, n, C]``, summed tap by tap in the order ``forest.path_conv`` sums (the trainer's numbers)."""
    weight_CK = weight_CK.to(window_BLC.dtype)
    out = window_BLC[:, :num_new] * weight_CK[:, 0]
    for k in range(1, weight_CK.shape[1]):
        out += window_BLC[:, k:k + num_new] * weight_CK[:, k]
    return out if bias_C is None else out + bias_C


class PrefillStates:
    """``TokenLayout`` of the prefill: right-padded prompt rows ``[G, P]`` from the zero state; each prompt's final
    states go to its samples' rows (``group_B``)."""

    def __init__(self, states: RecurrentStates, prompt_lengths_G: torch.Tensor, group_B: torch.Tensor,
                 prompt_width: int):
        self.states, self.lengths_G, self.group_B = states, prompt_lengths_G, group_B
        device = prompt_lengths_G.device
        self.valid_GP = torch.arange(prompt_width, device=device) < prompt_lengths_G[:, None]   # real prompt slots
        self.rows_G1 = torch.arange(prompt_lengths_G.shape[0], device=device)[:, None]

    def _rows(self, x_N: torch.Tensor) -> torch.Tensor:
        return x_N.unflatten(0, (self.lengths_G.shape[0], -1))   # [G, P, ...]

    def conv(self, module, x_NC, weight_CK, bias_C):
        x_GPC = self._rows(x_NC)
        width, prompt_width = weight_CK.shape[1], x_GPC.shape[1]
        window = torch.cat([x_GPC.new_zeros(x_GPC.shape[0], width - 1, x_GPC.shape[2]), x_GPC], dim=1)
        # A prompt's last K - 1 inputs: window slots length .. length + K - 2 (its pad slots come after them).
        last = self.lengths_G[:, None] + torch.arange(width - 1, device=x_NC.device)
        self.states.store_prompt_conv(module, window[self.rows_G1, last], self.group_B)
        return conv_window_rows(window, weight_CK, bias_C, prompt_width).flatten(0, 1)

    def scan(self, module, inputs, *, chunked: Step, recurrent: Step):
        rows = tuple(self._rows(x) for x in inputs)
        out, final = chunked(*rows, valid=self.valid_GP, initial_state=None)   # pad slots leave the state alone
        self.states.store_prompt_scan(module, final, self.group_B)
        return out.flatten(0, 1)


class DecodeStates:
    """``TokenLayout`` of ``n`` new tokens per live row ``[B, n]`` (a chain), from each row's stored states, which it
    advances in place by the row's first ``num_valid_B`` tokens (None: all ``n``). ``per_length`` (a speculative
    verification, whose accepted length the commit learns): the states after every length are kept as candidates
    instead, and ``RecurrentStates.commit_lengths`` stores each row's."""

    def __init__(self, states: RecurrentStates, num_rows: int, num_new: int, num_valid_B: torch.Tensor | None,
                 device: torch.device, per_length: bool = False):
        self.states, self.num_rows, self.num_new, self.num_valid_B = states, num_rows, num_new, num_valid_B
        self.per_length = per_length
        # Built once per forward, read by every layer: which new tokens advance each row's state, and the rows.
        self.valid_Bn = (torch.ones(num_rows, num_new, dtype=torch.bool, device=device) if num_valid_B is None
                         else torch.arange(num_new, device=device) < num_valid_B[:, None])
        self.rows_B1 = torch.arange(num_rows, device=device)[:, None]

    def conv(self, module, x_NC, weight_CK, bias_C):
        stored = self.states.conv_rows(module, self.num_rows)   # [B, K - 1, C]
        window = torch.cat([stored.to(x_NC.dtype), x_NC.unflatten(0, (self.num_rows, self.num_new))], dim=1)
        out = conv_window_rows(window, weight_CK, bias_C, self.num_new)
        if self.per_length:
            self.states.hold_candidates(module, conv_window=window)
        elif self.num_valid_B is None:
            stored.copy_(window[:, self.num_new:])
        else:   # the K - 1 inputs ending at each row's last valid token: window slots num_valid .. + K - 2
            last = self.num_valid_B[:, None] + torch.arange(stored.shape[1], device=x_NC.device)
            stored.copy_(window[self.rows_B1, last])
        return out.flatten(0, 1)

    def scan(self, module, inputs, *, chunked: Step, recurrent: Step):
        rows = tuple(x.unflatten(0, (self.num_rows, self.num_new)) for x in inputs)
        stored = self.states.scan_rows(module, self.num_rows)
        if self.per_length:
            return self._scan_every_length(module, rows, stored, recurrent)
        step = recurrent if self.num_new <= RECURRENT_MAX_TOKENS else chunked
        out, final = step(*rows, valid=self.valid_Bn, initial_state=tuple(stored))
        for state, new in zip(stored, final):
            state.copy_(new)
        return out.flatten(0, 1)

    def _scan_every_length(self, module, rows, stored, recurrent: Step) -> torch.Tensor:
        """The recurrence token by token, keeping the states after every length as ``module``'s candidates."""
        outputs, states, after = [], tuple(stored), [tuple(stored)]
        for t in range(self.num_new):
            out, states = recurrent(*(x[:, t:t + 1] for x in rows), valid=self.valid_Bn[:, t:t + 1],
                                    initial_state=states)
            outputs.append(out)
            after.append(states)
        self.states.hold_candidates(module, scan_states=tuple(torch.stack(lengths, 1) for lengths in zip(*after)))
        return torch.cat(outputs, 1).flatten(0, 1)
