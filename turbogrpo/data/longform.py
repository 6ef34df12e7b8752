"""The built-in long-form task: multi-step word problems whose solutions have a long tail of lengths.

The arithmetic task's problems (a start count and signed changes, same names, items and verbs),
but with 3 to 12 changes, and a solution that writes each step's working on its own numbered line:

    prompt:      <PREAMBLE>Question: Mia has 14 pens. She buys 7 more. Then she sells 5. ...\\nAnswer:
    completion:   Step 1: 14+7=21.
                 Step 2: 21-5=16.
                 ...
                 #### 16

A step line is about 14 tokens, so a solution is about 4 + 14 x steps tokens: ~45 for 3 steps,
~175 for 12 (the demo task's working, one step a line: the shipped model starts from the demo
model). The number of steps is drawn with weights ``step_decay ** (steps - min_steps)``, so most problems are short and a few are long: in a GRPO rollout most sequences end early and the
live batch shrinks to a few long ones (the tail that speculative decoding has something to win on).

Train and held-out problems never overlap, by the arithmetic task's hash split of the numbers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from turbogrpo.data.arithmetic import (SPLITS, ArithmeticConfig, ArithmeticProblem, SolutionStep, Wording,
                                       _draw_arithmetic, draw_wording, problem_records, question_block,
                                       split_of)

INSTRUCTION = (
    "Solve the word problem step by step, one numbered line per change with the running total: add what a "
    "person gets (buys, finds, is given, wins, picks) and subtract "
    "what they lose (gives away, sells, loses, drops, trades away). End with the final number after ####.\n\n")


@dataclass(frozen=True)
class LongformConfig:
    """Difficulty and length distribution of generated problems (numbers are inclusive ranges)."""

    min_steps: int = 3
    max_steps: int = 12
    step_decay: float = 0.75  # P(steps) is proportional to step_decay ** (steps - min_steps): a long tail
    min_start: int = 10  # two digits: the demo model (the shipped model's start) miscopies one-digit starts
    max_start: int = 30
    min_amount: int = 2
    max_amount: int = 9
    max_value: int = 40  # every running total stays in [0, max_value]: the demo task's numbers

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"LongformConfig: need 1 <= min_steps <= max_steps, got "
                             f"{self.min_steps}, {self.max_steps}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"LongformConfig: step_decay must be in (0, 1], got {self.step_decay}")
        self.numbers(self.min_steps)  # the number ranges are checked by ArithmeticConfig

    def numbers(self, steps: int) -> ArithmeticConfig:
        """The arithmetic task's config for a problem of exactly ``steps`` changes."""
        return ArithmeticConfig(min_start=self.min_start, max_start=self.max_start, min_amount=self.min_amount,
                                max_amount=self.max_amount, min_steps=steps, max_steps=steps,
                                max_value=self.max_value)

    def step_weights(self) -> dict[int, float]:
        """Unnormalised P(number of steps)."""
        return {n: self.step_decay ** (n - self.min_steps) for n in range(self.min_steps, self.max_steps + 1)}


@dataclass(frozen=True)
class LongformProblem(ArithmeticProblem):
    """An arithmetic problem told with ``wording`` (kept for tools that restate it), solved one step a line."""

    wording: Wording

    def solution_text(self, steps: Sequence[SolutionStep]) -> str:
        return format_longform_solution(steps)

    @property
    def prompt(self) -> str:
        return PREAMBLE + question_block(self.question)


def format_longform_solution(steps: Sequence[SolutionStep]) -> str:
    """One numbered line of working per step, then ``#### <last result>`` (the result of the written
    steps, right or wrong)."""
    lines = [f" Step {k}: {s.before}{s.op}{s.amount}={s.result}." for k, s in enumerate(steps, 1)]
    return "\n".join(lines) + f"\n#### {steps[-1].result}"


def generate_longform_problems(split: str, num: int, seed: int = 0,
                               config: LongformConfig = LongformConfig()) -> list[LongformProblem]:
    """``num`` distinct problems of ``split``, the same for the same arguments."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"turbogrpo-longform:{split}:{seed}")
    weights = config.step_weights()
    problems, seen = [], set()
    for _ in range(1000 + 100 * num):
        if len(problems) == num:
            return problems
        steps = rng.choices(list(weights), weights=list(weights.values()))[0]
        start, changes = _draw_arithmetic(rng, config.numbers(steps))
        if (start, changes) in seen or split_of(start, changes) != split:
            continue
        seen.add((start, changes))
        wording = draw_wording(rng, changes)
        problems.append(LongformProblem(wording.question(start), start, changes, wording))
    raise ValueError(f"could not draw {num} distinct {split} problems with {config}; "
                     "ask for fewer or widen the number ranges")


def longform_records(split: str, num: int, seed: int = 0,
                     config: LongformConfig = LongformConfig()) -> list[dict[str, str]]:
    """Prompt rows (``prompt``, ``question``, ``answer``, ``solution``) of ``num`` problems."""
    return problem_records(generate_longform_problems(split, num, seed, config))


def _few_shot_block() -> str:
    rng = random.Random("turbogrpo-longform:few-shot")
    shots = [(23, (8, -5, 6)), (31, (-9, 4, -7, 3, -6))]
    blocks = []
    for start, changes in shots:
        wording = draw_wording(rng, changes)
        problem = LongformProblem(wording.question(start), start, changes, wording)
        blocks.append(question_block(problem.question) + problem.completion + "\n\n")
    return "".join(blocks)


PREAMBLE = INSTRUCTION + _few_shot_block()
