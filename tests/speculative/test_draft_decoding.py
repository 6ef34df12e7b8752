"""The draft's cache: prefill, catch-up and tree levels equal one causal forward over the same pairs."""

import pytest
import torch

from tests.speculative.speculative_helpers import tiny_policy
from turbogrpo.speculative.draft import CausalPlan, DraftHead, shift_features
from turbogrpo.speculative.draft_training import prompt_features as policy_features
from turbogrpo.speculative.draft_decoding import DraftKVCache, TreeDrafter, catch_up, prefill_draft
from turbogrpo.speculative.tree import DraftLevel

ATOL = 2e-5


@pytest.mark.parametrize("arch,overrides", [("qwen2", {}), ("mistral", {"sliding_window": 4})])
def test_cached_draft_calls_equal_a_full_causal_forward(arch, overrides):
    policy = tiny_policy(arch, **overrides)
    draft = DraftHead(policy)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(64, (n,), generator=g) for n in (5, 3)]
    completions = [torch.randint(64, (6,), generator=g) for _ in range(4)]   # 2 samples per prompt
    sequences = [torch.cat([prompts[i // 2], c]) for i, c in enumerate(completions)]
    features = policy_features(policy, sequences)
    with torch.no_grad():
        full = [draft(shift_features(f[None]), s[None], torch.arange(len(s))[None], CausalPlan())[0]
                for f, s in zip(features, sequences)]
        cache = DraftKVCache([5, 3], 2, capacity=16, device=torch.device("cpu"))
        width = 5
        prompt_features = torch.zeros(2, width, 32)
        prompt_features[0], prompt_features[1, :3] = features[0][:5], features[2][:3]
        prefill_draft(draft, cache, prompts, prompt_features)
        # Catch up on a ragged number of pairs per sequence: 3, 1, 2, 3 completion tokens.
        counts = torch.tensor([3, 1, 2, 3])
        pair_features = torch.stack([f[p - 1:p + 2] for f, p in zip(features, (5, 5, 3, 3))])
        pair_tokens = torch.stack([c[:3] for c in completions])
        root = catch_up(draft, cache, pair_features, pair_tokens, counts)
        for b, (n_prompt, count) in enumerate(zip((5, 5, 3, 3), counts.tolist())):
            torch.testing.assert_close(root[b], full[b][n_prompt + count - 1], atol=ATOL, rtol=0)
        # A second catch-up continues where each sequence stopped.
        counts2 = torch.tensor([1, 2, 1, 1])
        starts = [n + c for n, c in zip((5, 5, 3, 3), counts.tolist())]
        pair_features = torch.stack([f[s - 1:s + 1] for f, s in zip(features, starts)])
        pair_tokens = torch.stack([seq[s:s + 2] for seq, s in zip(sequences, starts)])
        root = catch_up(draft, cache, pair_features, pair_tokens, counts2)
        for b, (s, count) in enumerate(zip(starts, counts2.tolist())):
            torch.testing.assert_close(root[b], full[b][s + count - 1], atol=ATOL, rtol=0)


def test_tree_levels_see_only_their_ancestors():
    policy = tiny_policy()
    draft = DraftHead(policy)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    with torch.no_grad():
        cache = DraftKVCache([5], 1, capacity=16, device=torch.device("cpu"))
        prefill_draft(draft, cache, [prompt], torch.randn(1, 5, 32))
        root_features = catch_up(draft, cache, torch.randn(1, 1, 32), torch.tensor([[9]]), torch.tensor([1]))
        drafter = TreeDrafter(draft, cache, root_features)
        # Level 1: two children of the root; level 2: children of slot 1 and slot 0, in that order.
        eye = torch.eye(2, dtype=torch.bool)[None]
        drafter(DraftLevel(torch.tensor([[7, 8]]), torch.zeros(1, 2, dtype=torch.long), eye, 1))
        level1 = drafter.level_features_BKH.clone()
        attend = torch.tensor([[[False, True, True, False], [True, False, False, True]]])
        drafter(DraftLevel(torch.tensor([[11, 12]]), torch.tensor([[1, 0]]), attend, 2))
        level2 = drafter.level_features_BKH
        # Reference: each node's path as a plain causal sequence after the committed context.
        context_len = cache.lengths_B.item()
        for slot, (parent, token) in enumerate(((1, 11), (0, 12))):
            ref_cache = DraftKVCache([5], 1, capacity=16, device=torch.device("cpu"))
            ref_cache.keys, ref_cache.values = {0: cache.keys[0].clone()}, {0: cache.values[0].clone()}
            ref_cache.lengths_B, ref_cache.max_length = cache.lengths_B.clone(), context_len
            ref = TreeDrafter(draft, ref_cache, root_features)
            ref(DraftLevel(torch.tensor([[(7, 8)[parent]]]), torch.zeros(1, 1, dtype=torch.long),
                           torch.ones(1, 1, 1, dtype=torch.bool), 1))
            torch.testing.assert_close(ref.level_features_BKH[0, 0], level1[0, parent], atol=ATOL, rtol=0)
            ref(DraftLevel(torch.tensor([[token]]), torch.zeros(1, 1, dtype=torch.long),
                           torch.ones(1, 1, 2, dtype=torch.bool), 2))
            torch.testing.assert_close(ref.level_features_BKH[0, 0], level2[0, slot], atol=ATOL, rtol=0)


def test_keep_drops_rows():
    cache = DraftKVCache([2, 3], 2, capacity=4, device=torch.device("cpu"))
    cache.store_prompt(0, torch.arange(2 * 3.0).view(2, 1, 3, 1), torch.zeros(2, 1, 3, 1))
    cache.commit(torch.tensor([1, 2, 3, 4]), 4)
    cache.keep([1, 2])
    assert cache.lengths_B.tolist() == [2, 3] and cache.prompt_lengths_B.tolist() == [2, 3]
    assert cache.keys[0][:, 0, :3, 0].tolist() == [[0, 1, 2], [3, 4, 5]]
