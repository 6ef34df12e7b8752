"""Reading tool calls is bounded: calls too deep or too long to read are an error reply to the model, never a
RecursionError or ValueError out of the parser (and so out of the conversation)."""

import json

import pytest

from tests.env.test_episode import demo, tool_episode  # noqa: F401 (fixture)
from turbogrpo.env import TOOL_CALL_PARSERS
from turbogrpo.env.tasks import Calculator


def hermes(arguments: str) -> str:
    return '<tool_call>{"name": "calculate", "arguments": %s}</tool_call>' % arguments


CASES = [  # (parser, turn text, the error the model reads)
    ("hermes", hermes('{"expression": %s%s}' % ("[" * 2000, "]" * 2000)), "nests more than 64 levels of brackets"),
    ("hermes", hermes('{"expression": %s}' % ("9" * 5000)), "cannot be read (ValueError: Exceeds the limit"),
    ("hermes", "<tool_call>%s</tool_call>" % json.dumps({"name": "calculate",
                                                        "arguments": '{"expression": %s}' % ("9" * 5000)}),
     '"arguments" must be a JSON object, got str'),
    ("pythonic", "<tool_call>calculate(%s1)</tool_call>" % ("-" * 4000), "chains more than 64 unary operators"),
    ("pythonic", "<tool_call>calculate(%s1)</tool_call>" % ("- " * 4000), "chains more than 64 unary operators"),
    ("pythonic", "<tool_call>calculate(%s1)</tool_call>" % ("not " * 4000), "chains more than 64 operators"),
    ("pythonic", "<tool_call>calculate(%s1)</tool_call>" % ("1+" * 5000), "chains more than 64 operators"),
    ("pythonic", "<tool_call>calculate(%s)</tool_call>" % ("9" * 5000), "Exceeds the limit (4300 digits)"),
    ("pythonic", "<tool_call>calculate(%s%s)</tool_call>" % ("[" * 2000, "]" * 2000), "nests more than 64 levels"),
]


@pytest.mark.parametrize("parser, text, error", CASES)
def test_unreadable_calls_are_errors_not_exceptions(parser, text, error):
    _, calls = TOOL_CALL_PARSERS[parser](text)
    assert len(calls) == 1 and error in calls[0].error


@pytest.mark.parametrize("text", [case[1] for case in CASES if case[0] == "pythonic"])
def test_a_call_reads_the_same_whatever_the_recursion_limit(text):
    """Compiling a model raises the process's recursion limit; a call's reply must not depend on it."""
    import sys
    previous, replies = sys.getrecursionlimit(), []
    try:
        for limit in (1_000, 100_000):
            sys.setrecursionlimit(limit)
            replies.append(TOOL_CALL_PARSERS["pythonic"](text)[1][0].error)
    finally:
        sys.setrecursionlimit(previous)
    assert replies[0] == replies[1]


def test_ordinary_calls_still_read():
    _, calls = TOOL_CALL_PARSERS["pythonic"]('<tool_call>calculate("12 * 3 - (4 + 5)", digits=-2)</tool_call>')
    assert calls[0].error is None and calls[0].positional == ("12 * 3 - (4 + 5)",)
    assert calls[0].arguments == {"digits": -2}


def test_an_unreadable_call_is_the_models_tool_reply(demo):
    _, tokenizer = demo
    episode, _, turn = tool_episode(tokenizer, Calculator())
    reply = tokenizer.decode(turn(hermes('{"expression": %s%s}' % ("[" * 2000, "]" * 2000))))
    assert reply.startswith("\nResult: {'error': 'the tool call nests more than 64 levels")
    assert episode.error is None and episode.num_tool_failures == 1
    assert tokenizer.decode(turn(hermes('{"expression": "2 * 3"}'))) == "\nResult: 6\nAnswer:"  # still playing
