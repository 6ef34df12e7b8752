"""Tool-call parsing, tool discovery and calls, factories, and the built-in environments' logic."""

import sys
import types

import pytest

from turbogrpo.env import TOOL_CALL_PARSERS, ToolCall, bind_positional, call_tool, environment_tools, get_tool_call_parser, \
    load_factory, tool_schemas
from turbogrpo.env.tasks import Calculator, GuessNumber, RetryArithmetic, evaluate_arithmetic, final_answer


def test_hermes_reads_calls_and_the_text_before_them():
    content, calls = TOOL_CALL_PARSERS["hermes"](
        'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>')
    assert content == "Let me add. "
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("neg", {"x": 3})]
    assert calls[0].as_message_call() == {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


@pytest.mark.parametrize("body, error", [("{not json", "not valid JSON"), ('{"arguments": {}}', 'string "name"'),
                                         ('{"name": "f", "arguments": [1]}', "must be a JSON object")])
def test_malformed_calls_are_kept_with_their_error(body, error):
    _, calls = TOOL_CALL_PARSERS["hermes"](f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and error in calls[0].error


def test_text_without_a_closed_call_has_no_calls():
    assert TOOL_CALL_PARSERS["hermes"]("#### 4 <tool_call>{") == ("#### 4 <tool_call>{", [])
    with pytest.raises(ValueError, match="tool_parser 'xml' is unknown; allowed: \\['hermes', 'none', 'pythonic'\\]"):
        get_tool_call_parser("xml")


def test_pythonic_reads_literal_calls_and_names_positional_arguments_by_signature():
    content, calls = TOOL_CALL_PARSERS["pythonic"]('Sure. <tool_call>add(1, b=2)</tool_call><tool_call>neg("3")</tool_call>')
    assert content == "Sure. "
    assert calls == [ToolCall("add", {"b": 2}, positional=(1,)), ToolCall("neg", {}, positional=("3",))]
    tools = environment_tools(Tools())
    assert bind_positional(tools, calls[0]) == ToolCall("add", {"a": 1, "b": 2})
    assert call_tool(tools, bind_positional(tools, calls[0])) == ("3", False)
    wrong = bind_positional(tools, ToolCall("add", {}, positional=(1, 2, 3)))
    assert "wrong arguments for add" in wrong.error and call_tool(tools, wrong)[1]
    unknown = ToolCall("mul", {}, positional=(1,))
    assert bind_positional(tools, unknown) is unknown  # call_tool names the unknown tool


@pytest.mark.parametrize("body, error", [("add(1", "not a Python call"), ("x.add(1)", 'look like name("argument")'),
                                         ("add(a)", "must be literals"), ("add(*xs)", "not unpacked"),
                                         ("add(**kw)", "not unpacked"), ("1 + 2", 'look like name("argument")')])
def test_malformed_pythonic_calls_are_kept_with_their_error(body, error):
    _, calls = TOOL_CALL_PARSERS["pythonic"](f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and error in calls[0].error


class Tools:
    """An environment written for TRL: public typed methods are its tools."""

    def reset(self, **row):
        return None

    def get_reward(self):
        return 1.0

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def fail(self, x: int) -> int:
        """Always fails.

        Args:
            x: Anything.
        """
        raise RuntimeError("broken tool")

    def _helper(self):
        return 0

    @property
    def state(self):
        raise AssertionError("properties are not evaluated")


def test_public_methods_become_tools_with_json_schemas():
    tools = environment_tools(Tools())
    assert sorted(tools) == ["add", "fail"]
    schema = tool_schemas(tools)[0]
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}


def test_a_tool_without_a_docstring_is_named():
    class Bad:
        def reset(self, **row):
            pass

        def lookup(self, key):
            return key
    with pytest.raises(ValueError, match="environment tool 'lookup' has no readable schema"):
        tool_schemas(environment_tools(Bad()))


@pytest.mark.parametrize("call, expected", [
    (ToolCall("add", {"a": 2, "b": 3}), ("5", False)),
    (ToolCall("fail", {"x": 1}), ("{'error': 'RuntimeError: broken tool'}", True)),
    (ToolCall("nope", {}), ("{'error': \"Tool nope not found. Available tools: ['add', 'fail']\"}", True)),
    (ToolCall("add", {"a": 1}), None),
    (ToolCall("unknown", error="the tool call is not valid JSON"), ("{'error': 'the tool call is not valid JSON'}", True)),
])
def test_tool_calls_give_results_or_error_replies(call, expected):
    text, failed = call_tool(environment_tools(Tools()), call)
    if expected is None:  # wrong arguments: the TypeError is the reply
        assert failed and "TypeError" in text
    else:
        assert (text, failed) == expected


def test_factories_that_cannot_be_imported_fail_in_one_line(monkeypatch):
    broken = types.ModuleType("broken_env_module")
    monkeypatch.setitem(sys.modules, "broken_env_module", broken)
    assert load_factory("turbogrpo.env.tasks:Calculator") is Calculator
    for spec, message in [("no_colon", "must be an import path"),
                          ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
                          ("broken_env_module:Env", "has no callable 'Env'")]:
        with pytest.raises(ValueError, match=message) as err:
            load_factory(spec)
        assert "\n" not in str(err.value)


def test_arithmetic_is_evaluated_without_running_code():
    assert evaluate_arithmetic("(12 + 7) * 3 - -2") == 59
    assert evaluate_arithmetic("7 / 2") == 3.5
    for bad in ("__import__('os')", "2 ** 99999", "x + 1", "[1]"):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate_arithmetic(bad)


def test_calculator_episode():
    env = Calculator()
    env.reset(answer="57", question="...")
    assert env.calculate("19 * 3") == "57" and env.calculate("1 / 4") == "0.25"
    assert env.reply("The answer is\n#### 57") is None and env.get_reward() == 1.0
    env.reset(answer=57)
    env.reply("#### 56")
    assert env.get_reward() == 0.0


def test_guess_number_episode():
    env = GuessNumber()
    env.reset(secret=11)
    assert env.reply("I guess 8") == "Higher."
    assert env.reply("Then 13") == "Lower."
    assert env.reply("no idea") == "Please answer with a number from 1 to 16."
    assert env.get_reward() == 0.0
    assert env.reply("11") is None and env.get_reward() == 1.0 and env.guesses == [8, 13, 11]
    with pytest.raises(ValueError, match="'secret' in \\[1, 16\\]"):
        env.reset(secret=40)


def test_retry_arithmetic_episode():
    env = RetryArithmetic()
    env.reset(answer="16", prompt="...")
    assert env.reply(" 14+7=21 21-6=15\n#### 15") == "Wrong. Try again."
    assert env.reply(" 21-5=16\n#### 16") is None and env.get_reward() == 1.0
    assert final_answer("#### 3 then #### -4") == -4 and final_answer("none") is None


def test_env_config_section_is_checked_in_one_line():
    from turbogrpo.config import EnvConfig, config_from_dict
    assert config_from_dict({"env": {"max_turns": 3}}).env == EnvConfig(max_turns=3)
    for raw, message in [({"tool_parser": "xml"}, "'env.tool_parser': 'xml' is not allowed; expected one of hermes"),
                         ({"max_turns": 0}, "'env.max_turns': 0 is not allowed"),
                         ({"max_turn_tokens": 600}, "at most max_conversation_tokens=512"),
                         ({"factory": "pkg"}, "import path 'package.module:callable'"),
                         ({"reply_timing": "soon"}, "'env.reply_timing': 'soon' is not allowed; expected one of "
                                                    "arrival, next_step"),
                         ({"feed_width": "narrow"}, "'env.feed_width': 'narrow' is not allowed; expected one of "
                                                    "widest, bounded")]:
        with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
            config_from_dict({"env": raw})
    assert config_from_dict({"env": {"factory": "turbogrpo.env.tasks:RetryArithmetic"}}).env.reply_timing == "next_step"
