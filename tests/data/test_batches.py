import itertools

import pytest

from turbogrpo.data.batches import PromptBatches


def test_each_epoch_is_a_permutation_and_batches_stay_full():
    batches = PromptBatches(list(range(10)), 4, seed=3)
    first_12 = sum(itertools.islice(batches, 3), [])
    assert sorted(first_12[:10]) == list(range(10))  # epoch 0 exactly once
    assert batches.epoch == 1 and batches.offset == 2
    assert first_12[:10] != list(range(10))  # shuffled


def test_same_seed_same_batches_different_seed_differs():
    take = lambda seed: list(itertools.islice(PromptBatches(list(range(20)), 5, seed=seed), 8))
    assert take(0) == take(0)
    assert take(0) != take(1)


def test_resume_from_state_continues_exactly():
    reference = PromptBatches(list(range(7)), 3, seed=11)
    expected = list(itertools.islice(reference, 10))
    run = PromptBatches(list(range(7)), 3, seed=11)
    before = list(itertools.islice(run, 4))
    state = run.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    resumed = PromptBatches(list(range(7)), 3, seed=11)
    resumed.load_state_dict(dict(state))
    assert before + list(itertools.islice(resumed, 6)) == expected


def test_resume_with_other_data_is_refused():
    state = PromptBatches(list(range(7)), 3, seed=11).state_dict()
    with pytest.raises(ValueError, match="num_examples"):
        PromptBatches(list(range(8)), 3, seed=11).load_state_dict(state)


def test_bad_sizes():
    with pytest.raises(ValueError, match="empty"):
        PromptBatches([], 1)
    with pytest.raises(ValueError, match="batch_size"):
        PromptBatches([1, 2], 3)


def test_unshuffled_order():
    assert list(itertools.islice(PromptBatches([1, 2, 3], 2, shuffle=False), 2)) == [[1, 2], [3, 1]]
