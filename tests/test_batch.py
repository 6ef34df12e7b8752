"""Groups, the one ragged layout, by hand; it replaced the converters ``Rollout._per_group``,
``loop._regroup`` and ``update._flat`` and the offsets of ``StepBatch.groups``, ``plan_micro_batches``
and ``split_per_completion`` (equivalence with them was checked before they were removed)."""

import pytest
import torch

from turbogrpo.batch import Layout as Groups
from turbogrpo.prefix.layout import split_per_completion
from turbogrpo.rollout.types import Rollout, RolloutStats
from turbogrpo.train.microbatch import Chunk, plan_micro_batches
from turbogrpo.train.update import StepBatch

SIZES = [3, 1, 2, 4]  # K = 4 groups, N = 10 completions


def nested(sizes=SIZES):
    """Per group, per completion: a tensor [S] whose values say (group, completion)."""
    return [[torch.full((1 + (g + i) % 3,), 10 * g + i) for i in range(size)] for g, size in enumerate(sizes)]


def test_split_and_flatten_by_hand():
    groups = Groups(SIZES)
    assert groups.sizes == (3, 1, 2, 4) and groups.offsets == (0, 3, 4, 6, 10) and groups.num_completions == 10
    assert groups.split(list("abcdefghij")) == [["a", "b", "c"], ["d"], ["e", "f"], ["g", "h", "i", "j"]]
    assert Groups.flatten([[1, 2], [], [3]]) == [1, 2, 3] and Groups.of([[1, 2], [], [3]]) == Groups([2, 0, 1])
    assert list(groups.group(2)) == [4, 5]


def test_a_rollouts_layout_is_num_samples_per_prompt():
    num_samples = 3
    tokens = [torch.tensor([i]) for i in range(2 * num_samples)]
    rollout = Rollout([torch.tensor([1]), torch.tensor([2])], num_samples, tokens, tokens, ["stop"] * 6,
                      [i // num_samples for i in range(6)], None, RolloutStats())
    assert rollout.groups == Groups([3, 3])
    assert [[int(t) for t in group] for group in rollout.tokens_per_group()] == [[0, 1, 2], [3, 4, 5]]


def test_select_picks_groups_and_their_flat_positions():
    per_group = nested()
    advantages = torch.arange(10.0)
    batch = StepBatch.from_groups([torch.tensor([g]) for g in range(4)], per_group, advantages)
    kept = batch.select([3, 0])
    sub, index = Groups.of(per_group).select([3, 0])
    assert sub == kept.groups == Groups([4, 3]) and index == [6, 7, 8, 9, 0, 1, 2]
    assert torch.equal(kept.advantages, torch.tensor([6.0, 7, 8, 9, 0, 1, 2]))
    assert [int(c[0]) for c in kept.completions] == [30, 31, 32, 33, 0, 1, 2]
    assert [[int(c[0]) for c in run] for run in kept.chunk_completions([Chunk(0, 1, 3), Chunk(1, 2, 3)])] == [
        [31, 32], [2]]


def test_the_micro_batch_plan_and_the_packed_split_use_the_same_offsets():
    per_group = nested()
    lengths = [[t.numel() for t in group] for group in per_group]
    groups = Groups.of(per_group)
    for mb in plan_micro_batches([5] * 4, lengths, 12):
        assert mb.index == [i for c in mb.chunks for i in list(groups.group(c.group))[c.start:c.stop]]
    flat_tokens = torch.cat([t for group in per_group for t in group])
    split = split_per_completion(flat_tokens, lengths)
    assert Groups.of(split) == groups
    assert all(torch.equal(a, b) for a, b in zip(Groups.flatten(split), Groups.flatten(per_group)))


def test_split_refuses_a_wrong_count():
    with pytest.raises(ValueError, match="got 2 items for 3 completions"):
        Groups([1, 2]).split([0, 1])
