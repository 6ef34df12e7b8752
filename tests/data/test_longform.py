import re
import statistics

import pytest
from transformers import AutoTokenizer

from turbogrpo.config import load_config
from turbogrpo.data.arithmetic import SolutionStep
from turbogrpo.data.longform import (PREAMBLE, LongformConfig, generate_longform_problems,
                                     longform_records)
from turbogrpo.models import shipped_model_path
from turbogrpo.rewards import math_accuracy


def test_steps_span_3_to_12_with_a_long_tail():
    counts = [len(p.changes) for p in generate_longform_problems("train", 3000, seed=0)]
    assert min(counts) == 3 and max(counts) == 12
    share = {n: counts.count(n) / len(counts) for n in range(3, 13)}
    # Decaying by step_decay = 0.75: 3 steps is the mode, 12 steps is rare but present.
    assert share[3] > share[6] > share[12] > 0.005
    assert statistics.median(counts) <= 5


def test_solution_is_the_demo_format_with_more_steps():
    problem = next(p for p in generate_longform_problems("eval", 20, seed=0) if len(p.changes) == 5)
    total, expected = problem.start, []
    for change in problem.changes:
        expected.append(f"{total}{'+' if change > 0 else '-'}{abs(change)}={total + change}")
        total += change
    assert problem.completion == " " + " ".join(expected) + f"\n#### {total}"
    assert problem.answer == total


def test_solution_text_follows_the_written_steps():
    problem = generate_longform_problems("train", 1, seed=3)[0]
    wrong = [SolutionStep(s.before, s.op, s.amount, s.result) for s in problem.steps()]
    wrong[-1] = SolutionStep(wrong[-1].before, "+", wrong[-1].amount, wrong[-1].before + wrong[-1].amount)
    text = problem.solution_text(wrong)
    assert text.endswith(f"#### {wrong[-1].result}")
    assert f"{wrong[-1].before}+{wrong[-1].amount}={wrong[-1].result}\n####" in text


def test_reference_solutions_get_full_reward_and_running_totals_stay_in_range():
    config = LongformConfig()
    problems = generate_longform_problems("train", 200, seed=4)
    records = longform_records("train", 200, seed=4)
    rewards = math_accuracy([r["prompt"] for r in records], [r["solution"] for r in records],
                            answer=[r["answer"] for r in records])
    assert rewards == [1.0] * 200
    for problem in problems:
        totals = [problem.start]
        for change in problem.changes:
            totals.append(totals[-1] + change)
            assert config.min_amount <= abs(change) <= config.max_amount
        assert all(0 <= t <= config.max_value for t in totals)
        assert [int(n) for n in re.findall(r"\d+", problem.question)] == [problem.start] + [abs(c) for c in
                                                                                           problem.changes]


def test_prompts_share_the_preamble_and_solutions_have_a_long_tail_of_lengths():
    tokenizer = AutoTokenizer.from_pretrained(shipped_model_path("demo"))
    records = longform_records("eval", 300, seed=0)
    assert all(r["prompt"].startswith(PREAMBLE) and r["prompt"].endswith("\nAnswer:") for r in records)
    lengths = sorted(len(tokenizer(r["solution"])["input_ids"]) for r in records)
    # ~6-8 tokens a step (every digit is a token): 3 steps are ~23 tokens, 12 steps ~100.
    assert 20 <= lengths[0] <= 30 and 90 <= lengths[-1] <= 110
    # A long tail: the longest solution is about twice the median, the median is near the short end.
    assert lengths[-1] > 1.8 * lengths[len(lengths) // 2]
    assert lengths[len(lengths) // 2] < 55


def test_config_kind_longform_reads_builtin_rows():
    from turbogrpo.data.kinds import train_rows

    config = load_config(None, ["data.kind=longform", "data.num_train_problems=50"])
    rows = train_rows(config.data, 0)
    assert rows == longform_records("train", 50, seed=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        generate_longform_problems("test", 1)
    with pytest.raises(ValueError, match="min_steps"):
        LongformConfig(min_steps=5, max_steps=4)
    with pytest.raises(ValueError, match="step_decay"):
        LongformConfig(step_decay=0)
    with pytest.raises(ValueError, match="min_amount"):
        LongformConfig(min_amount=0)

