"""Reward functions and their safe execution.

A reward function is any callable ``f(prompts, completions, **columns) -> list[float | None]``: one
value per completion, where ``columns`` are the prompt rows' other columns repeated per completion
(e.g. ``answer``) plus ``completion_lengths`` (completion lengths in tokens, added by the trainer).
Functions should accept ``**columns`` and ignore what they do not use.

``compute_rewards`` runs several weighted functions so that none can stop a run: a function that
raises or returns the wrong number of values gives every item the fallback; a None, NaN or inf
item gives that item the fallback. Failures are counted per function with the first error message.

Built-ins (``BUILTIN_REWARDS``, made by factories so that a config can set their options):
``math_accuracy`` (final answer checked with math-verify), ``answer_format`` (ends with
``#### <number>``), ``overlong_penalty`` (DAPO's soft overlong punishment).
"""

from __future__ import annotations

import functools
import importlib
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


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math_accuracy": math_accuracy_reward,
    "answer_format": answer_format_reward,
    "overlong_penalty": overlong_penalty_reward,
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
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from err
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attribute!r}")
    return functools.partial(func, **options) if options else func


# ---------------------------------------------------------------- safe execution

@dataclass(frozen=True)
class WeightedReward:
    """A reward function, the name its metrics are logged under, and its weight in the total."""

    name: str
    func: RewardFn
    weight: float = 1.0


@dataclass(frozen=True)
class RewardResult:
    """Rewards of N completions from F functions.

    per_function: name -> float32 [N], each function's own values (fallback where it failed).
    total: float32 [N], the weighted sum over functions.
    num_failed: name -> how many of the N items got the fallback.
    first_error: name -> the first failure's message, or None.
    failed: name -> bool [N], the items that got the fallback.
    """

    per_function: dict[str, torch.Tensor]
    total: torch.Tensor
    num_failed: dict[str, int]
    first_error: dict[str, str | None]
    failed: dict[str, torch.Tensor]


def _reward_name(func: Callable) -> str:
    inner = func.func if isinstance(func, functools.partial) else func
    return getattr(inner, "__name__", type(inner).__name__)


def as_weighted(rewards: Sequence[WeightedReward | tuple[RewardFn, float] | RewardFn]) -> list[WeightedReward]:
    """Normalise ``rewards`` (WeightedReward, (function, weight) or a bare function with weight 1)."""
    weighted = []
    for item in rewards:
        if isinstance(item, WeightedReward):
            weighted.append(item)
        elif isinstance(item, tuple):
            func, weight = item
            weighted.append(WeightedReward(_reward_name(func), func, float(weight)))
        else:
            weighted.append(WeightedReward(_reward_name(item), item, 1.0))
    names = [w.name for w in weighted]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique, got {names}; give WeightedReward explicit names")
    return weighted


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


def _run_one(func: RewardFn, prompts, completions, columns, fallback: float):
    """(values [N] with fallbacks filled, which items failed [N], first error message or None)."""
    n = len(completions)
    problem = _call_problem(func, prompts, completions, columns)
    if problem is None:
        try:
            result = func(prompts, completions, **columns)
            problem = _not_a_list(result, n)
            raw = [] if problem else list(result)
        except Exception as err:  # a broken reward must not stop training; it is counted and reported
            problem = f"{type(err).__name__}: {err}"
    if problem is None and len(raw) != n:
        problem = f"returned {len(raw)} values for {n} completions"
    if problem is not None:
        return [fallback] * n, [True] * n, problem
    values, failed, first_error = [], [], None
    for i, value in enumerate(raw):
        try:
            number = float(value) if value is not None else math.nan
        except (TypeError, ValueError):
            number = math.nan
        failed.append(not math.isfinite(number))
        if failed[-1]:
            first_error = first_error or f"item {i}: returned {value!r}"
            number = fallback
        values.append(number)
    return values, failed, first_error


def compute_rewards(rewards: Sequence[WeightedReward | tuple[RewardFn, float] | RewardFn],
                    prompts: Sequence[str], completions: Sequence[str],
                    columns: dict[str, Sequence[Any]] | None = None, *, fallback: float = 0.0) -> RewardResult:
    """Run every reward function on the N (prompt, completion) pairs, never raising for their faults.

    columns: name -> N values (per completion), passed to every function as keyword arguments.
    """
    columns = dict(columns or {})
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; repeat each prompt per completion")
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
    weighted = as_weighted(rewards)
    total = torch.zeros(n, dtype=torch.float32)
    per_function, num_failed, first_error, failed_items = {}, {}, {}, {}
    for reward in weighted:
        values, failed, error = _run_one(reward.func, list(prompts), list(completions), columns, fallback)
        per_function[reward.name] = torch.tensor(values, dtype=torch.float32)
        total += reward.weight * per_function[reward.name]
        failed_items[reward.name] = torch.tensor(failed, dtype=torch.bool)
        num_failed[reward.name], first_error[reward.name] = sum(failed), error
    return RewardResult(per_function, total, num_failed, first_error, failed_items)
