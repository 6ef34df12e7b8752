"""Environments, as TRL's ``environment_factory`` defines them, plus a plain feedback protocol.

An environment is any object with

* ``reset(**row) -> str | None``: start an episode for a dataset row; a string is appended to the
  prompt's last user message (TRL's rule);
* public methods with type hints and a docstring: its tools. Their JSON schemas come from
  ``transformers.utils.get_json_schema`` and go to the chat template's ``tools=``; a tool's return value,
  as ``str``, is the tool message the model reads next;
* optionally ``get_reward() -> float``: the episode's reward, read when it ends;
* optionally ``reply(message: str) -> str | None`` (ours, for environments that are not tools): called with
  each assistant turn that makes no tool call; a string is the next user message, None ends the episode;
* optionally ``fork() -> env``: an independent copy in the same state, for branching rollouts
  (``rollout.branching``); without it the environment is forked by ``copy.deepcopy``.

An environment written for TRL therefore runs here unchanged, with one exception: TRL reserves only ``reset``
and ``get_reward``, while ``reply`` and ``fork`` are hooks here, never tools. A ``reply`` or ``fork`` that
does not fit its hook's signature (a TRL tool of that name) is refused in one line (``check_hooks``): rename
the tool. Methods may be ``async def`` (awaited, as TRL awaits async tools and ``get_reward``). A tool is
listed under the attribute name it is called by, which must be a Python identifier and not a keyword.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import keyword
import math
import numbers
from collections.abc import Callable
from typing import Any

from turbogrpo.env.tool_calls import ToolCall
from turbogrpo.rollout.env_calls import run_awaited

RESERVED = ("reset", "get_reward", "reply", "fork")
"""Method names with a meaning of their own, never tools."""


def load_factory(spec: str | Callable[[], Any]) -> Callable[[], Any]:
    """The environment factory named ``spec`` (``"package.module:callable"``, like reward functions), or
    ``spec`` itself when it is callable; ValueError in one line when it cannot be imported."""
    if callable(spec):
        return spec
    module_name, colon, attribute = str(spec).partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"[env] factory {spec!r} must be an import path of the form 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:  # any failure of the import is the config's error
        raise ValueError(f"[env] factory {spec!r}: cannot import module {module_name!r} "
                         f"({type(err).__name__}: {err})") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"[env] factory {spec!r}: module {module_name!r} has no callable {attribute!r}")
    return factory


HOOK_PARAMETERS = {"reply": 1, "fork": 0}
"""Our hooks (not TRL's) and how many arguments each takes besides ``self``."""


def environment_tools(env: Any) -> dict[str, Callable]:
    """The environment's tools by name: its public functions (looked up on the class, so properties are
    not evaluated), bound to ``env``. ValueError in one line for a tool whose name cannot be called (not an
    identifier, or a Python keyword) and for a ``reply``/``fork`` that is not our hook (``check_hooks``)."""
    check_hooks(env)
    tools = {}
    for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction):
        if name.startswith("_") or name in RESERVED:
            continue
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"{type(env).__name__} has a tool named {name!r}, which a tool call cannot name (not a "
                             "Python identifier, or a keyword); rename it, or make it private (_name)")
        tools[name] = getattr(env, name)
    return tools


def check_hooks(env: Any) -> None:
    """ValueError in one line when ``env``'s ``reply`` or ``fork`` cannot be called as the hook (a TRL tool of
    that name, which would otherwise be taken for the hook)."""
    for name, count in HOOK_PARAMETERS.items():
        method = getattr(env, name, None)
        if not callable(method):
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):  # a builtin without a signature: taken as the hook
            continue
        try:
            signature.bind(*["message"] * count)
        except TypeError:
            hook = "reply(message) -> str | None" if name == "reply" else "fork() -> an independent copy"
            raise ValueError(f"{type(env).__name__}.{name}{signature} is not turbogrpo's {name} hook ({hook}); TRL "
                             f"reserves only reset and get_reward, but {name} is a hook here, never a tool: rename "
                             "the tool") from None


def tool_schemas(tools: dict[str, Callable]) -> list[dict]:
    """JSON schemas of ``tools`` (``transformers.utils.get_json_schema``); ValueError naming a tool whose
    signature or docstring cannot be read (it needs type hints and a Google-style docstring)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, method in tools.items():
        try:
            schema = get_json_schema(method)
            schema["function"]["name"] = name  # the name a call must use, whatever the function's __name__
            schemas.append(schema)
        except Exception as err:
            raise ValueError(f"environment tool {name!r} has no readable schema ({type(err).__name__}: {err}); give "
                             "it type hints and a docstring with an Args: section, or make it private (_name)") from None
    return schemas


def check_environment(env: Any, spec: object) -> None:
    """ValueError unless ``env`` (what the factory returned) has a callable ``reset``."""
    if not callable(getattr(env, "reset", None)):
        raise ValueError(f"[env] factory {spec!r} returned a {type(env).__name__} without a reset(**row) method")


def bind_positional(tools: dict[str, Callable], call: ToolCall) -> ToolCall:
    """``call`` with its positional arguments named by the tool's signature (chat messages and templates name
    every argument), or with ``error`` set when they do not fit it."""
    tool = tools.get(call.name)
    if not call.positional or call.error is not None or tool is None:
        return call
    try:
        bound = inspect.signature(tool).bind(*call.positional, **call.arguments)
    except TypeError as err:
        return dataclasses.replace(call, positional=(), error=f"wrong arguments for {call.name}: {err}")
    return dataclasses.replace(call, arguments=dict(bound.arguments), positional=())


def call_tool(tools: dict[str, Callable], call: ToolCall) -> tuple[str, bool]:
    """Run one tool call; returns (the tool message's text, whether it failed). A malformed call, an unknown
    tool, wrong arguments or a raising tool all give an error text (as TRL does) so the model can react."""
    if call.error is not None:
        return str({"error": call.error}), True
    tool = tools.get(call.name)
    if tool is None:
        return str({"error": f"Tool {call.name} not found. Available tools: {sorted(tools)}"}), True
    try:
        result = str(run_awaited(tool, **call.arguments))
    except Exception as err:  # the model's bad call is its tool reply, not the run's end
        return str({"error": f"{type(err).__name__}: {err}"}), True
    problem = text_problem(result)
    if problem is not None:
        return str({"error": f"the tool {call.name} returned text that cannot be tokenised ({problem})"}), True
    return result, False


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be tokenised (a lone surrogate, which no UTF-8 tokenizer takes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"a lone surrogate {text[err.start]!r} at character {err.start}"
    return None


class EnvironmentFault(ValueError):
    """An environment method that raised or returned the wrong kind of value; the message names the method."""


def checked_call(env: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``env.<method>(...)``, awaited when it returns an awaitable (TRL's async environments); what it raises
    becomes an ``EnvironmentFault`` naming the method (``reply() raised ConnectionError: ...``)."""
    try:
        return run_awaited(getattr(env, method), *args, **kwargs)
    except Exception as err:
        raise EnvironmentFault(f"{method}() raised {type(err).__name__}: {err}") from err


def reset_environment(env: Any, row: dict) -> str | None:
    """``env.reset(**row)``, checked: it must return a string or None."""
    observation = checked_call(env, "reset", **row)
    if observation is not None and not isinstance(observation, str):
        raise EnvironmentFault(f"reset() returned a {type(observation).__name__}, not a str or None")
    return checked_text(observation, "reset")


def environment_reply(env: Any, message: str) -> str | None:
    """``env.reply(message)``, checked: it must return a string or None."""
    answer = checked_call(env, "reply", message)
    if answer is not None and not isinstance(answer, str):
        raise EnvironmentFault(f"reply() returned a {type(answer).__name__}, not a str or None")
    return checked_text(answer, "reply")


def checked_text(text: str | None, method: str) -> str | None:
    """``text``, or ``EnvironmentFault`` when it cannot be tokenised (``text_problem``)."""
    problem = None if text is None else text_problem(text)
    if problem is not None:
        raise EnvironmentFault(f"{method}() returned text that cannot be tokenised ({problem})")
    return text


def environment_reward_value(env: Any) -> float:
    """``env.get_reward()`` as a float; ``EnvironmentFault`` naming what it raised or returned unless that is a
    finite real number (an int, a float, a 0-d tensor or array; a string such as "0.5" is not one)."""
    value = checked_call(env, "get_reward")
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # a 0-d tensor or NumPy value
        value = value.item()
    if not isinstance(value, numbers.Real):
        shown = repr(value) if len(repr(value)) <= 80 else f"a {type(value).__name__}"
        raise EnvironmentFault(f"get_reward() returned {shown}, not a number")
    if not math.isfinite(float(value)):
        raise EnvironmentFault(f"get_reward() returned {value!r}, not a finite number")
    return float(value)
