"""Groups, the one ragged batch, by hand. It replaced ``StepBatch``, ``Chunk``/``MicroBatch`` with
``plan_micro_batches``, ``split_per_completion`` and ``CompletionLogprobs.per_completion``, and the
Rollout's own lists; equivalence with them on ragged inputs was checked before they were removed
(tests/test_batch_equivalence.py in the commit that added the data-holding Groups)."""

import pytest
import torch

from turbogrpo.batch import Groups, flatten, length_mask, pad_ragged, pad_to_count
from turbogrpo.rollout.types import Rollout, RolloutStats

SIZES = [3, 1, 2, 4]  # K = 4 groups, N = 10 completions


def nested(sizes=SIZES):
    """Per group, per completion: a tensor [S] whose values say (group, completion)."""
    return [[torch.full((1 + (g + i) % 3,), 10 * g + i) for i in range(size)] for g, size in enumerate(sizes)]


def batch_of(sizes=SIZES, **fields):
    return Groups.from_nested([torch.tensor([g]) for g in range(len(sizes))], nested(sizes), **fields)


def values(tensors):
    return [int(t[0]) for t in tensors]


def test_layout_by_hand():
    batch = batch_of()
    assert batch.sizes == (3, 1, 2, 4) and batch.offsets == (0, 3, 4, 6, 10) and batch.num_completions == 10
    assert batch.lengths == [1, 2, 3, 2, 3, 1, 1, 2, 3, 1] and batch.prompt_lengths == [1, 1, 1, 1]
    assert batch.split(list("abcdefghij")) == [["a", "b", "c"], ["d"], ["e", "f"], ["g", "h", "i", "j"]]
    assert flatten([[1, 2], [], [3]]) == [1, 2, 3]
    assert list(batch.positions(2)) == [4, 5]
    assert [values(g) for g in batch.nested()] == [[0, 1, 2], [10], [20, 21], [30, 31, 32, 33]]


def test_per_completion_cuts_a_flat_token_tensor():
    batch = batch_of([2, 1])
    flat_Nq = torch.cat(batch.completions).float()  # lengths 1, 2, 2
    assert [t.tolist() for t in batch.per_completion(flat_Nq)] == [[0.0], [1.0, 1.0], [10.0, 10.0]]


def test_select_and_group_carry_every_field():
    advantages = torch.arange(10.0)
    logps = [[torch.full((c.numel(),), -float(c[0])) for c in group] for group in nested()]
    batch = batch_of(advantages=advantages, old_logps=logps, finish_reasons=[["stop"] * n for n in SIZES])
    kept = batch.select([3, 0])
    assert kept.sizes == (4, 3) and kept.offsets == (0, 4, 7) and values(kept.prompts) == [3, 0]
    assert values(kept.completions) == [30, 31, 32, 33, 0, 1, 2]
    assert torch.equal(kept.advantages, torch.tensor([6.0, 7, 8, 9, 0, 1, 2]))
    assert [-int(t[0]) for t in kept.old_logps] == [30, 31, 32, 33, 0, 1, 2]
    assert kept.finish_reasons == ["stop"] * 7 and kept.ref_logps is None and kept.hidden is None
    one = batch.group(2)
    assert one.sizes == (2,) and values(one.completions) == [20, 21] and one.advantages.tolist() == [4.0, 5.0]
    assert batch.select([]).num_completions == 0


def test_pick_keeps_chosen_completions_and_concat_joins_batches():
    batch = batch_of(advantages=torch.arange(10.0), prompt_hidden=[torch.full((1, 2), float(g)) for g in range(4)])
    picked = batch.pick([[2], [], [0, 1], [3]])
    assert picked.sizes == (1, 2, 1) and values(picked.prompts) == [0, 2, 3]
    assert values(picked.completions) == [2, 20, 21, 33] and picked.advantages.tolist() == [2.0, 4.0, 5.0, 9.0]
    assert [float(h[0, 0]) for h in picked.prompt_hidden] == [0.0, 2.0, 3.0]
    joined = Groups.concat([picked, batch.group(1)])
    assert joined.sizes == (1, 2, 1, 1) and values(joined.completions) == [2, 20, 21, 33, 10]
    assert joined.advantages.tolist() == [2.0, 4.0, 5.0, 9.0, 3.0] and len(joined.prompt_hidden) == 4
    assert Groups.concat([picked, Groups([torch.tensor([9])], [torch.tensor([1])], [1])]).advantages is None


def test_micro_batches_hold_every_completion_once_in_flat_order():
    """Prompts of 1 token; completion lengths 1 2 3 | 2 | 3 1 | 1 2 3 1. Budget 6: group 0 (7 tokens) is
    cut into runs [0, 1] (4 tokens) and [2] (4); group 1 (3) does not fit beside that run, nor group 2
    (5) beside group 1; group 3 (8) is cut into [0, 1] (4) and [2, 3] (5)."""
    batch = batch_of(advantages=torch.arange(10.0))
    plan = batch.micro_batches(6)
    assert [(values(mb.prompts), mb.sizes) for mb in plan] == [
        ([0], (2,)), ([0], (1,)), ([1], (1,)), ([2], (2,)), ([3], (2,)), ([3], (2,))]
    assert [c for mb in plan for c in values(mb.completions)] == values(batch.completions)
    assert torch.equal(torch.cat([mb.advantages for mb in plan]), batch.advantages)
    assert len(batch.micro_batches(10_000)) == 1 and len(batch.micro_batches(1)) == 10


def test_padded_views():
    rows = [torch.tensor([1.0]), torch.tensor([2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0])]
    batch = Groups([torch.tensor([0])], [torch.zeros(1), torch.zeros(3), torch.zeros(2)], [3], ref_logps=rows)
    assert batch.padded("ref_logps").tolist() == [[1, 0, 0], [2, 3, 4], [5, 6, 0]]
    assert batch.padded("old_logps") is None
    assert batch.mask(torch.device("cpu")).tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert torch.equal(pad_ragged(rows), batch.padded("ref_logps"))
    assert torch.equal(length_mask([1, 3, 2], torch.device("cpu")), batch.mask(torch.device("cpu")))
    with pytest.raises(ValueError, match="not a per-token field"):
        batch.padded("advantages")


def test_fillers_are_zero_weight_copies_of_the_last_micro_batch():
    plan = pad_to_count(batch_of().micro_batches(6), 7)
    assert [mb.weight for mb in plan] == [1.0] * 6 + [0.0]
    assert values(plan[-1].completions) == values(plan[5].completions)


def test_a_rollout_is_a_view_of_its_groups():
    num_samples = 3
    tokens = [torch.tensor([i]) for i in range(2 * num_samples)]
    groups = Groups([torch.tensor([1]), torch.tensor([2])], tokens, [3, 3], sampler_logps=tokens,
                    finish_reasons=["stop"] * 6)
    rollout = Rollout(groups, RolloutStats())
    assert rollout.num_samples == 3 and rollout.num_completions == 6 and rollout.group_index == [0, 0, 0, 1, 1, 1]
    assert [[int(t) for t in group] for group in rollout.tokens_per_group()] == [[0, 1, 2], [3, 4, 5]]
    assert rollout.logprobs is tokens and rollout.hidden is None
    with pytest.raises(ValueError, match="return_hidden=True"):
        rollout.hidden_per_group()


def test_a_wrong_count_is_refused():
    with pytest.raises(ValueError, match="got 2 items for 3 completions"):
        Groups([torch.tensor([0]), torch.tensor([1])], [torch.tensor([0])] * 3, [1, 2]).split([0, 1])
    with pytest.raises(ValueError, match=r"need 2 prompts and 3 completions, got 1 and 3"):
        Groups([torch.tensor([0])], [torch.tensor([0])] * 3, [1, 2])


# -- bad arguments: a ValueError at the call, naming the argument and what is allowed -----------------


@pytest.mark.parametrize("budget", [0, -5, 2.5, True, "6"])
def test_micro_batches_refuses_a_budget_that_is_no_positive_integer(budget):
    with pytest.raises(ValueError, match=r"token_budget must be an integer >= 1.*got"):
        batch_of().micro_batches(budget)


def test_negative_indices_count_from_the_end_as_in_python():
    batch = batch_of(advantages=torch.arange(10.0))
    assert values(batch.select([-1]).completions) == [30, 31, 32, 33]
    assert values(batch.select([-4, 1]).prompts) == [0, 1]
    assert values(batch.group(-2).completions) == [20, 21]
    picked = batch.pick([[-1], [], [-2, 1], []])
    assert values(picked.completions) == [2, 20, 21] and picked.advantages.tolist() == [2.0, 4.0, 5.0]


@pytest.mark.parametrize("call, message", [
    (lambda b: b.select([7]), r"select: keep: index 7 is out of range; a group index is one of -4\.\.3"),
    (lambda b: b.select([-5]), r"select: keep: index -5 is out of range"),
    (lambda b: b.group(4), r"index 4 is out of range"),
    (lambda b: b.select([0.5]), r"select: keep must hold integer indices"),
    (lambda b: b.pick([[5], [0], [], []]), r"pick: chosen\[0\]: index 5 is out of range; a completion of group 0 "
                                          r"index is one of -3\.\.2"),
    (lambda b: b.pick([[0], [1], [], []]), r"pick: chosen\[1\]: index 1 is out of range"),
    (lambda b: b.pick([[5], [0]]), r"pick: chosen must hold one list of completion indices per group \(4\), got 2"),
])
def test_indices_outside_the_batch_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(batch_of())


def test_concat_refuses_no_batches_and_non_batches():
    with pytest.raises(ValueError, match=r"concat: batches must be a non-empty sequence of Groups.*Groups\(\[\], \[\], \[\]\)"):
        Groups.concat([])
    with pytest.raises(ValueError, match="concat: batches must be a non-empty sequence of Groups"):
        Groups.concat([batch_of(), [1, 2]])


@pytest.mark.parametrize("fields, message", [
    ({"advantages": torch.zeros(9)}, r"advantages must hold 10 entries \(one per completion.*got 9"),
    ({"rewards": torch.tensor(1.0)}, r"rewards must hold 10 entries.*0-d tensor"),
    ({"finish_reasons": ["stop"] * 11}, r"finish_reasons must hold 10 entries.*got 11"),
    ({"prompt_hidden": [torch.zeros(1, 2)] * 3}, r"prompt_hidden must hold 4 entries \(one \[P_k, Hd\] per group\)"),
])
def test_fields_of_the_wrong_length_are_refused_when_built(fields, message):
    completions = flatten(nested())
    with pytest.raises(ValueError, match=message):
        Groups([torch.tensor([g]) for g in range(4)], completions, SIZES, **fields)


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError, match=r"sizes must be integers >= 0"):
        Groups([torch.tensor([0]), torch.tensor([1])], [torch.tensor([1])], [2, -1])
