"""The draft's side of a speculative rollout: its KV cache and its three kinds of forward.

The draft keeps its own ``GroupedKVCache`` with the policy cache's geometry (prompt K/V once per
group, generated K/V per sequence, the same positions; see ``draft.py`` for the pair alignment):

* ``prefill_draft``: the prompt pairs, once per group;
* ``catch_up``: the pairs of tokens the policy committed since the draft last ran (a ragged number
  per sequence, padded to the longest), committed, giving the root's predicted feature;
* ``TreeDrafter``: one forward per tree level; the level's K nodes are written after the earlier
  levels' (uncommitted) nodes and see only their own ancestors there (``TreeLevelPlan``).

Legend: G groups, B live sequences, P longest prompt, m pending pairs, K nodes per level, Hd hidden
size, V vocabulary.
"""

from __future__ import annotations

import torch

from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.plans import DecodePlan, PrefillPlan
from turbogrpo.speculative.draft import DraftHead, shift_features
from turbogrpo.speculative.tree import DraftLevel


class TreeLevelPlan(DecodePlan):
    """``DecodePlan`` for n new tokens placed after ``m - n`` pending (written, uncommitted) ones.

    ``visible_Bnm`` says which of the m pending + new tokens each new token sees (itself included);
    all committed tokens and the prompt are visible as usual.

    With a sliding window the pending tokens' distances are taken as if they sat in consecutive
    positions; this only affects what the draft sees while drafting, never what is accepted.
    """

    def __init__(self, cache: GroupedKVCache, positions_Bn: torch.Tensor, visible_Bnm: torch.Tensor):
        num_new, num_seen = positions_Bn.shape[1], visible_Bnm.shape[-1]
        super().__init__(cache, positions_Bn, visible_Bnm[:, :, num_seen - num_new:])
        # Shift the new slots past the pending ones and widen the visibility to cover them. (A
        # ``num_pending`` argument of DecodePlan itself would make this override unnecessary.)
        seen_slots_Bm = cache.lengths_B.unsqueeze(-1) + torch.arange(num_seen, device=positions_Bn.device)
        self.slots_Bn = seen_slots_Bm[:, num_seen - num_new:]
        self.num_slots = cache.max_length + num_seen
        slot_index_L = torch.arange(self.num_slots, device=positions_Bn.device)
        committed_BnL = (slot_index_L < cache.lengths_B[:, None]).unsqueeze(1).expand(-1, num_new, -1)
        seen_BnL = torch.zeros_like(committed_BnL).scatter(
            2, seen_slots_Bm.unsqueeze(1).expand(-1, num_new, -1), visible_Bnm)
        self.own_visible_BnL = committed_BnL | seen_BnL


def prefill_draft(draft: DraftHead, cache: GroupedKVCache, prompts: list[torch.Tensor],
                  features_GPH: torch.Tensor) -> None:
    """Run the draft over each prompt's pairs once (right-padded rows, as the policy's prefill)."""
    device = cache.device
    ids_GP = torch.zeros(len(prompts), features_GPH.shape[1], dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):  # a loop over prompts, once per rollout
        ids_GP[row, :len(prompt)] = prompt
    positions_GP = torch.arange(ids_GP.shape[1], device=device).expand_as(ids_GP)
    draft(shift_features(features_GPH), ids_GP, positions_GP, PrefillPlan(cache))


def catch_up(draft: DraftHead, cache: GroupedKVCache, features_BmH: torch.Tensor, tokens_Bm: torch.Tensor,
             counts_B: torch.Tensor) -> torch.Tensor:
    """Feed each sequence its first ``counts_B[b]`` (>= 1) pending pairs and commit them.

    Returns the draft's predicted feature at each sequence's last pair ``[B, Hd]`` (the tree root's).
    """
    num_rows, width = tokens_Bm.shape
    device = tokens_Bm.device
    offsets_m = torch.arange(width, device=device)
    positions_Bm = cache.next_positions(offsets_m.expand(num_rows, -1))
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(num_rows, -1, -1)
    # Padding pairs sit after each row's real ones, so the causal mask keeps them out of sight.
    predicted_BmH = draft(features_BmH, tokens_Bm, positions_Bm, DecodePlan(cache, positions_Bm, causal))
    cache.commit(offsets_m.expand(num_rows, -1), counts_B, max_chosen=width)
    return predicted_BmH.gather(1, (counts_B - 1)[:, None, None].expand(-1, 1, predicted_BmH.shape[-1])).squeeze(1)


class TreeDrafter:
    """The ``DraftStep`` of ``build_tree``: expands one level per call, feeding the draft's own
    predicted features back in (a node's input is its parent's predicted feature and its token)."""

    def __init__(self, draft: DraftHead, cache: GroupedKVCache, root_features_BH: torch.Tensor):
        self.draft = draft
        self.cache = cache
        self.level_features_BKH = root_features_BH[:, None]

    def __call__(self, level: DraftLevel) -> torch.Tensor:
        hidden_size = self.level_features_BKH.shape[-1]
        parent_features = self.level_features_BKH.gather(
            1, level.parent_slots[:, :, None].expand(-1, -1, hidden_size))
        # A level-d node sits d positions past the root, whose pair the draft has committed.
        positions_BK = self.cache.next_positions(torch.full_like(level.tokens, level.depth - 1))
        plan = TreeLevelPlan(self.cache, positions_BK, level.attend)
        self.level_features_BKH = self.draft(parent_features, level.tokens, positions_BK, plan)
        return self.draft.logits(self.level_features_BKH).float().log_softmax(-1)
