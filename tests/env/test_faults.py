"""Faulty environments on the shipped demo model: code that never returns, exits, raises or returns the
wrong thing fails its own conversation with a message naming the method (never the run, never silently),
and async environments are awaited."""

import asyncio
import math
import sys
import threading

import pytest
import torch

from tests.env.test_episode import Numbered, demo, episodes  # noqa: F401 (fixture)
from turbogrpo.env import TOOL_CALL_PARSERS, ToolCall, environment_reward
from turbogrpo.env.tasks import GuessNumber, RetryArithmetic, evaluate_arithmetic
from turbogrpo.rewards import Reward, compute_rewards

NEVER = threading.Event()


def env_rewards(result):
    return compute_rewards([Reward("environment", environment_reward)], ["p"] * len(result.episodes),
                           ["c"] * len(result.episodes), {"environments": result.episodes})


class HangingReply(Numbered):
    """Conversation 2's reply() never returns; the others play RetryArithmetic."""

    def reply(self, message):
        if self.number == 2:
            NEVER.wait()
        return super().reply(message)


@pytest.mark.parametrize("timing", ["next_step", "arrival"])
def test_an_environment_call_past_the_time_limit_fails_its_conversation_only(demo, timing):
    HangingReply.made = 0
    result = episodes(demo, HangingReply, num_rows=2, max_turns=2, call_timeout_s=2.0, reply_timing=timing)
    errors = [e.error for e in result.episodes]
    assert errors == [None, "reply() did not return within 2 s (env.call_timeout_s)", None, None]
    rewards = env_rewards(result)
    assert rewards.failed["environment"].tolist() == [False, True, False, False]
    assert rewards.full_error["environment"] == ("item 1: HangingReply: reply() did not return within 2 s "
                                                 "(env.call_timeout_s)")


class Exits(Numbered):
    """sys.exit in reply() (conversation 1), a tool-less turn; KeyboardInterrupt in get_reward (conversation 3)."""

    def reply(self, message):
        if self.number == 1:
            sys.exit(3)
        return super().reply(message)

    def get_reward(self):
        if self.number == 3:
            raise KeyboardInterrupt
        return super().get_reward()


def test_exits_inside_environment_code_fail_their_conversation_not_the_run(demo):
    Exits.made = 0
    result = episodes(demo, Exits, num_rows=2, max_turns=2)
    assert result.episodes[0].error == "reply() raised SystemExit(3) (environment code cannot end the run)"
    rewards = env_rewards(result)
    assert rewards.failed["environment"].tolist() == [True, False, True, False]
    assert result.episodes[2].reward_error == "get_reward() raised KeyboardInterrupt() (environment code cannot end the run)"


class HangingReward(RetryArithmetic):
    def get_reward(self):
        NEVER.wait()


def test_a_get_reward_that_never_returns_is_a_failed_item(demo):
    result = episodes(demo, HangingReward, num_rows=1, max_turns=1, call_timeout_s=1.0)
    rewards = env_rewards(result)
    assert rewards.num_failed["environment"] == 2
    assert rewards.full_error["environment"] == ("item 0: HangingReward: get_reward() did not return within "
                                                 "1 s (env.call_timeout_s)")


class ExitingFactory(RetryArithmetic):
    def __init__(self):
        raise SystemExit(0)


def test_a_factory_that_exits_is_refused_in_one_line(demo):
    with pytest.raises(ValueError, match=r"factory .* raised SystemExit\(0\) \(environment code cannot end the run\)"):
        episodes(demo, ExitingFactory, num_rows=1)


class Rewarding(Numbered):
    """Conversation n's get_reward() gives VALUES[n - 1] (raised when it is an exception)."""
    VALUES = []

    def get_reward(self):
        value = self.VALUES[self.number - 1]
        if isinstance(value, Exception):
            raise value
        return value


REWARD_CASES = [  # (get_reward's value, the item's failure or None for a good number)
    (0.5, None), (torch.tensor(1.0), None), (True, None),
    (math.nan, "get_reward() returned nan, not a finite number"),
    (math.inf, "get_reward() returned inf, not a finite number"),
    ("high", "get_reward() returned 'high', not a number"),
    ("0.5", "get_reward() returned '0.5', not a number"),  # the guide: a non-number is a failure
    (torch.tensor([1.0, 0.0]), "get_reward() returned tensor([1., 0.]), not a number"),
    ([1.0], "get_reward() returned [1.0], not a number"),
    (None, "get_reward() returned None, not a number"),
    (ValueError("judge down"), "get_reward() raised ValueError: judge down"),
    (b"1", "get_reward() returned b'1', not a number"),
]


def test_get_reward_values_that_are_not_finite_numbers_fail_with_their_own_text(demo):
    Rewarding.made, Rewarding.VALUES = 0, [value for value, _ in REWARD_CASES]
    result = episodes(demo, Rewarding, num_rows=len(REWARD_CASES) // 2, num_samples=2, max_turns=1)
    rewards = env_rewards(result)
    assert [e.reward_error for e in result.episodes] == [error for _, error in REWARD_CASES]
    assert rewards.failed["environment"].tolist() == [error is not None for _, error in REWARD_CASES]
    assert rewards.total[:3].tolist() == [0.5, 1.0, 1.0]
    assert rewards.full_error["environment"] == "item 3: Rewarding: get_reward() returned nan, not a finite number"


class BadReturns(Numbered):
    """reset() of conversation 1 returns bytes; reply() of 2 a dict, of 3 bytes."""

    def reset(self, **row):
        super().reset(**row)
        return b"obs" if self.number == 1 else None

    def reply(self, message):
        return {2: {"text": "no"}, 3: b"no"}.get(self.number) or super().reply(message)


def test_reset_and_reply_returning_other_types_fail_with_the_method_named(demo):
    BadReturns.made = 0
    result = episodes(demo, BadReturns, num_rows=2, max_turns=2)
    assert [e.error for e in result.episodes] == ["reset() returned a bytes, not a str or None",
                                                  "reply() returned a dict, not a str or None",
                                                  "reply() returned a bytes, not a str or None", None]
    assert env_rewards(result).full_error["environment"] == ("item 0: BadReturns: reset() returned a bytes, not a "
                                                             "str or None")


def test_guess_number_without_a_secret_names_the_missing_column(demo):
    result = episodes(demo, GuessNumber, num_rows=1, max_turns=1)
    assert env_rewards(result).full_error["environment"] == (
        "item 0: GuessNumber: reset() raised ValueError: GuessNumber needs a row with a 'secret' in [1, 16], got None")


class AsyncCalculator(RetryArithmetic):
    """TRL's async environment: an async tool and an async get_reward."""

    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers joined by +, -, *, / and parentheses.
        """
        await asyncio.sleep(0)
        return str(evaluate_arithmetic(expression))

    async def get_reward(self):
        await asyncio.sleep(0)
        return 0.25


class AsyncRetry(RetryArithmetic):
    async def reply(self, message):
        await asyncio.sleep(0)
        return "Wrong. Try again."


def always_calculates(text):
    """A parser that reads every turn as the call calculate("2 * 3") (the probe's fixed call)."""
    return text, [ToolCall("calculate", {"expression": "2 * 3"})]


@pytest.mark.filterwarnings("ignore:.*render differently")  # the fixed call is not the turn's text
def test_async_tools_replies_and_rewards_are_awaited(demo, monkeypatch):
    _, tokenizer = demo
    monkeypatch.setitem(TOOL_CALL_PARSERS, "always_calculates", always_calculates)
    result = episodes(demo, AsyncCalculator, num_rows=1, max_turns=2, tool_parser="always_calculates")
    for ids, mask in zip(result.rollout.groups.completions, result.rollout.groups.model_mask):
        if (~mask).any():
            assert tokenizer.decode(ids[~mask]) == "\nResult: 6\nAnswer:"  # not "<coroutine object ...>"
    assert sum(e.num_tool_calls for e in result.episodes) > 0
    assert env_rewards(result).total.tolist() == [0.25, 0.25]
    result = episodes(demo, AsyncRetry, num_rows=1, max_turns=2)
    replies = [tokenizer.decode(ids[~mask]) for ids, mask in zip(result.rollout.groups.completions,
                                                                   result.rollout.groups.model_mask)]
    assert "\nWrong. Try again.\nAnswer:" in replies and [e.error for e in result.episodes] == [None, None]


class StuckTools(Numbered):
    """Conversation 1's calculate() exits the process, conversation 2's never returns; the others answer."""

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers joined by +, -, *, / and parentheses.
        """
        if self.number == 1:
            sys.exit(0)
        if self.number == 2:
            NEVER.wait()
        return str(evaluate_arithmetic(expression))


@pytest.mark.filterwarnings("ignore:.*render differently")  # the fixed call is not the turn's text
def test_a_tool_that_exits_or_never_returns_fails_its_conversation_naming_the_tool(demo, monkeypatch):
    monkeypatch.setitem(TOOL_CALL_PARSERS, "always_calculates", always_calculates)
    StuckTools.made = 0
    result = episodes(demo, StuckTools, num_rows=2, max_turns=2, tool_parser="always_calculates",
                      call_timeout_s=2.0)
    assert [e.error for e in result.episodes] == [
        "tool calculate() raised SystemExit(0) (environment code cannot end the run)",
        "tool calculate() did not return within 2 s (env.call_timeout_s)", None, None]
