"""Token FLOPs of the three layouts of a trie, by hand."""

import torch

from turbogrpo.prefix.cost import ModelDims, layout_flops
from turbogrpo.tree import build_trie, trie_of_groups
from turbogrpo.tree.cost import tree_flops

DIMS = ModelDims(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, vocab=11)


def test_flops_of_a_two_turn_trie_by_hand():
    # Prompt [1 2 3], turns [4 5] and [6 7], then [8] and [9] below [4 5]: sequences 6, 6 and 5 tokens.
    seqs = [torch.tensor(s) for s in ([1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 5, 9], [1, 2, 3, 6, 7])]
    masks = [torch.arange(s.numel()) >= 3 for s in seqs]
    flops = tree_flops(DIMS, build_trie(seqs, masks))
    lm_head = 2 * 8 * 11 * (3 + 3 + 2)
    linear, pair = DIMS.linear_flops_per_token, DIMS.attention_flops_per_pair
    # Rows: 17 tokens; pairs 21 + 21 + 15.
    assert flops.rows == 17 * linear + 57 * pair + lm_head
    # Tree: 9 tokens at depths 0,1,2,3,4,5,5,3,4 -> pairs 1+2+3+4+5+6+6+4+5 = 36.
    assert flops.tree == 9 * linear + 36 * pair + lm_head
    # Prompt only: 3 + 3 + 3 + 2 tokens; pairs 6 + (3*3 + 6) * 2 + (2*3 + 3) = 45.
    assert flops.shared_prompt == 11 * linear + 45 * pair + lm_head


def test_one_level_trie_costs_what_the_prefix_layout_costs():
    prompts = [torch.tensor([1, 2, 3, 4])]
    completions = [[torch.tensor([5, 6]), torch.tensor([7, 8, 9])]]
    flops = tree_flops(DIMS, trie_of_groups(prompts, completions))
    prefix = layout_flops(DIMS, [4], [[2, 3]])
    assert (flops.tree, flops.shared_prompt, flops.rows) == (prefix.shared, prefix.shared, prefix.standard)
