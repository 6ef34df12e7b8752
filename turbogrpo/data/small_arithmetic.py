"""A built-in task a small instruct model partly solves: one addition or subtraction of small numbers.

Asked as a chat question ("What is 17 + 5? Reply with only the number."), checked with ``math_accuracy``
against the ``answer`` column. SmolLM2-135M-Instruct gets about 30% of the held-out problems right greedily and
13-15% at temperature 1 (it often rambles, or miscounts), so GRPO has a signal from the first step; the
measurements per candidate task are in ``bench/results/smollm2_task_rates.json``.

The problem space is finite (operands 1..MAX_OPERAND, differences never negative). Each problem's split
is a fixed hash of its arithmetic, so a held-out problem never appears in training, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

SPLITS = ("train", "eval")
MAX_OPERAND = 30
# One problem in EVAL_MODULUS is held out: 1,365 problems, about 340 of them for evaluation.
EVAL_MODULUS = 4
QUESTION = "What is {a} {op} {b}? Reply with only the number."


@dataclass(frozen=True)
class SmallProblem:
    a: int
    op: str  # "+" or "-"
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        return QUESTION.format(a=self.a, op=self.op, b=self.b)


def split_of(problem: SmallProblem) -> str:
    """"eval" for one problem in EVAL_MODULUS (a fixed hash of its arithmetic), else "train"."""
    digest = hashlib.sha256(f"{problem.a}{problem.op}{problem.b}".encode()).digest()
    return "eval" if digest[0] % EVAL_MODULUS == 0 else "train"


def all_problems() -> list[SmallProblem]:
    """Every problem: a + b and a - b (a >= b) for operands in 1..MAX_OPERAND."""
    operands = range(1, MAX_OPERAND + 1)
    return [SmallProblem(a, op, b) for a in operands for b in operands for op in "+-" if op == "+" or a >= b]


def small_arithmetic_records(split: str, num: int, seed: int = 0) -> list[dict[str, str]]:
    """``num`` distinct problems of ``split`` in a seeded order, as rows: ``prompt`` (the question,
    which the chat template wraps) and ``answer`` (the gold number)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    problems = [p for p in all_problems() if split_of(p) == split]
    if not 1 <= num <= len(problems):
        raise ValueError(f"the small_arithmetic task has {len(problems)} {split} problems; data."
                         f"{'num_train_problems' if split == 'train' else 'num_eval_problems'} must be between "
                         f"1 and {len(problems)}, got {num}")
    random.Random(f"turbogrpo-small-arithmetic:{split}:{seed}").shuffle(problems)
    return [{"prompt": p.question, "answer": str(p.answer)} for p in problems[:num]]
