"""The trie's layout by hand, and its invariants on random tries."""

import pytest
import torch

from tests.tree.conftest import TRIE_SHAPES, random_masks_and_weights, random_sequences
from turbogrpo.tree import build_trie, micro_batches, trie_of_groups


def test_small_trie_by_hand():
    seqs = [torch.tensor(x) for x in [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3], [7, 8], [1, 2, 3, 4]]]
    trie = build_trie(seqs)
    # Preorder: [1 2] -> [3] -> [4], then [5]; then the second root [7 8].
    assert trie.input_ids.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert trie.position_ids.tolist() == [0, 1, 2, 3, 2, 0, 1]
    assert trie.node_start == (0, 2, 3, 4, 5) and trie.node_length == (2, 1, 1, 1, 2)
    assert trie.node_parent == (-1, 0, 1, 0, -1) and trie.node_level == (0, 1, 2, 1, 0)
    assert trie.subtree_end == (5, 4, 4, 5, 7)
    assert [t.tolist() for t in trie.sequence_tokens] == [[0, 1, 2, 3], [0, 1, 4], [0, 1, 2], [5, 6], [0, 1, 2, 3]]
    assert trie.predictor_of_token.tolist() == [-1, 0, 1, 2, 1, -1, 5]
    assert trie.scored_tokens.tolist() == [1, 2, 3, 4, 6]   # every token but the roots' first
    expected = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0],
                             [0, 0, 0, 0, 0, 1, 0],
                             [0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(trie.dense_mask(), expected)
    assert torch.equal(trie.dense_mask(sliding_window=2), expected & torch.tensor(
        [[abs(a - b) < 2 for b in [0, 1, 2, 3, 2, 0, 1]] for a in [0, 1, 2, 3, 2, 0, 1]]))


@pytest.mark.parametrize("shape", sorted(TRIE_SHAPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_trie_stores_every_sequence_along_its_path(shape, seed):
    seqs = random_sequences(**TRIE_SHAPES[shape], seed=seed)
    masks, weights = random_masks_and_weights(seqs, seed)
    trie = build_trie(seqs, masks, weights)
    for s, tokens in zip(seqs, trie.sequence_tokens):
        assert torch.equal(trie.input_ids[tokens], s)
        assert torch.equal(trie.position_ids[tokens], torch.arange(s.numel()))   # position = depth
        assert torch.equal(trie.predictor_of_token[tokens[1:]], tokens[:-1])    # predicted along the path
        mask = trie.dense_mask()
        # A token's visible keys are exactly the path above it.
        for i, t in enumerate(tokens.tolist()):
            assert torch.equal(torch.nonzero(mask[t]).squeeze(1), tokens[:i + 1].sort().values)
    # Each distinct prefix is stored once: the trie holds as many tokens as there are distinct prefixes.
    assert trie.num_tokens == len({tuple(s[:i + 1].tolist()) for s in seqs for i in range(s.numel())})
    assert torch.equal(trie.loss_weights, torch.cat([w[m] for w, m in zip(weights, masks)]))
    scored = trie.scored_tokens[trie.loss_token_index]
    assert torch.equal(trie.input_ids[scored], torch.cat([s[m] for s, m in zip(seqs, masks)]))


def test_single_turn_groups_are_the_one_level_case():
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9, 9])]
    completions = [[torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 4, 4])], [torch.tensor([8])]]
    trie = trie_of_groups(prompts, completions)
    assert trie.node_level == (0, 1, 1, 1, 0)   # a group of one completion is one node
    assert trie.num_tokens == 3 + 6 + 2 + 1
    assert trie.num_loss_tokens == [2, 1, 3, 1]


def test_micro_batches_split_between_whole_sequences():
    seqs = random_sequences(**TRIE_SHAPES["long-shared"], seed=3)
    budget = 260
    batches = micro_batches(seqs, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(seqs)))
    assert len(batches) > 1
    for batch in batches:
        trie = build_trie([seqs[i] for i in batch])
        assert trie.num_tokens <= budget
        for i, tokens in zip(batch, trie.sequence_tokens):   # whole paths, never cut
            assert torch.equal(trie.input_ids[tokens], seqs[i])
    # Greedy in sorted order: merging any two neighbouring batches would exceed the budget.
    sizes = [build_trie([seqs[i] for i in a + b]).num_tokens for a, b in zip(batches, batches[1:])]
    assert all(size > budget for size in sizes)


def test_micro_batches_refuse_a_path_over_the_budget():
    seqs = [torch.arange(10), torch.arange(4)]
    with pytest.raises(ValueError, match="sequence 0 has 10 tokens, over the micro-batch token budget of 8; "
                                         "a path cannot be split"):
        micro_batches(seqs, 8)


@pytest.mark.parametrize("masks, message", [
    ([torch.tensor([False, False, False])], "sequence 0 has no loss token"),
    ([torch.tensor([True, True, False])], "sequence 0 marks its first token as a loss token"),
    ([torch.tensor([False, True])], r"the loss mask of sequence 0 has shape \(2,\); it must match"),
])
def test_bad_loss_masks(masks, message):
    with pytest.raises(ValueError, match=message):
        build_trie([torch.tensor([1, 2, 3])], masks)


@pytest.mark.parametrize("sequences, message", [
    ([], "non-empty list"),
    ([torch.tensor([1])], "sequence 0 has 1 tokens"),
    ([torch.tensor([1.0, 2.0])], "sequence 0 must be a 1-D LongTensor"),
])
def test_bad_sequences(sequences, message):
    with pytest.raises(ValueError, match=message):
        build_trie(sequences)
