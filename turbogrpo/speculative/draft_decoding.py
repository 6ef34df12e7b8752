"""The draft's side of a speculative rollout: its KV cache and its three kinds of forward.

The draft is one layer, so its cache is laid out for the fewest operations per call rather than
for the least memory: every sequence has its own dense row ``[P + C]`` of slots, the prompt's K/V
copied into each of the group's rows at prefill (one layer's worth; the policy's cache keeps one
copy per group), so that every draft call is a single ``scaled_dot_product_attention`` with one mask.
Positions are the policy's (see ``draft.py`` for the pair alignment):

* ``prefill_draft``: the prompt pairs, once per group;
* ``catch_up``: the pairs of tokens the policy committed since the draft last ran (a ragged number
  per sequence, padded to the longest), committed, giving the root's predicted feature;
* ``TreeDrafter``: one forward per tree level; the level's K nodes are written after the earlier
  levels' (uncommitted) nodes and see only their own ancestors there.

An "eagle3" draft reads several of the policy's layers (``draft.py``); ``TappedFeatures`` keeps their
outputs per emitted token beside the engine's final features, from the rollout's own forwards.

Legend: G groups, B live sequences, P longest prompt, C generated slots, S = P + C, n new tokens,
m pending + new tokens, Hkv key/value heads, D head dim, Hd hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turbogrpo.rollout.kv_cache import write_slots
from turbogrpo.rollout.plans import PrefillPlan, padded_prompts
from turbogrpo.speculative.draft import DraftHead, LayerTap, check_prompt_lengths, shift_features
from turbogrpo.speculative.tree import DraftLevel


class DraftKVCache:
    """Per-sequence K/V rows ``[B, Hkv, S, D]`` per draft layer: slots ``< prompt_length`` hold the
    prompt, slot ``P + j`` the draft pair of completion token j; ``lengths_B`` of them are committed.
    New tokens are written after the committed ones (and after ``num_pending`` earlier, uncommitted ones)."""

    def __init__(self, prompt_lengths: list[int], num_samples: int, capacity: int, device: torch.device):
        self.prompt_width = max(prompt_lengths)
        self.capacity = capacity
        self.device = device
        groups = torch.arange(len(prompt_lengths), device=device).repeat_interleave(num_samples)
        self.group_B = groups
        self.prompt_lengths_B = torch.tensor(prompt_lengths, device=device)[groups]
        self.lengths_B = torch.zeros(len(groups), dtype=torch.long, device=device)
        self.max_length = 0
        """Host-side bound on ``lengths_B``: calls read slots ``< P + max_length + m`` only."""
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def num_live(self) -> int:
        return self.lengths_B.shape[0]

    def next_positions(self, depths_Bn: torch.Tensor) -> torch.Tensor:
        """Position ids ``[B, n]`` of new tokens at ``depths_Bn`` past each sequence's committed tokens."""
        return (self.prompt_lengths_B + self.lengths_B).unsqueeze(-1) + depths_Bn

    def store_prompt(self, layer: int, key_GKPD: torch.Tensor, value_GKPD: torch.Tensor) -> None:
        """Copy each group's prompt K/V into its sequences' rows (allocating the rows)."""
        shape = (self.num_live, key_GKPD.shape[1], self.prompt_width + self.capacity, key_GKPD.shape[3])
        self.keys[layer] = key_GKPD.new_zeros(shape)
        self.values[layer] = value_GKPD.new_zeros(shape)
        self.keys[layer][:, :, :self.prompt_width] = key_GKPD[self.group_B]
        self.values[layer][:, :, :self.prompt_width] = value_GKPD[self.group_B]

    def commit(self, counts_B: torch.Tensor, max_count: int) -> None:
        """Keep the first ``counts_B[b]`` of the last call's new tokens (they sit right after the
        committed ones, so nothing moves)."""
        self.lengths_B = self.lengths_B + counts_B
        self.max_length += max_count

    def keep(self, rows: list[int]) -> None:
        """Drop every sequence except ``rows`` (host list of current row indices, increasing)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        used = self.prompt_width + min(self.max_length, self.capacity)
        for store in (self.keys, self.values):
            for layer, rows_KSD in store.items():
                rows_KSD[:len(rows), :, :used] = rows_KSD[index, :, :used]
                store[layer] = rows_KSD[:len(rows)]
        self.group_B = self.group_B[index]
        self.prompt_lengths_B = self.prompt_lengths_B[index]
        self.lengths_B = self.lengths_B[index]


class DraftStepPlan:
    """n new tokens per sequence, written after ``m - n`` pending ones; ``visible_Bnm`` says which of
    the m pending + new tokens each new token sees (itself included). The prompt and the committed
    tokens are always visible. One SDPA call per layer; the mask is built once.

    With a sliding window the pending tokens' distances are taken as if they sat in consecutive
    positions; this only affects what the draft sees while drafting, never what is accepted.
    """

    def __init__(self, cache: DraftKVCache, positions_Bn: torch.Tensor, visible_Bnm: torch.Tensor):
        num_rows, num_new = positions_Bn.shape
        num_seen = visible_Bnm.shape[-1]
        device = positions_Bn.device
        width = cache.prompt_width
        self.cache = cache
        self.positions_Bn = positions_Bn
        seen_slots_Bm = width + cache.lengths_B[:, None] + torch.arange(num_seen, device=device)
        self.slots_Bn = seen_slots_Bm[:, num_seen - num_new:]
        self.num_slots = width + cache.max_length + num_seen
        slot_S = torch.arange(self.num_slots, device=device)
        always_BS = (slot_S < cache.prompt_lengths_B[:, None]) | (
            (slot_S >= width) & (slot_S < width + cache.lengths_B[:, None]))
        visible_BnS = always_BS[:, None, :].expand(-1, num_new, -1).scatter(
            2, seen_slots_Bm[:, None, :].expand(-1, num_new, -1), visible_Bnm)
        self.visible_BnS = visible_BnS
        self._masks: dict[int | None, torch.Tensor] = {}

    def _mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self._masks:
            mask = self.visible_BnS
            if sliding_window is not None:
                width = self.cache.prompt_width
                slot_S = torch.arange(self.num_slots, device=mask.device)
                key_positions_BS = torch.where(slot_S < width, slot_S,
                                               self.cache.prompt_lengths_B[:, None] + slot_S - width)
                mask = mask & (self.positions_Bn[:, :, None] - key_positions_BS[:, None, :] < sliding_window)
            self._masks[sliding_window] = mask[:, None]
        return self._masks[sliding_window]

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 scaling: float, sliding_window: int | None) -> torch.Tensor:
        keys, values = self.cache.keys[module.layer_idx], self.cache.values[module.layer_idx]
        write_slots(keys, self.slots_Bn, key)
        write_slots(values, self.slots_Bn, value)
        out = F.scaled_dot_product_attention(query, keys[:, :, :self.num_slots], values[:, :, :self.num_slots],
                                             attn_mask=self._mask(sliding_window), scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)


def draft_prompt_lengths(draft: DraftHead, prompts: list[torch.Tensor]) -> list[int]:
    """The number of prompt pairs the draft sees per prompt (its cache's prompt lengths): all of them, or
    one fewer when its layout skips the first pair (``draft.py``); a ValueError for a prompt with none."""
    lengths, start = [len(p) for p in prompts], draft.layout.context_start
    check_prompt_lengths(lengths, start)
    return [n - start for n in lengths]


def prefill_draft(draft: DraftHead, cache: DraftKVCache, prompts: list[torch.Tensor],
                  features_GPH: torch.Tensor) -> None:
    """Run the draft over each prompt's pairs once (right-padded rows, as the policy's prefill), from the
    first pair its layout sees (``cache`` is sized by ``draft_prompt_lengths``)."""
    start = draft.layout.context_start
    draft(draft.input_features(shift_features(features_GPH)[:, start:]), *padded_prompts([p[start:] for p in prompts]),
          PrefillPlan(cache))


def catch_up(draft: DraftHead, cache: DraftKVCache, features_BmH: torch.Tensor, tokens_Bm: torch.Tensor,
             counts_B: torch.Tensor) -> torch.Tensor:
    """Feed each sequence its first ``counts_B[b]`` pending pairs (policy features ``[B, m, draft.feature_width]``,
    tokens ``[B, m]``) and commit them.

    Returns the draft's predicted feature at each sequence's last pair ``[B, Hd]`` (the tree root's). A
    row with no pending pair (a multi-turn conversation waiting for its environment) commits nothing and
    gets its first padding column's feature, which no accepted token depends on.
    """
    num_rows, width = tokens_Bm.shape
    device = tokens_Bm.device
    positions_Bm = cache.next_positions(torch.arange(width, device=device).expand(num_rows, -1))
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(num_rows, -1, -1)
    # Padding pairs sit after each row's real ones, so the causal mask keeps them out of sight.
    predicted_BmH = draft(draft.input_features(features_BmH), tokens_Bm, positions_Bm,
                          DraftStepPlan(cache, positions_Bm, causal))
    cache.commit(counts_B, width)
    last_B = (counts_B - 1).clamp(min=0)
    return predicted_BmH.gather(1, last_B[:, None, None].expand(-1, 1, predicted_BmH.shape[-1])).squeeze(1)


class TreeDrafter:
    """The ``DraftStep`` of ``build_tree``: expands one level per call, feeding the draft's own
    predicted features back in (a node's input is its parent's predicted feature and its token)."""

    def __init__(self, draft: DraftHead, cache: DraftKVCache, root_features_BH: torch.Tensor):
        self.draft = draft
        self.cache = cache
        self.level_features_BKH = root_features_BH[:, None]

    def __call__(self, level: DraftLevel) -> torch.Tensor:
        hidden_size = self.level_features_BKH.shape[-1]
        parent_features = self.level_features_BKH.gather(
            1, level.parent_slots[:, :, None].expand(-1, -1, hidden_size))
        # A level-d node sits d positions past the root, whose pair the draft has committed.
        positions_BK = self.cache.next_positions(torch.full_like(level.tokens, level.depth - 1))
        plan = DraftStepPlan(self.cache, positions_BK, level.attend)
        self.level_features_BKH = self.draft(parent_features, level.tokens, positions_BK, plan)
        return self.draft.proposals(self.level_features_BKH)


class TappedFeatures:
    """The outputs of the policy layers an "eagle3" draft reads, per completion and output column
    ``[N, T, k * Hd]``, beside the engine's final features (``OutputBuffers.hidden_NTH``, same columns: column j
    holds what the forward that predicted token j gave). Filled from the rollout's own forwards through a
    ``LayerTap``: the prompts' prefill, each plain step and each tree verification (the accepted path)."""

    def __init__(self, tap: LayerTap, prompt_lengths: list[int], num_samples: int, num_columns: int,
                 prompt_final_GPH: torch.Tensor):
        """Call right after the prompts' prefill (the tap's latest forward), whose final features are
        ``prompt_final_GPH``; column 0 (the first token, drawn from the prompt's last position) is filled."""
        self.tap = tap
        self.prompt_GPX = tap.features(prompt_final_GPH)[..., :-prompt_final_GPH.shape[-1]]
        groups = torch.arange(len(prompt_lengths), device=prompt_final_GPH.device)
        last_G = torch.tensor(prompt_lengths, device=groups.device) - 1
        first_NX = self.prompt_GPX[groups, last_G].repeat_interleave(num_samples, dim=0)
        self.tapped_NTX = first_NX.new_zeros(first_NX.shape[0], num_columns, first_NX.shape[-1])
        self.tapped_NTX[:, 0] = first_NX

    def prompt_features(self, prompt_final_GPH: torch.Tensor) -> torch.Tensor:
        """The prompts' policy features ``[G, P, (k + 1) * Hd]``."""
        return torch.cat([self.prompt_GPX, prompt_final_GPH], dim=-1)

    def write_latest(self, completion_B: torch.Tensor, first_column_B: torch.Tensor,
                     path_BD: torch.Tensor | None = None) -> None:
        """Keep the tap's latest forward (``[B, n, Hd]`` per tapped layer) at columns ``first_column_B + d``
        of each row's completion: its n tokens in order (a plain step: n = 1), or the nodes ``path_BD`` of
        each row's accepted path (a tree). Columns past a row's accepted count get leftovers, as in ``emit``."""
        tapped_BnX = torch.cat([self.tap.outputs[i] for i in self.tap.indices], dim=-1)
        if path_BD is not None:
            tapped_BnX = tapped_BnX.gather(1, path_BD[:, :, None].expand(-1, -1, tapped_BnX.shape[-1]))
        columns_Bn = first_column_B[:, None] + torch.arange(tapped_BnX.shape[1], device=first_column_B.device)
        self.tapped_NTX[completion_B[:, None].expand_as(columns_Bn), columns_Bn] = tapped_BnX.to(self.tapped_NTX.dtype)

    def read(self, rows_Bm: torch.Tensor, columns_Bm: torch.Tensor, final_BmH: torch.Tensor) -> torch.Tensor:
        """The policy features ``[B, m, (k + 1) * Hd]`` at completions ``rows_Bm``, columns ``columns_Bm``,
        whose final features are ``final_BmH``."""
        return torch.cat([self.tapped_NTX[rows_Bm, columns_Bm], final_BmH], dim=-1)

    def close(self) -> None:
        self.tap.close()
