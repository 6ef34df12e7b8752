"""Reward functions and their safe execution.

A reward function is any callable ``f(prompts, completions, **columns) -> list[float | None]``: one
value per completion, where ``columns`` are the prompt rows' other columns repeated per completion
(e.g. ``answer``) plus ``completion_lengths`` (completion lengths in tokens, added by the trainer).
Functions should accept ``**columns`` and ignore what they do not use.

``compute_rewards`` runs several weighted functions so that none can stop a run: a function that
raises or returns the wrong number of values gives every item the fallback; a None, NaN or inf
item gives that item the fallback. Failures are counted per function with the first error message; an
``ItemFailure("why")`` item fails that item with its own message (the environment reward says which
environment method failed and how).

Built-ins (``BUILTIN_REWARDS``, made by factories so that a config can set their options):
``math_accuracy`` (final answer checked with math-verify), ``answer_format`` (ends with
``#### <number>``), ``overlong_penalty`` (DAPO's soft overlong punishment).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from turbogrpo.data.gsm8k import extract_hash_answer
from turbogrpo.reward_items import ItemFailure

RewardFn = Callable[..., Sequence[float | None]]

# ---------------------------------------------------------------- answer checking

_PLAIN_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_FINAL_LINE = re.compile(r"(?:^|\n)####[ \t]*[-+]?[\d,]*\.?\d+[ \t]*$")


def _plain_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is a plain decimal ("1,234", "$18", "-2.50", "7."), else None."""
    cleaned = text.strip().replace(",", "").removeprefix("$").rstrip(".").strip()
    return Fraction(cleaned) if _PLAIN_NUMBER.match(cleaned) else None


def _math_verify_timeout(seconds: int) -> int | None:
    """math-verify times out with SIGALRM, which only the main thread may set; elsewhere run it
    without a timeout (inputs are short and length-capped, see ``answers_match``)."""
    return seconds if threading.current_thread() is threading.main_thread() else None


def _as_math(answer: str) -> str:
    """A bare answer ("2^{3}", "\\frac{1}{2}") in math delimiters, so math-verify reads it as LaTeX."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
    from math_verify import parse

    return parse(_as_math(gold), parsing_timeout=timeout)


def answers_match(predicted: str, gold: str, *, predicted_is_answer: bool = True, timeout_seconds: int = 2,
                  max_chars: int = 400) -> bool:
    """Whether ``predicted`` states the answer ``gold``: exact for plain numbers, math-verify otherwise.

    predicted_is_answer: ``predicted`` is only the answer (e.g. the text after ``####``); False: it is
        a whole completion, in which math-verify looks for a \\boxed{} or final expression.
    Plain numbers (the demo task, GSM8K) compare as exact fractions in microseconds; anything else
    goes through math-verify's parse + verify (milliseconds).
    """
    fast_predicted = _plain_number(predicted) if predicted_is_answer else None
    fast_gold = _plain_number(gold)
    if fast_predicted is not None and fast_gold is not None:
        return fast_predicted == fast_gold
    from math_verify import parse, verify

    timeout = _math_verify_timeout(timeout_seconds)
    gold_parsed = _parse_gold(gold, timeout)
    # The end of a completion holds its answer; capping the text bounds sympy's work on long outputs.
    predicted = _as_math(predicted) if predicted_is_answer else predicted
    predicted_parsed = parse(predicted[-max_chars:], parsing_timeout=timeout)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


def gold_answer(value: Any) -> str | None:
    """A gold-answer column value as answer text: numbers as is, GSM8K solutions after ``####``."""
    if value is None:
        return None
    text = str(value)
    hashed = extract_hash_answer(text)
    return (hashed if hashed is not None else text.strip()) or None


# ---------------------------------------------------------------- built-in reward factories

def math_accuracy_reward(answer_column: str = "answer", timeout_seconds: int = 2) -> RewardFn:
    """1.0 if a completion's final answer equals the gold answer in ``answer_column``, else 0.0
    (None where the gold answer is missing, so the item gets the fallback and is counted)."""
    if timeout_seconds < 1:
        raise ValueError(f"math_accuracy: timeout_seconds must be an integer >= 1, got {timeout_seconds}")

    def math_accuracy(prompts, completions, **columns) -> list[float | None]:
        if answer_column not in columns:
            raise ValueError(f"math_accuracy needs the gold-answer column {answer_column!r}; the columns are "
                             f"{sorted(columns)}")
        rewards = []
        for completion, gold_value in zip(completions, columns[answer_column]):
            gold = gold_answer(gold_value)
            if gold is None:
                rewards.append(None)
                continue
            hashed = extract_hash_answer(completion)
            matched = answers_match(completion if hashed is None else hashed, gold,
                                    predicted_is_answer=hashed is not None, timeout_seconds=timeout_seconds)
            rewards.append(1.0 if matched else 0.0)
        return rewards

    return math_accuracy


def answer_format_reward() -> RewardFn:
    """1.0 if a completion ends with a final line ``#### <number>`` (its only ``####``), else 0.0."""

    def answer_format(prompts, completions, **columns) -> list[float]:
        return [1.0 if c.count("####") == 1 and _FINAL_LINE.search(c.rstrip()) else 0.0 for c in completions]

    return answer_format


def overlong_penalty_reward(max_length: int, buffer: int) -> RewardFn:
    """DAPO's soft overlong punishment on a completion of L tokens: 0 while L <= max_length - buffer,
    then falling linearly to -1 at L = max_length, and -1 beyond. Reads ``completion_lengths``."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_penalty: need 0 < buffer <= max_length, got buffer={buffer}, "
                         f"max_length={max_length}")
    free = max_length - buffer

    def overlong_penalty(prompts, completions, **columns) -> list[float]:
        if "completion_lengths" not in columns:
            raise ValueError("overlong_penalty needs the completion_lengths column (tokens per completion)")
        return [max(-1.0, min(0.0, (free - length) / buffer)) for length in columns["completion_lengths"]]

    return overlong_penalty


def environment_reward_function() -> RewardFn:
    """Each conversation's environment reward (its ``get_reward()``), read from the ``environments`` column
    that multi-turn rollouts add (``turbogrpo.env.environment_reward``)."""
    from turbogrpo.env.episode import environment_reward
    return environment_reward


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math_accuracy": math_accuracy_reward,
    "answer_format": answer_format_reward,
    "overlong_penalty": overlong_penalty_reward,
    "environment": environment_reward_function,
}

math_accuracy = math_accuracy_reward()
answer_format = answer_format_reward()


def resolve_reward(spec: str | RewardFn, **options) -> RewardFn:
    """A reward function from a built-in name (``BUILTIN_REWARDS``, made with ``options``), a
    ``"module:function"`` import path (``options`` bound as keyword arguments), or a callable."""
    if callable(spec):
        return functools.partial(spec, **options) if options else spec
    if spec in BUILTIN_REWARDS:
        factory = BUILTIN_REWARDS[spec]
        try:
            inspect.signature(factory).bind(**options)
        except TypeError as err:
            raise ValueError(f"reward {spec!r}: bad options {sorted(options)} ({err}); its options are "
                             f"{list(inspect.signature(factory).parameters)}") from None
        return factory(**options)
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"reward {spec!r} is neither a built-in ({sorted(BUILTIN_REWARDS)}) nor an import "
                         "path of the form 'package.module:function'")
    module = _import_reward_module(spec, module_name)
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attribute!r}")
    return functools.partial(func, **options) if options else func


def _import_reward_module(spec: str, module_name: str):
    """``module_name`` imported; any failure of its import (missing, a syntax error, an exception or
    ``sys.exit`` at import) is one ValueError naming the reward and the module's file."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from None
    except SyntaxError as err:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has a syntax error in {err.filename}, line "
                         f"{err.lineno}: {err.msg}") from None
    except (Exception, SystemExit) as err:
        raised = (f"called sys.exit({err.code!r})" if isinstance(err, SystemExit)
                  else f"raised {type(err).__name__}: {cut_message(str(err))}")
        raise ValueError(f"reward {spec!r}: importing module {module_name!r} ({_module_file(module_name)}) "
                         f"{raised}") from None


def _module_file(module_name: str) -> str:
    """The file a module is loaded from, for messages (its name where it cannot be found)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # a parent package that fails to import
        spec = None
    return spec.origin if spec is not None and spec.origin else module_name


# ---------------------------------------------------------------- safe execution

@dataclass(frozen=True)
class Reward:
    """A reward function, the name its metrics are logged under, its weight in the total, and the
    value an item gets where the function fails on it (None: ``compute_rewards``' ``fallback``)."""

    name: str
    func: RewardFn
    weight: float = 1.0
    fallback: float | None = None


@dataclass(frozen=True)
class RewardResult:
    """Rewards of N completions from F functions.

    per_function: name -> float32 [N], each function's own values (fallback where it failed).
    total: float32 [N], the weighted sum over functions.
    num_failed: name -> how many of the N items got the fallback.
    first_error: name -> the first failure's message cut to ``MAX_ERROR_CHARS`` (for the console), or None.
    failed: name -> bool [N], the items that got the fallback.
    full_error: name -> the first failure's whole message, or None (what a run's metrics.jsonl keeps).
    """

    per_function: dict[str, torch.Tensor]
    total: torch.Tensor
    num_failed: dict[str, int]
    first_error: dict[str, str | None]
    failed: dict[str, torch.Tensor]
    full_error: dict[str, str | None] = dataclasses.field(default_factory=dict)


def _reward_name(func: Callable) -> str:
    inner = func.func if isinstance(func, functools.partial) else func
    return getattr(inner, "__name__", type(inner).__name__)


def as_rewards(rewards: Sequence[Reward | tuple[RewardFn, float] | RewardFn]) -> list[Reward]:
    """Normalise ``rewards`` (Reward, (function, weight) or a bare function with weight 1)."""
    records = []
    for item in rewards:
        if isinstance(item, Reward):
            records.append(item)
        elif isinstance(item, tuple):
            func, weight = item
            records.append(Reward(_reward_name(func), func, float(weight)))
        else:
            records.append(Reward(_reward_name(item), item, 1.0))
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique, got {names}; give Reward explicit names")
    return records


def build_rewards(configs) -> list[Reward]:
    """The ``[[rewards]]`` entries (RewardConfig: function, weight, fallback, kwargs) resolved, built-in or
    import path, each named after its function (``name_i`` for a repeated one); ValueError naming a bad one."""
    rewards = []
    for i, rc in enumerate(configs):
        try:
            func = resolve_reward(rc.function, **rc.kwargs)
        except ValueError as err:
            raise ValueError(f"config key 'rewards.{i}.function': {err}") from None
        name = rc.function.rpartition(":")[2]
        if any(r.name == name for r in rewards):
            name = f"{name}_{i}"
        rewards.append(Reward(name, func, rc.weight, rc.fallback))
    return rewards


def accuracy_reward(name: str, rewards: Sequence[Reward]) -> Reward | None:
    """The reward that defines held-out "accuracy" (train.accuracy_reward): the run's ``rewards`` entry of that
    ``name``, else the built-in of that name, unweighted ("" or an unknown name: None, no evaluation)."""
    for reward in rewards:
        if reward.name == name:
            return reward
    if name in BUILTIN_REWARDS:
        return Reward(name, resolve_reward(name), 0.0, 0.0)
    return None


def _call_problem(func: RewardFn, prompts, completions, columns) -> str | None:
    """Why ``func(prompts, completions, **columns)`` cannot be called, or None (checked before calling,
    so that a missing ``**columns`` is reported as such, not as whatever TypeError the call raises)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins have no signature; just call them
        return None
    try:
        signature.bind(prompts, completions, **columns)
    except TypeError as err:
        return (f"cannot be called as f(prompts, completions, **columns) with columns {sorted(columns)} ({err}); "
                "give it a **columns (or **kwargs) parameter to accept the columns it does not use")
    return None


def _not_a_list(result: Any, n: int) -> str | None:
    """Why ``result`` is not one value per completion, or None."""
    if isinstance(result, (str, bytes)):
        return f"returned a string ({result[:60]!r}), not a list of {n} numbers (one per completion)"
    if isinstance(result, Mapping) or not isinstance(result, Iterable):
        return f"returned a {type(result).__name__} ({result!r:.60}), not a list of {n} numbers (one per completion)"
    return None


# A reward's message is printed in one warning line; a megabyte exception text is cut to this many
# characters there (the whole text goes to the run's metrics.jsonl, ``RewardResult.full_error``).
MAX_ERROR_CHARS = 500


def cut_message(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` whole when it is at most ``limit`` characters, else its start and a note of its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [... cut: {len(text):,} characters in all; a training run's metrics.jsonl keeps them]"


def _as_number(value: Any) -> float:
    """``value`` as a float; NaN for None or a non-number, +-inf for a number beyond float's range (a
    Python int of 400 digits), so that both fail like inf."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        return math.nan


def _describe_value(value: Any) -> str:
    """A returned value for a message: its repr, shortened for a number with hundreds of digits."""
    text = repr(value)
    if isinstance(value, int) and len(text) > 40:
        return f"an integer of {len(text.lstrip('-'))} digits ({text[:12]}...)"
    return cut_message(text, 200)


def _run_one(func: RewardFn, prompts, completions, columns, fallback: float):
    """(float32 values [N] with fallbacks filled, which items failed bool [N], first error message or None).

    Values are checked in float32, the dtype the advantages and the loss use: 1e39 is a finite Python
    float but inf in float32, so it is a failure like NaN, inf or None.
    """
    n = len(completions)
    problem = _call_problem(func, prompts, completions, columns)
    if problem is None:
        try:
            result = func(prompts, completions, **columns)
            problem = _not_a_list(result, n)
            raw = [] if problem else list(result)
        except Exception as err:  # a broken reward must not stop training; it is counted and reported
            problem = f"{type(err).__name__}: {err}"
        except SystemExit as err:  # sys.exit() in a reward is its failure, not the run's end
            problem = f"called sys.exit({err.code!r})"
    if problem is None and len(raw) != n:
        problem = f"returned {len(raw)} values for {n} completions"
    if problem is not None:
        return torch.full((n,), fallback, dtype=torch.float32), torch.ones(n, dtype=torch.bool), problem
    numbers = [_as_number(value) for value in raw]
    values = torch.tensor(numbers, dtype=torch.float64).to(torch.float32)
    failed = ~torch.isfinite(values)
    first_error = None
    if failed.any():
        i = int(failed.nonzero()[0])
        # A finite Python float past float32's range, or a Python int past float64's: not the same inf
        # the function returned itself.
        past_range = math.isfinite(numbers[i]) or (math.isinf(numbers[i]) and isinstance(raw[i], int))
        beyond = f", beyond float32's range (largest {torch.finfo(torch.float32).max:.3g})" if past_range else ""
        first_error = (f"item {i}: {raw[i].reason}" if isinstance(raw[i], ItemFailure) else
                       f"item {i}: returned {_describe_value(raw[i])}{beyond}")
    return values.masked_fill(failed, fallback), failed, first_error


def compute_rewards(rewards: Sequence[Reward | tuple[RewardFn, float] | RewardFn],
                    prompts: Sequence[str], completions: Sequence[str],
                    columns: dict[str, Sequence[Any]] | None = None, *, fallback: float = 0.0) -> RewardResult:
    """Run every reward function on the N (prompt, completion) pairs, never raising for their faults.

    columns: name -> N values (per completion), passed to every function as keyword arguments.
    fallback: what a failed item gets from a function whose Reward sets no fallback of its own.
    """
    columns = dict(columns or {})
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; repeat each prompt per completion")
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
    total = torch.zeros(n, dtype=torch.float32)
    per_function, num_failed, first_error, failed_items, full_error = {}, {}, {}, {}, {}
    for reward in as_rewards(rewards):
        own_fallback = fallback if reward.fallback is None else reward.fallback
        values, failed, error = _run_one(reward.func, list(prompts), list(completions), columns, own_fallback)
        per_function[reward.name], failed_items[reward.name] = values, failed
        total += reward.weight * values
        num_failed[reward.name], full_error[reward.name] = int(failed.sum()), error
        first_error[reward.name] = None if error is None else cut_message(error)
    return RewardResult(per_function, total, num_failed, first_error, failed_items, full_error)


def reward_columns(rows: Sequence[Mapping[str, Any]], completion_lengths: Sequence[int]) -> dict[str, list]:
    """The columns reward functions get, one value per completion: each completion's prompt row's
    columns (``rows``, one per completion), plus ``completion_lengths`` in tokens.

    The names are those of every row, not of the first: a row without a column gives None there, so
    only its own items fail (and are counted), never the whole batch's.
    """
    names = list(dict.fromkeys(name for row in rows for name in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    columns["completion_lengths"] = [int(length) for length in completion_lengths]
    return columns


def score_completions(rewards: Sequence[Reward], examples: Sequence, completions: Sequence[str],
                      completion_lengths: Sequence[int], num_samples: int = 1,
                      per_completion: Mapping[str, Sequence[Any]] | None = None) -> RewardResult:
    """Rewards of ``num_samples`` completions per example (completions group-major: example 0's first),
    the one place training and evaluation call the reward functions from.

    examples: prompts with ``.text`` and ``.columns`` (``data.PromptExample``).
    completion_lengths: tokens per completion, for the ``completion_lengths`` column.
    per_completion: more columns, one value per completion (``environments``: multi-turn episodes).
    """
    repeated = [e for e in examples for _ in range(num_samples)]
    columns = reward_columns([e.columns for e in repeated], completion_lengths)
    return compute_rewards(rewards, [e.text for e in repeated], completions, {**columns, **(per_completion or {})})


def __getattr__(name: str):
    if name == "WeightedReward":  # deprecated in 0.2: the one reward record is Reward (it adds a fallback)
        import warnings
        warnings.warn("turbogrpo.rewards.WeightedReward is deprecated; use turbogrpo.rewards.Reward",
                      DeprecationWarning, stacklevel=2)
        return Reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
