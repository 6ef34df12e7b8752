"""EAGLE-2 tree construction: a hand-computed tree and structural invariants."""

import math

import pytest
import torch

from tests.speculative.speculative_helpers import TableDraft
from turbogrpo.speculative.tree import DraftLevel, Proposals, TreeShape, ancestors_from_parents, build_tree

ROOT_PROBS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
CHILD_PROBS = {0: {2: 0.9, 3: 0.1}, 1: {4: 0.6, 5: 0.4}}  # children of tokens 0 and 1


def hand_draft(level: DraftLevel) -> torch.Tensor:
    logprobs = torch.full((*level.tokens.shape, 6), -30.0)
    for b in range(level.tokens.shape[0]):
        for slot, token in enumerate(level.tokens[b].tolist()):
            for child, p in CHILD_PROBS.get(token, {}).items():
                logprobs[b, slot, child] = math.log(p)
    return logprobs


@pytest.mark.parametrize("num_nodes,tokens,parents", [
    # candidates: 0 (.5), 1 (.3), 0->2 (.45), 0->3 (.05), 1->4 (.18), 1->5 (.12)
    (4, [9, 0, 1, 2], [0, 0, 0, 1]),
    (5, [9, 0, 1, 2, 4], [0, 0, 0, 1, 2]),
    (7, [9, 0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 2, 2]),
])
def test_hand_computed_tree(num_nodes, tokens, parents):
    tree = build_tree(torch.tensor([9]), ROOT_PROBS.log()[None], hand_draft, TreeShape(2, 2, num_nodes))
    assert tree.tokens.tolist() == [tokens]
    assert tree.parents.tolist() == [parents]
    assert tree.depths.tolist() == [[0, 1, 1] + [2] * (num_nodes - 3)]
    assert tree.path_logprobs[0, 3].item() == pytest.approx(math.log(0.45), abs=2e-3)
    assert tree.ancestors[0, 3].tolist() == [True, True, False, True] + [False] * (num_nodes - 4)
    assert tree.candidate_logprobs.shape == (1, 6)


@pytest.mark.parametrize("shape", [TreeShape(1, 5, 6), TreeShape(3, 4, 20), TreeShape(4, 3, 9), TreeShape(5, 1, 6)])
def test_random_trees_are_well_formed(shape):
    g = torch.Generator().manual_seed(0)
    V, B = 16, 32
    table = 3 * torch.randn(V, V, V, generator=g)
    root = torch.randint(V, (B,), generator=g)
    prev = torch.randint(V, (B,), generator=g)
    tree = build_tree(root, table[prev, root].log_softmax(-1), TableDraft(table, root), shape)
    N = shape.num_nodes
    assert tree.tokens.shape == (B, N) and tree.max_depth == shape.depth
    index = torch.arange(N)
    assert (tree.parents[:, 1:] < index[1:]).all()                                   # parents first
    assert torch.equal(tree.depths[:, 1:], tree.depths.gather(1, tree.parents)[:, 1:] + 1)
    assert (tree.depths <= shape.depth).all()
    assert torch.equal(tree.ancestors, ancestors_from_parents(tree.parents, shape.depth))
    # siblings have distinct tokens; children score below parents
    same_parent = (tree.parents[:, :, None] == tree.parents[:, None, :]) & ~torch.eye(N, dtype=torch.bool)
    same_parent[:, 0, :] = same_parent[:, :, 0] = False
    assert not (same_parent & (tree.tokens[:, :, None] == tree.tokens[:, None, :])).any()
    assert (tree.path_logprobs[:, 1:] < tree.path_logprobs.gather(1, tree.parents)[:, 1:]).all()
    # the kept nodes are the best-scoring candidates
    kept = tree.path_logprobs[:, 1:].sort(-1, descending=True).values
    best = tree.candidate_logprobs.topk(N - 1, -1).values
    torch.testing.assert_close(kept, best)


def test_frontier_attention_covers_ancestors_only():
    seen = []

    def recording_draft(level: DraftLevel) -> torch.Tensor:
        seen.append(level)
        return hand_draft(level)

    build_tree(torch.tensor([9]), ROOT_PROBS.log()[None], recording_draft, TreeShape(2, 3, 5))
    assert [level.depth for level in seen] == [1, 2]
    assert seen[0].attend.tolist() == [[[True, False], [False, True]]]
    # depth 2 frontier: 0->2 (parent slot 0) and 1->4 (parent slot 1)
    assert seen[1].tokens.tolist() == [[2, 4]] and seen[1].parent_slots.tolist() == [[0, 1]]
    assert seen[1].attend.tolist() == [[[True, False, True, False], [False, True, False, True]]]


@pytest.mark.parametrize("shape,match", [
    (TreeShape(0, 2, 3), "top_k"), (TreeShape(2, 0, 3), "depth"), (TreeShape(2, 2, 1), "num_nodes"),
    (TreeShape(2, 2, 8), "num_nodes"), (TreeShape(7, 1, 3), "vocabulary"),
])
def test_bad_shapes_are_value_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        build_tree(torch.tensor([9]), ROOT_PROBS.log()[None], hand_draft, shape)


def test_a_draft_vocabulary_gives_the_tree_of_its_minus_inf_padded_logprobs():
    """Proposals over a draft vocabulary (top-K read off its Vd entries) build the same tree as the
    same log-probs padded to the whole vocabulary with -inf (what drafting built before)."""
    g = torch.Generator().manual_seed(1)
    V, Vd, B = 64, 12, 8
    token_ids = torch.randperm(V, generator=g)[:Vd]
    table = 3 * torch.randn(V, Vd, generator=g)  # a draft that depends on the frontier token only

    def padded(subset):
        full = subset.new_full((*subset.shape[:-1], V), float("-inf"))
        return full.scatter_(-1, token_ids.expand(subset.shape), subset)

    def subset_of(tokens):
        return table[tokens].log_softmax(-1)

    root = torch.randint(V, (B,), generator=g)
    shape = TreeShape(3, 3, 10)
    sparse = build_tree(root, Proposals(subset_of(root), token_ids),
                        lambda level: Proposals(subset_of(level.tokens), token_ids), shape)
    dense = build_tree(root, padded(subset_of(root)), lambda level: padded(subset_of(level.tokens)), shape)
    for ours, theirs in zip(sparse, dense):
        assert ours == theirs if isinstance(ours, int) else torch.equal(ours, theirs)
    assert bool(torch.isin(sparse.tokens[:, 1:], token_ids).all())
