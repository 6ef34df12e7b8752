import math
import threading

import pytest
import torch

from turbogrpo.algo import statistics_are_finite
from turbogrpo.data import PromptExample
from turbogrpo.rewards import (MAX_ERROR_CHARS, Reward, answer_format, answers_match, build_rewards, compute_rewards, math_accuracy,
                               resolve_reward, reward_columns, score_completions)

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
                              Reward("short", wrong_length, 2.0), (holes, 4.0)],
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


def test_a_reward_record_carries_its_own_fallback():
    def raises(prompts, completions, **columns):
        raise RuntimeError("boom")

    result = compute_rewards([Reward("own", raises, 2.0, fallback=-3.0), Reward("shared", raises)], ["p"], ["a"],
                             fallback=-1.0)
    assert result.per_function["own"].tolist() == [-3.0] and result.per_function["shared"].tolist() == [-1.0]
    assert result.total.tolist() == [2 * -3.0 - 1.0]


def test_weighted_reward_is_a_deprecated_name_of_reward():
    import turbogrpo.rewards as rewards_module
    with pytest.warns(DeprecationWarning, match="use turbogrpo.rewards.Reward"):
        assert rewards_module.WeightedReward is Reward


def test_build_rewards_names_and_fallbacks_from_the_config():
    from turbogrpo.config import RewardConfig
    built = build_rewards([RewardConfig("math_accuracy", 1.0, -1.0), RewardConfig("math_accuracy", 0.5),
                           RewardConfig("answer_format", 2.0)])
    assert [(r.name, r.weight, r.fallback) for r in built] == [
        ("math_accuracy", 1.0, -1.0), ("math_accuracy_1", 0.5, 0.0), ("answer_format", 2.0, 0.0)]


def test_reward_columns_are_per_row_not_from_the_first_row():
    # D32: the first row lacks "answer"; the others keep theirs, and the first row gets None.
    columns = reward_columns([{"id": 1}, {"id": 2, "answer": "16"}, {"answer": "3", "extra": True}], [4, 5, 6])
    assert columns == {"id": [1, 2, None], "answer": [None, "16", "3"], "extra": [None, None, True],
                       "completion_lengths": [4, 5, 6]}
    examples = [PromptExample("p0", torch.tensor([1]), {}), PromptExample("p1", torch.tensor([1]), {"answer": "16"})]
    result = score_completions([Reward("math_accuracy", math_accuracy, fallback=-1.0)], examples,
                               [DEMO, DEMO, DEMO, "#### 15"], [3, 3, 3, 3], num_samples=2)
    assert result.per_function["math_accuracy"].tolist() == [-1.0, -1.0, 1.0, 0.0]
    assert result.num_failed["math_accuracy"] == 2  # only the row without an answer fails


@pytest.mark.parametrize("value", [1e39, -1e39, 10 ** 400])
def test_a_reward_beyond_float32_is_a_failure(value):
    # R06: 1e39 is a finite Python float but inf in float32, the dtype the advantages and loss use.
    def huge(prompts, completions, **columns):
        return [0.5, value]

    result = compute_rewards([huge], ["p"] * 2, ["a", "b"], fallback=-1.0)
    assert result.per_function["huge"].tolist() == [0.5, -1.0] and result.num_failed["huge"] == 1
    assert result.failed["huge"].tolist() == [False, True]
    shown = "an integer of 401 digits (100000000000...)" if isinstance(value, int) else repr(value)
    assert result.first_error["huge"] == f"item 1: returned {shown}, beyond float32's range (largest 3.4e+38)"
    assert torch.isfinite(result.total).all()


@pytest.mark.parametrize("value", [-(10 ** 400), 2 ** 1024, 10 ** 39])
def test_an_integer_beyond_float_range_is_a_failure_that_says_so(value):
    # float(2 ** 1024) raises OverflowError: such an int is past float64's range, not a non-number.
    result = compute_rewards([lambda prompts, completions, **columns: [value, 1]], ["p"] * 2, ["a", "b"])
    assert result.failed["<lambda>"].tolist() == [True, False] and result.per_function["<lambda>"].tolist() == [0.0, 1.0]
    assert "beyond float32's range" in result.first_error["<lambda>"] and len(result.first_error["<lambda>"]) < 120


def test_a_megabyte_exception_message_is_cut_for_the_console_and_kept_whole():
    text = "x" * 1_000_000

    def chatty(prompts, completions, **columns):
        raise RuntimeError(text)

    result = compute_rewards([chatty], ["p"], ["a"])
    shown = result.first_error["chatty"]
    assert shown.startswith("RuntimeError: xxx") and len(shown) < MAX_ERROR_CHARS + 100
    assert "1,000,014 characters in all" in shown
    assert result.full_error["chatty"] == f"RuntimeError: {text}"
    assert compute_rewards([chatty], ["p"], ["a"]).num_failed["chatty"] == 1
    short = compute_rewards([lambda p, c, **k: 1 / 0], ["p"], ["a"])
    assert short.first_error["<lambda>"] == short.full_error["<lambda>"] == "ZeroDivisionError: division by zero"


def test_rewards_that_overflow_the_advantage_statistics_are_detected():
    # R07: +-3e38 are finite in float32, but the group std (and centring) overflow to inf.
    for rewards, scale in [([3e38, -3e38, 0.0, 1.0], "group"), ([3e38, 0.0, 1.0, 2.0], "batch"),
                           ([3e38, 3e38, 1.0, 2.0], "none")]:
        assert not statistics_are_finite(torch.tensor(rewards), [2, 2], scale)
    assert statistics_are_finite(torch.tensor([1e18, -1e18, 0.0, 1.0]), [2, 2], "group")


def test_a_reward_calling_sys_exit_is_a_failing_reward():
    # R15: SystemExit is not an Exception; it must not end the run.
    def exits(prompts, completions, **columns):
        raise SystemExit(3)

    result = compute_rewards([exits], ["p"] * 2, ["a", "b"])
    assert result.num_failed["exits"] == 2 and result.first_error["exits"] == "called sys.exit(3)"


@pytest.mark.parametrize("source, message", [
    ("def f(prompts, completions, **columns)\n    return [1.0]\n",  # R01: a syntax error
     r"reward 'bad_{0}:f': module 'bad_{0}' has a syntax error in .*bad_{0}\.py, line 1: expected ':'"),
    ("raise RuntimeError('no GPU here')\n",  # R02: raises at import
     r"reward 'bad_{0}:f': importing module 'bad_{0}' \(.*bad_{0}\.py\) raised RuntimeError: no GPU here"),
    ("import sys\nsys.exit(3)\n",
     r"reward 'bad_{0}:f': importing module 'bad_{0}' \(.*bad_{0}\.py\) called sys.exit\(3\)"),
])
def test_a_reward_module_that_cannot_be_imported_is_one_clear_error(tmp_path, monkeypatch, source, message):
    name = abs(hash(source)) % 10 ** 8
    (tmp_path / f"bad_{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=message.format(name)) as raised:
        resolve_reward(f"bad_{name}:f")
    assert "\n" not in str(raised.value) and raised.value.__cause__ is None
