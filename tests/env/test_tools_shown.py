"""The tools shown to the model: each row's prompt lists its own environments' tools, under the names a call
must use; names that cannot be called and TRL tools named like our hooks are refused in one line; a tool
result that cannot be tokenised is an error reply, not a crash."""

import pytest

from tests.env.test_episode import Numbered, demo, episodes, tool_episode  # noqa: F401 (fixture)
from turbogrpo.env import environment_tools, tool_schemas
from turbogrpo.env.tasks import RetryArithmetic


class Adder(RetryArithmetic):
    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        return str(a + b)


class Multiplier(RetryArithmetic):
    def multiply(self, a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: The first.
            b: The second.
        """
        return str(a * b)


class Alternating:
    """A factory: the first two environments made are Adders, the next two Multipliers, and so on."""
    made = 0

    def __new__(cls):
        Alternating.made += 1
        return (Adder if (Alternating.made - 1) // cls.per_row % 2 == 0 else Multiplier)()


@pytest.mark.filterwarnings("ignore:.*render differently")
def test_each_row_is_shown_its_own_environments_tools(demo):
    """(And the demo template ends its tool list with a newline: "Tools: add\n", not "Tools: addSolve ...".)"""
    Alternating.made, Alternating.per_row = 0, 2
    result = episodes(demo, Alternating, num_rows=2, num_samples=2, max_turns=1)
    assert result.prompt_texts[0].startswith("Tools: add\n") and result.prompt_texts[1].startswith("Tools: multiply\n")
    assert [list(e.tools) for e in result.episodes] == [["add"], ["add"], ["multiply"], ["multiply"]]
    assert result.episodes[2].renderer.tools[0]["function"]["name"] == "multiply"


def test_a_group_whose_environments_differ_in_tools_is_refused(demo):
    Alternating.made, Alternating.per_row = 0, 1
    with pytest.raises(ValueError, match=r"environments of row 0 offer different tools \(add / multiply\)"):
        episodes(demo, Alternating, num_rows=1, num_samples=2, max_turns=1)


class ReplyTool(RetryArithmetic):
    def reply(self, text: str, loud: bool) -> str:
        """A TRL tool that happens to be called reply.

        Args:
            text: What to say.
            loud: Whether to shout.
        """
        return text.upper() if loud else text


class ForkTool(RetryArithmetic):
    def fork(self, path: str) -> str:
        """A TRL tool that happens to be called fork.

        Args:
            path: A repository.
        """
        return path


@pytest.mark.parametrize("env, line", [
    (ReplyTool(), r"ReplyTool.reply\(text: str, loud: bool\) -> str is not turbogrpo's reply hook"),
    (ForkTool(), r"ForkTool.fork\(path: str\) -> str is not turbogrpo's fork hook")])
def test_trl_tools_named_like_our_hooks_are_refused_in_one_line(env, line):
    with pytest.raises(ValueError, match=line + r" .*TRL reserves only reset and get_reward.*rename the tool"):
        environment_tools(env)


def calculate_sum(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return str(a + b)


class Renamed(RetryArithmetic):
    total = calculate_sum  # listed and called as "total", whatever the function's own name


def test_a_tool_is_listed_under_the_name_it_is_called_by():
    tools = environment_tools(Renamed())
    assert list(tools) == ["total"] and tool_schemas(tools)[0]["function"]["name"] == "total"


@pytest.mark.parametrize("name", ["lambda", "class", "two words", "1st"])
def test_a_tool_name_a_call_cannot_use_is_refused(name):
    env_class = type("Odd", (RetryArithmetic,), {name: calculate_sum})
    with pytest.raises(ValueError, match=f"Odd has a tool named '{name}', which a tool call cannot name"):
        environment_tools(env_class())


class Surrogates(RetryArithmetic):
    def echo(self, text: str) -> str:
        """Echo.

        Args:
            text: Anything.
        """
        return "half a pair: \ud83d"


class SurrogateReply(Numbered):
    def reply(self, message):
        return "\udc80" if self.number == 1 else super().reply(message)


def test_text_that_cannot_be_tokenised_is_an_error_reply_or_a_named_failure(demo):
    _, tokenizer = demo
    episode, _, turn = tool_episode(tokenizer, Surrogates())
    reply = tokenizer.decode(turn('<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>'))
    assert "the tool echo returned text that cannot be tokenised (a lone surrogate" in reply
    assert "ud83d" in reply and "at character 13)" in reply
    assert episode.error is None and episode.num_tool_failures == 1
    SurrogateReply.made = 0
    result = episodes(demo, SurrogateReply, num_rows=1, max_turns=2)
    assert result.episodes[0].error == ("reply() returned text that cannot be tokenised (a lone surrogate '\\udc80' "
                                        "at character 0)")
