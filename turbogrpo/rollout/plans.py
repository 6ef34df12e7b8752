"""Attention plans of the rollout engine, and the two forwards built on them.

``prefill`` runs every distinct prompt once (right-padded, causal) and leaves its K/V in the cache.
``forward_new_tokens`` runs n new tokens per live sequence: each attends to its group's prompt,
to its own committed tokens and to the new tokens its ``ancestors`` mask allows (plain decoding:
n = 1; speculative verification: a token tree). The prompt part is computed per group, with all of
the group's live samples' queries stacked into one product; the per-sequence part is batched over
sequences; the two are merged by log-sum-exp.

A hybrid model's recurrent layers (``turbogrpo.mixers``) run through the plans' ``recurrent_layout()``: the
prefill computes each prompt's states once and gives them to its samples' rows, a forward of new tokens
advances each row's states (``states.py``; the cache keeps them). A token tree (``ancestors`` other than a
chain) has no single state per row: a hybrid speculates with chains alone (``turbogrpo.speculative``).

Legend: ``G`` live groups, ``B`` live sequences, ``n`` new tokens per sequence, ``H``/``Hkv`` query
and key/value heads, ``r = H / Hkv``, ``D`` head dim, ``P`` longest prompt, ``L`` generated slots
read, ``S`` max live samples per group, ``Hd`` hidden size.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from turbogrpo.hook import causal_band, run_decoder
from turbogrpo.rollout.attention import (kernel_partial_attention, kernel_prompt_attention, merge_partials,
                                         partial_attention, partial_attention_for, prompt_attention_for,
                                         reduced_partial_attention)
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.states import DecodeStates, PrefillStates


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float,
                     sliding_window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention over right-padded rows: ``[B, H, T, D]`` queries,
    ``[B, Hkv, T, D]`` keys/values -> ``[B, T, H, D]``. Padding sits after every real query."""
    mask = causal_band(query.shape[2], sliding_window, query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


class PromptStore(Protocol):
    """A KV cache that keeps a prefill's prompt K/V (the policy's ``GroupedKVCache``, the draft's cache)."""

    def store_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None: ...


class PrefillPlan:
    """Causal attention within each right-padded prompt row; stores the prompt K/V in the cache
    (any cache with ``store_prompt(layer, key, value)``: the policy's, or the draft's).

    Right padding keeps every real query's causal window free of padding, so no key mask is needed.
    """

    def __init__(self, cache: PromptStore):
        self.cache = cache
        self._states_layout: PrefillStates | None = None

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 scaling: float, sliding_window: int | None) -> torch.Tensor:
        self.cache.store_prompt(module.layer_idx, key, value)
        return causal_attention(query, key, value, scaling=scaling, sliding_window=sliding_window)

    def recurrent_layout(self) -> PrefillStates:
        """What a hybrid's recurrent layers run over: each prompt row from the zero state, its final states
        stored for its samples (the policy's ``GroupedKVCache`` only: a draft has no recurrent layers)."""
        if self._states_layout is None:   # once per forward, for every recurrent layer
            cache = self.cache
            self._states_layout = PrefillStates(cache.states, cache.prompt_lengths_G, cache.layout.group_B,
                                                cache.prompt_width)
        return self._states_layout


def padded_prompts(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[G, P]`` of the prompts, right-padded with token 0, and their position ids ``[G, P]``."""
    ids_GP = nn.utils.rnn.pad_sequence(prompts, batch_first=True)
    return ids_GP, torch.arange(ids_GP.shape[1], device=ids_GP.device).expand_as(ids_GP)


def prefill_all_positions(model: nn.Module, cache: GroupedKVCache, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Run each prompt once, storing its K/V; return the final hidden state at every position ``[G, P, Hd]``."""
    return run_decoder(model, *padded_prompts(prompts), PrefillPlan(cache))


def prefill(model: nn.Module, cache: GroupedKVCache, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Run each prompt once; return the final hidden state at each prompt's last token ``[G, Hd]``."""
    lengths = torch.tensor([len(p) for p in prompts], device=cache.device)
    hidden_GPH = prefill_all_positions(model, cache, prompts)
    return hidden_GPH[torch.arange(len(prompts), device=cache.device), lengths - 1]


class DecodePlan:
    """Attention of n new tokens per live sequence (see the module docstring).

    Masks (as additive biases) and index tensors are built once per forward and shared by all layers.
    """

    def __init__(self, cache: GroupedKVCache, positions_Bn: torch.Tensor, ancestors_Bnn: torch.Tensor,
                 num_valid_B: torch.Tensor | None = None, states_per_length: bool = False):
        self.cache = cache
        self.positions_Bn = positions_Bn
        self.num_valid_B, self.states_per_length = num_valid_B, states_per_length
        self._states_layout: DecodeStates | None = None
        num_new = positions_Bn.shape[1]
        device = positions_Bn.device
        self.slots_Bn = cache.lengths_B.unsqueeze(-1) + torch.arange(num_new, device=device)
        slot_index_L = cache.slot_index(num_new)
        self.num_slots = slot_index_L.shape[0]
        self.slot_index_L = slot_index_L
        committed_BnL = (slot_index_L < cache.lengths_B[:, None]).unsqueeze(1).expand(-1, num_new, -1)
        new_BnL = torch.zeros_like(committed_BnL).scatter(
            2, self.slots_Bn.unsqueeze(1).expand(-1, num_new, -1), ancestors_Bnn)
        self.own_visible_BnL = committed_BnL | new_BnL
        self._biases: dict[tuple, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 scaling: float, sliding_window: int | None) -> torch.Tensor:
        num_rows, num_heads, num_new, head_dim = query.shape
        num_kv_heads = key.shape[1]
        group_size = num_heads // num_kv_heads
        layer = module.layer_idx
        self.cache.write(layer, key, value, self.slots_Bn)
        # A sliding window can hide a query's whole prompt part: the matmul partial (or, in a compiled CPU step, the
        # kernel) handles that, the fused one does not.
        partial = prompt_attention_for(query.device, may_hide_all=sliding_window is not None)
        own_partial = partial_attention_for(query.device, sliding_window is not None, num_rows * num_kv_heads,
                                            group_size * num_new, query.dtype)
        # Query head h reads key/value head h // r (as in HF's repeat_kv): rows of one KV head are (r, n).
        query_BKMD = query.reshape(num_rows, num_kv_heads, group_size * num_new, head_dim)
        prompt_bias, _ = self._attention_biases(sliding_window, group_size, _bias_dtype(partial, query))
        _, own_bias = self._attention_biases(sliding_window, group_size, _bias_dtype(own_partial, query))
        out_prompt, lse_prompt = self._prompt_attention(layer, query_BKMD, prompt_bias, partial, scaling)
        keys, values = self.cache.generated(layer, self.num_slots)
        out_own, lse_own = own_partial(query_BKMD, keys, values, own_bias, scaling)
        out_BKMD = merge_partials(out_prompt, lse_prompt, out_own, lse_own)
        return out_BKMD.reshape(num_rows, num_heads, num_new, head_dim).transpose(1, 2).to(query.dtype)

    def recurrent_layout(self) -> DecodeStates:
        """What a hybrid's recurrent layers run over: each row's new tokens (a chain) from its stored states,
        advanced by its first ``num_valid_B`` of them, or kept after every length until the commit."""
        if self._states_layout is None:   # once per forward, for every recurrent layer
            num_rows, num_new = self.positions_Bn.shape
            self._states_layout = DecodeStates(self.cache.states, num_rows, num_new, self.num_valid_B,
                                               self.positions_Bn.device, self.states_per_length)
        return self._states_layout

    def _prompt_attention(self, layer: int, query_BKMD: torch.Tensor, bias: torch.Tensor | None, partial,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """All live samples of a group attend to the group's single prompt K/V in one product: their
        queries are stacked per group (a reshape when every group has all its rows, a scatter if not)."""
        layout = self.cache.layout
        num_rows, num_kv_heads, rows_per_seq, head_dim = query_BKMD.shape
        keys_GKPD, values_GKPD = self.cache.prompt(layer)
        stacked_shape = (layout.num_groups, layout.max_per_group, num_kv_heads, rows_per_seq, head_dim)
        if layout.dense:
            stacked = query_BKMD.view(stacked_shape).transpose(1, 2)
            out, lse = partial(stacked.flatten(2, 3), keys_GKPD, values_GKPD, bias, scale)
            out = out.view(stacked.shape).transpose(1, 2).reshape(query_BKMD.shape)
            lse = lse.view(*stacked.shape[:-1], 1).transpose(1, 2).reshape(*query_BKMD.shape[:-1], 1)
            return out, lse
        stacked = query_BKMD.new_zeros(layout.num_groups, num_kv_heads, layout.max_per_group, rows_per_seq,
                                       head_dim)
        stacked[layout.group_B, :, layout.slot_B] = query_BKMD
        out, lse = partial(stacked.flatten(2, 3), keys_GKPD, values_GKPD, bias, scale)
        out = out.view(stacked.shape)[layout.group_B, :, layout.slot_B]
        lse = lse.view(*stacked.shape[:-1], 1)[layout.group_B, :, layout.slot_B]
        return out, lse

    def _attention_biases(self, sliding_window: int | None, group_size: int,
                          dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Additive masks of ``dtype``: (prompt part, broadcastable to ``[G, Hkv, S*r*n, P]``, None when
        every key is visible; own part, broadcastable to ``[B, Hkv, r*n, L]``), built once per
        (window, r, dtype)."""
        cached = self._biases.get((sliding_window, group_size, dtype))
        if cached is not None:
            return cached
        cache, layout = self.cache, self.cache.layout
        num_rows, num_new = self.positions_Bn.shape
        device = self.positions_Bn.device
        prompt_visible = None
        if not cache.prompts_fill_width:
            prompt_visible = cache.prompt_visible_GP[:, None, None, :]  # [G, 1, 1, P]
        own_visible = self.own_visible_BnL
        if sliding_window is not None:
            stacked_positions = torch.zeros(layout.num_groups, layout.max_per_group, num_new, dtype=torch.long,
                                            device=device)
            stacked_positions[layout.group_B, layout.slot_B] = self.positions_Bn
            query_positions = stacked_positions[:, :, None, :, None].expand(-1, -1, group_size, -1, -1)
            key_positions_P = torch.arange(cache.prompt_visible_GP.shape[1], device=device)
            in_window = query_positions.flatten(1, 3) - key_positions_P < sliding_window  # [G, S*r*n, P]
            prompt_visible = in_window.unsqueeze(1) if prompt_visible is None else \
                prompt_visible & in_window.unsqueeze(1)
            slot_positions_BL = cache.prompt_lengths_B[:, None] + self.slot_index_L
            slot_positions_BL = slot_positions_BL.scatter(1, self.slots_Bn, self.positions_Bn)
            own_visible = own_visible & (self.positions_Bn[:, :, None] - slot_positions_BL[:, None, :]
                                         < sliding_window)
        own_visible = own_visible.unsqueeze(1).expand(-1, group_size, -1, -1).reshape(
            num_rows, 1, group_size * num_new, self.num_slots)
        biases = (None if prompt_visible is None else _additive(prompt_visible, dtype), _additive(own_visible, dtype))
        self._biases[(sliding_window, group_size, dtype)] = biases
        return biases


def _bias_dtype(partial, query: torch.Tensor) -> torch.dtype:
    """The matmul, reduced and kernel partials add float32 biases to float32 scores; a fused kernel takes the query's
    dtype."""
    return torch.float32 if partial in (partial_attention, reduced_partial_attention, kernel_partial_attention,
                                        kernel_prompt_attention) else query.dtype


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as a score bias: 0 where visible, -inf where hidden."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def forward_new_tokens(model: nn.Module, cache: GroupedKVCache, input_ids_Bn: torch.Tensor,
                       depths_Bn: torch.Tensor | None = None,
                       ancestors_Bnn: torch.Tensor | None = None,
                       num_valid_B: torch.Tensor | None = None, states_per_length: bool = False) -> torch.Tensor:
    """Final hidden states ``[B, n, Hd]`` of n new tokens per live sequence.

    ``depths_Bn`` (default ``0..n-1``): each token's offset past the sequence's committed tokens, so
    its position id is ``prompt_length + committed + depth``. ``ancestors_Bnn`` (bool, default a
    causal chain): token i attends to new token j where True; it must include i itself. The new
    tokens' K/V are written to the cache but not committed: follow with ``cache.commit_all(n)`` or
    ``cache.commit(...)``. A hybrid's recurrent states advance at once, by each row's first ``num_valid_B [B]``
    new tokens (None: all n; the rest are padding its commit drops); with ``states_per_length`` (a chain's
    speculative verification), they keep their states after every length until ``cache.commit`` picks each row's.
    """
    num_rows, num_new = input_ids_Bn.shape
    device = input_ids_Bn.device
    if depths_Bn is None:
        depths_Bn = torch.arange(num_new, device=device).expand(num_rows, -1)
    if ancestors_Bnn is None:
        ancestors_Bnn = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril().expand(
            num_rows, -1, -1)
    positions_Bn = cache.next_positions(depths_Bn)
    plan = DecodePlan(cache, positions_Bn, ancestors_Bnn, num_valid_B, states_per_length)
    return run_decoder(model, input_ids_Bn, positions_Bn, plan)
