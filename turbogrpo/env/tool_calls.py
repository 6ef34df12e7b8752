"""Reading tool calls out of an assistant turn's text: one small parser per format, in one table.

A parser takes the turn's text (end-of-turn token already removed) and returns the text around the calls
and the calls. A call whose arguments cannot be read is kept as a ``ToolCall`` with ``error`` set, so that
the model is told what was wrong in its tool reply (as TRL does) and the rollout goes on. Reading is
bounded: a call nested past ``MAX_NESTING`` levels, a number past Python's digit limit or an expression too
deep for the parser is such an error, never an exception out of the parser.

    content, calls = TOOL_CALL_PARSERS["hermes"]('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}'
                                                 '</tool_call>')
    calls[0].name, calls[0].arguments         # "add", {"a": 1}
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its keyword arguments, or why they could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Set when the call is malformed (not JSON, no name, arguments not an object)."""
    positional: tuple = ()
    """Arguments given by position (the pythonic format's ``name("x")``), passed before the keywords."""

    def as_message_call(self) -> dict:
        """The call as a chat message's ``tool_calls`` entry (the form chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


ToolCallParser = Callable[[str], tuple[str, list[ToolCall]]]

MAX_NESTING = 64
"""Most levels of lists and objects in a call's arguments (a model's real call uses a few)."""


def _nesting(text: str) -> int:
    """The deepest bracket nesting of ``text`` (brackets inside strings counted too: an upper bound)."""
    depth = deepest = 0
    for char in text:
        if char in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]})":
            depth = max(0, depth - 1)
    return deepest


def _unreadable(body: str) -> str | None:
    """Why ``body`` is too deep to read safely (checked before any recursive parser runs), or None."""
    if _nesting(body) > MAX_NESTING:
        return f"the tool call nests more than {MAX_NESTING} levels of brackets"
    return None

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes; the Qwen2/2.5/3 and
    SmolLM3 templates): the text before the first block is the content (as written: templates render it back verbatim); an unclosed block is no call."""
    calls = [_hermes_call(body) for body in _HERMES_CALL.findall(text)]
    first = text.find("<tool_call>") if calls else -1
    return text if first < 0 else text[:first], calls


def _hermes_call(body: str) -> ToolCall:
    problem = _unreadable(body)
    if problem is not None:
        return ToolCall("unknown", error=problem)
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("unknown", error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    except (ValueError, RecursionError) as err:  # a number past Python's digit limit; nesting (bounded above)
        return ToolCall("unknown", error=f"the tool call cannot be read ({type(err).__name__}: {str(err)[:120]})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall("unknown", error='the tool call needs a JSON object with a string "name"')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
            pass
    if not isinstance(arguments, dict):
        return ToolCall(payload["name"], error=f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(payload["name"], arguments)


def parse_pythonic(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>name("arg", key=2)</tool_call>`` blocks: one Python call of literal arguments each (the
    pythonic format of Llama 3.2 and vLLM's ``pythonic`` parser, in Hermes' tags). Small models write it
    far more reliably than JSON: SmolLM2-135M-Instruct's JSON calls name tools it was not given."""
    calls = [_pythonic_call(body) for body in _HERMES_CALL.findall(text)]
    first = text.find("<tool_call>") if calls else -1
    return text if first < 0 else text[:first], calls


# Tokens that end an operator chain: an argument's or a bracket's edge (a literal's operators sit between them).
_CHAIN_EDGES = frozenset(",()[]{}:=")
_WORD_OPERATORS = frozenset({"not", "and", "or", "is", "in", "if", "else"})


def _longest_operator_chain(body: str) -> int:
    """The most operators (``-``, ``+``, ``not``, ``*``, ...) between two argument or bracket edges of ``body``,
    outside strings, read by ``tokenize`` (iterative). ``ast.parse`` recurses once per operator of a chain, so the
    chains are bounded before it runs: whether it raises RecursionError depends on the process's recursion limit
    (which compiling a model raises), and a call must read the same wherever it is parsed."""
    longest = run = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(body).readline):
            if token.type == tokenize.OP and token.string in _CHAIN_EDGES:
                run = 0
            elif token.type == tokenize.OP or (token.type == tokenize.NAME and token.string in _WORD_OPERATORS):
                run += 1
                longest = max(longest, run)
    except (tokenize.TokenError, SyntaxError):  # unbalanced or unreadable text: the parser below says why
        pass
    return longest


def _pythonic_call(body: str) -> ToolCall:
    problem = _unreadable(body)
    if problem is None and max(len(run) for run in re.split(r"[^-+~\s]", body)) > MAX_NESTING:
        problem = f"the tool call chains more than {MAX_NESTING} unary operators"
    if problem is None and _longest_operator_chain(body) > MAX_NESTING:
        problem = f"the tool call chains more than {MAX_NESTING} operators"
    if problem is not None:
        return ToolCall("unknown", error=problem)
    try:
        node = ast.parse(body.strip(), mode="eval").body
    except SyntaxError as err:
        return ToolCall("unknown", error=f"the tool call is not a Python call ({err.msg})")
    except (RecursionError, MemoryError, ValueError) as err:  # the parser's own limits
        return ToolCall("unknown", error=f"the tool call cannot be read ({type(err).__name__}: {str(err)[:120]})")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall("unknown", error='the tool call must look like name("argument")')
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return ToolCall(node.func.id, error="tool arguments must be written out, not unpacked with * or **")
    try:
        positional = tuple(ast.literal_eval(a) for a in node.args)
        keywords = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ToolCall(node.func.id, error='tool arguments must be literals, for example name("12 * 3")')
    return ToolCall(node.func.id, keywords, positional=positional)


def parse_none(text: str) -> tuple[str, list[ToolCall]]:
    """No tool calls (feedback environments): the whole turn is content."""
    return text, []


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "pythonic": parse_pythonic, "none": parse_none}
"""Tool-call formats by the name ``[env] tool_parser`` uses."""


def get_tool_call_parser(name: str) -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"[env] tool_parser {name!r} is unknown; allowed: {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]
