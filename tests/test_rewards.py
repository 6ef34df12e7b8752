import math
import threading

import pytest
import torch

from turbogrpo.rewards import (WeightedReward, answer_format, answers_match, compute_rewards, math_accuracy,
                               resolve_reward)

DEMO = " 14+7=21 21-5=16\n#### 16"


def test_math_accuracy_hand_cases():
    completions = [DEMO, " 14+7=21 21-5=15\n#### 15", "I do not know", "so \\boxed{\\frac{1}{2}}",
                   "#### 1,000", "Janet makes 9 * 2 = $18\n#### 18", DEMO]
    answers = ["16", "16", "16", "0.5", "1000", "Janet sells 16 - 3 - 4 = 9 eggs\n#### 18", None]
    assert math_accuracy([""] * 7, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, None]


def test_answers_match_fast_path_and_math_verify():
    assert answers_match("16", "16.0") and answers_match("$1,234", "1234") and not answers_match("16", "61")
    assert answers_match("\\frac{3}{4}", "0.75") and answers_match("2^{3}", "8")
    assert answers_match("so the answer is \\boxed{7}", "7", predicted_is_answer=False)
    assert not answers_match("x+1", "3")


def test_math_accuracy_works_outside_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(
        math_accuracy([""] * 2, ["\\boxed{\\frac{1}{2}}", "#### 3"], answer=["0.5", "4"])))
    thread.start()
    thread.join()
    assert results == [[1.0, 0.0]]


def test_math_accuracy_needs_its_column():
    with pytest.raises(ValueError, match="'answer'"):
        math_accuracy([""], [DEMO], gold=["16"])
    assert resolve_reward("math_accuracy", answer_column="gold")([""], [DEMO], gold=["16"]) == [1.0]


def test_answer_format_hand_cases():
    completions = [DEMO, "#### 16", "#### 16 apples", "#### 1\n#### 2", "16", "#### -2.5  \n", "x #### 3"]
    assert answer_format([""] * 7, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_overlong_penalty_is_dapo_soft_punishment():
    penalty = resolve_reward("overlong_penalty", max_length=20, buffer=5)
    assert penalty([""] * 5, [""] * 5, completion_lengths=[10, 15, 16, 20, 25]) == pytest.approx(
        [0.0, 0.0, -0.2, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer"):
        resolve_reward("overlong_penalty", max_length=4, buffer=5)


def test_compute_rewards_weights_and_failures():
    def raises(prompts, completions, **columns):
        raise RuntimeError("boom")

    def wrong_length(prompts, completions, **columns):
        return [1.0]

    def holes(prompts, completions, **columns):
        return [None, math.nan, 0.5, "x"]

    prompts, completions = ["p"] * 4, [DEMO, "#### 3", "junk", DEMO]
    result = compute_rewards([(math_accuracy, 1.0), (answer_format, 0.5), (raises, 1.0),
                              WeightedReward("short", wrong_length, 2.0), (holes, 4.0)],
                             prompts, completions, {"answer": ["16", "16", "16", "17"]}, fallback=-1.0)
    assert result.per_function["math_accuracy"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert result.per_function["answer_format"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert result.per_function["raises"].tolist() == [-1.0] * 4
    assert result.per_function["holes"].tolist() == [-1.0, -1.0, 0.5, -1.0]
    # total = 1*acc + 0.5*format + 1*(-1) + 2*(-1) + 4*holes
    expected = torch.tensor([1 + 0.5 - 3 - 4, 0.5 - 3 - 4, -3 + 2, 0.5 - 3 - 4])
    assert torch.equal(result.total, expected)
    assert result.num_failed == {"math_accuracy": 0, "answer_format": 0, "raises": 4, "short": 4, "holes": 3}
    assert result.first_error["raises"] == "RuntimeError: boom"
    assert result.first_error["short"] == "returned 1 values for 4 completions"
    assert result.first_error["holes"] == "item 0: returned None"
    assert result.first_error["math_accuracy"] is None


def test_compute_rewards_checks_its_inputs():
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
        compute_rewards([math_accuracy], ["p", "p"], ["a", "b"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="unique"):
        compute_rewards([math_accuracy, math_accuracy], ["p"], ["a"], {"answer": ["1"]})


def test_resolve_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shorter(prompts, completions, scale=1.0, **columns):\n"
        "    return [-scale * len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_rewards:shorter")(["p"], ["abc"]) == [-3.0]
    assert resolve_reward("my_rewards:shorter", scale=2.0)(["p"], ["abc"]) == [-6.0]
    with pytest.raises(ValueError, match="no callable 'longer'"):
        resolve_reward("my_rewards:longer")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_reward("accuracy")
    with pytest.raises(ValueError, match="bad options"):
        resolve_reward("answer_format", weight=2)


@pytest.mark.parametrize("returned, message", [
    ("1.0", "returned a string ('1.0'), not a list of 4 numbers (one per completion)"),
    (3.0, "returned a float (3.0), not a list of 4 numbers (one per completion)"),
    (None, "returned a NoneType (None), not a list of 4 numbers (one per completion)"),
    ({"a": 1.0}, "returned a dict ({'a': 1.0}), not a list of 4 numbers (one per completion)"),
])
def test_a_reward_returning_no_list_says_what_it_returned(returned, message):
    def reward(prompts, completions, **columns):
        return returned

    result = compute_rewards([reward], ["p"] * 4, ["a", "b", "c", "d"], fallback=-1.0)
    assert result.first_error["reward"] == message
    assert result.num_failed["reward"] == 4 and result.per_function["reward"].tolist() == [-1.0] * 4


def test_a_reward_without_kwargs_is_told_to_accept_the_columns():
    def strict(prompts, completions):
        return [1.0] * len(completions)

    result = compute_rewards([strict], ["p", "p"], ["a", "b"], {"answer": ["1", "2"]})
    assert result.num_failed["strict"] == 2
    assert result.first_error["strict"].startswith(
        "cannot be called as f(prompts, completions, **columns) with columns ['answer'] (got an unexpected keyword "
        "argument 'answer'); give it a **columns (or **kwargs) parameter")
    # Without columns it is called as usual.
    assert compute_rewards([strict], ["p"], ["a"]).per_function["strict"].tolist() == [1.0]
