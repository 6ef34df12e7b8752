"""The small_arithmetic task: disjoint fixed splits, seeded order, checked answers, clear limits."""

import pytest

from turbogrpo.data.small_arithmetic import MAX_OPERAND, all_problems, small_arithmetic_records, split_of


def test_splits_are_disjoint_and_cover_every_problem():
    problems = all_problems()
    # a + b for every pair, a - b for a >= b
    assert len(problems) == MAX_OPERAND ** 2 + MAX_OPERAND * (MAX_OPERAND + 1) // 2
    train = {r["prompt"] for r in small_arithmetic_records("train", 1000, seed=0)}
    held_out = {r["prompt"] for r in small_arithmetic_records("eval", 300, seed=0)}
    assert not train & held_out
    assert sum(split_of(p) == "eval" for p in problems) >= 300  # enough for a 200-problem evaluation


def test_rows_state_the_right_answer_and_follow_the_seed():
    rows = small_arithmetic_records("train", 50, seed=3)
    for row in rows:
        a, op, b = row["prompt"].removeprefix("What is ").split("?")[0].split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert rows == small_arithmetic_records("train", 50, seed=3)
    assert rows != small_arithmetic_records("train", 50, seed=4)


def test_asking_for_more_problems_than_the_split_has_names_the_key():
    with pytest.raises(ValueError, match="data.num_eval_problems must be between 1 and"):
        small_arithmetic_records("eval", 10_000)
