"""What both built-in tasks promise: seeded problems, and train/eval splits that never share arithmetic."""

import pytest

from turbogrpo.data.arithmetic import generate_problems, split_of
from turbogrpo.data.longform import generate_longform_problems

TASKS = pytest.mark.parametrize(("generate", "num_train", "num_eval"), [
    (generate_problems, 4000, 500),
    (generate_longform_problems, 2000, 300),
], ids=["arithmetic", "longform"])


@TASKS
def test_same_seed_same_problems_other_seed_differs(generate, num_train, num_eval):
    assert generate("train", 50, seed=1) == generate("train", 50, seed=1)
    assert generate("train", 50, seed=1) != generate("train", 50, seed=2)


@TASKS
def test_train_and_eval_never_share_arithmetic(generate, num_train, num_eval):
    train = {(p.start, p.changes) for p in generate("train", num_train, seed=0)}
    held_out = {(p.start, p.changes) for p in generate("eval", num_eval, seed=0)}
    assert len(held_out) == num_eval
    assert not train & held_out
    assert all(split_of(*key) == "eval" for key in held_out)
