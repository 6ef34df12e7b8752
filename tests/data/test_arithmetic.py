import re

import pytest

from turbogrpo.data.arithmetic import (PREAMBLE, ArithmeticConfig, ArithmeticProblem, demo_records,
                                       format_solution, generate_problems, split_of)


def test_solution_format_and_answer():
    problem = ArithmeticProblem("q", 14, (7, -5))
    assert problem.answer == 16
    assert problem.completion == " 14+7=21 21-5=16\n#### 16"
    assert format_solution(problem.steps()[:1]) == " 14+7=21\n#### 21"


def test_running_totals_stay_in_range_and_words_match_signs():
    config = ArithmeticConfig()
    for problem in generate_problems("train", 300, seed=5):
        totals = [problem.start]
        for change in problem.changes:
            totals.append(totals[-1] + change)
            assert config.min_amount <= abs(change) <= config.max_amount
        assert all(0 <= t <= config.max_value for t in totals)
        # The question states every amount, in order, with a verb of the right direction.
        amounts = [int(n) for n in re.findall(r"\d+", problem.question)]
        assert amounts == [problem.start] + [abs(c) for c in problem.changes]


def test_prompts_share_the_long_preamble():
    records = demo_records("eval", 5, seed=0)
    assert all(r["prompt"].startswith(PREAMBLE) and r["prompt"].endswith("\nAnswer:") for r in records)
    assert len(PREAMBLE) > 2 * max(len(r["prompt"]) - len(PREAMBLE) for r in records)
    assert records[0]["solution"].endswith(f"#### {records[0]['answer']}")


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        generate_problems("test", 1)
    with pytest.raises(ValueError, match="min_amount"):
        ArithmeticConfig(min_amount=0)
    with pytest.raises(ValueError, match="could not draw"):
        generate_problems("eval", 50, config=ArithmeticConfig(min_start=10, max_start=10, max_amount=2,
                                                              min_steps=1, max_steps=1))


def test_repeats_allowed_beyond_the_number_space():
    problems = generate_problems("train", 10000, seed=0, distinct=False)
    assert len({(p.start, p.changes) for p in problems}) < 10000
    assert all(split_of(p.start, p.changes) == "train" for p in problems)
