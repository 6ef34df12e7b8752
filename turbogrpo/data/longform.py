"""The built-in long-form task: multi-step word problems whose solutions have a long tail of lengths.

The arithmetic task's problems (a start count and signed changes, same names, items and verbs),
but with 3 to 12 changes, written in the demo task's own format, just with more steps:

    prompt:      <PREAMBLE>Question: Mia has 14 pens. She buys 7 more. Then she sells 5. ...\\nAnswer:
    completion:   14+7=21 21-5=16 16+3=19 ...\\n#### 19

The demo model already writes this working for 2 steps, so the shipped long-form model is a short
fine-tune of it (a new format, tried first, was foreign to it: see scripts/build_longform_model.py).
A step is about 8 tokens (every digit is a token), so a solution is about 5 + 8 x steps tokens:
~30 for 3 steps, ~100 for 12. The number of steps is drawn with weights
``step_decay ** (steps - min_steps)``, so most problems are short and a few are long: in a GRPO
rollout most sequences end early and the live batch shrinks to a few long ones (the tail that speculative decoding has something to win on).

Train and held-out problems never overlap, by the arithmetic task's hash split of the numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from turbogrpo.data.arithmetic import (INSTRUCTION, SPLITS, ArithmeticConfig, ArithmeticProblem, Wording,
                                       _draw_arithmetic, draw_wording, problem_records, question_block,
                                       split_of)


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
    """An arithmetic problem told with ``wording`` (kept for tools that restate it); its solution is
    the arithmetic task's (``format_solution``), with 3 to 12 steps."""

    wording: Wording

    @property
    def prompt(self) -> str:
        return PREAMBLE + question_block(self.question)


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
