"""The packed layout, checked against values worked out by hand."""

import torch

from tests.prefix.conftest import PACKS, random_groups
from turbogrpo.batch import Groups
from turbogrpo.prefix.layout import PaddedIndex, pack_groups


def test_two_groups_by_hand():
    # group 0: prompt [10, 11, 12], completions [20, 21] and [30];  group 1: prompt [40], completion [50, 51]
    prompts = [torch.tensor([10, 11, 12]), torch.tensor([40])]
    completions = [[torch.tensor([20, 21]), torch.tensor([30])], [torch.tensor([50, 51])]]
    pack = pack_groups(prompts, completions)
    # flat: prompts first (positions 0-3), then completions (positions 4-8)
    assert pack.input_ids.tolist() == [10, 11, 12, 40, 20, 21, 30, 50, 51]
    assert pack.position_ids.tolist() == [0, 1, 2, 0, 3, 4, 3, 1, 2]
    # 20 <- last prompt token (flat 2); 21 <- 20 (flat 4); 30 <- flat 2; 50 <- 40 (flat 3); 51 <- 50 (flat 7)
    assert pack.predictor_index.tolist() == [2, 4, 2, 3, 7]
    assert pack.target_ids.tolist() == [20, 21, 30, 50, 51]
    assert pack.max_sequence_length == 5

    mask = pack.dense_mask()
    rows = {
        0: [0],                 # prompt token 10 sees itself
        2: [0, 1, 2],
        3: [3],                 # group 1's prompt sees only itself
        5: [0, 1, 2, 4, 5],     # 21 sees the whole prompt and 20, not 30
        6: [0, 1, 2, 6],        # 30 never sees the other completion
        8: [3, 7, 8],
    }
    for query, keys in rows.items():
        assert torch.nonzero(mask[query]).flatten().tolist() == keys


def test_the_packs_targets_are_the_completions_in_groups_order():
    prompts = [torch.tensor([1, 2]), torch.tensor([3])]
    completions = [[torch.tensor([4]), torch.tensor([5, 6, 7])], [torch.tensor([8, 9])]]
    pack = pack_groups(prompts, completions)
    batch = Groups.from_nested(prompts, completions)
    nested = batch.split(batch.per_completion(pack.target_ids))
    assert [[t.tolist() for t in g] for g in nested] == [[[4], [5, 6, 7]], [[8, 9]]]


def test_padded_index_round_trip():
    index = PaddedIndex.build([2, 3, 1], torch.device("cpu"))
    assert index.gather.tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]
    assert index.valid.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    flat = torch.arange(6) * 10
    assert index.to_flat(index.to_padded(flat)).tolist() == flat.tolist()


def test_varlen_segments_follow_pack_order():
    prompts, completions = random_groups(*PACKS["mixed"])   # prompts 5, 11, 3; completions per group
    layout = pack_groups(prompts, completions)
    expected = {
        "prompt_segments": ([0, 5, 16, 19], 11),
        "group_query_segments": ([0, 23, 26, 34], 23),          # all G completions of a group at once
        "completion_segments": ([0, 4, 5, 12, 14, 23, 26, 28, 34], 9),
    }
    for name, (cu_seqlens, max_length) in expected.items():
        segments = getattr(layout, name)
        assert segments.cu_seqlens.dtype == torch.int32 and segments.cu_seqlens.tolist() == cu_seqlens, name
        assert segments.max_length == max_length, name
        assert getattr(layout, name) is segments, name   # built once per pack, shared by every layer
