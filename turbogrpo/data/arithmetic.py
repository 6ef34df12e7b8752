"""The built-in demo task: seeded arithmetic word problems behind one long shared preamble.

A problem is a start count and a few signed changes ("buys 7 more" is +7, "gives away 5" is -5).
Every prompt is the same instruction + few-shot preamble followed by one question, so the preamble
is most of each prompt's tokens (what the shared-prefix forward saves). A solution is one line of
working and the final number, checked exactly:

    prompt:      <PREAMBLE>Question: Mia has 14 pens. She buys 7 more. ...\nAnswer:
    completion:   14+7=21 21-5=16\n#### 16

Train and held-out eval problems never overlap: the split of a problem is a fixed hash of its
arithmetic (start and changes), so no eval problem's numbers ever appear in training, whatever
the seeds.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

SPLITS = ("train", "eval")
# One problem signature in EVAL_MODULUS is held out for evaluation.
EVAL_MODULUS = 8

NAMES = (("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Ben", "He"), ("Lily", "She"), ("Sam", "He"),
         ("Zoe", "She"), ("Max", "He"), ("Emma", "She"), ("Leo", "He"), ("Nora", "She"), ("Omar", "He"),
         ("Ivy", "She"), ("Jack", "He"), ("Ruth", "She"), ("Paul", "He"))
ITEMS = ("apples", "pens", "stickers", "marbles", "cards", "books", "coins", "shells", "stamps",
         "cookies", "balloons", "pencils", "beads", "toys", "rocks", "buttons")
GAIN_PHRASES = ("buys {n} more", "finds {n} more", "is given {n} more", "wins {n} more", "picks {n} more")
LOSS_PHRASES = ("gives away {n}", "sells {n}", "loses {n}", "drops {n}", "trades away {n}")

INSTRUCTION = (
    "Solve the word problem. Add what a person gets (buys, finds, is given, wins, picks) and subtract "
    "what they lose (gives away, sells, loses, drops, trades away). Write each step on one line, then "
    "the final number after ####.\n\n")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty of generated problems (numbers are inclusive ranges)."""

    min_start: int = 5
    max_start: int = 30
    min_amount: int = 2
    max_amount: int = 9
    min_steps: int = 2
    max_steps: int = 2
    max_value: int = 40  # every running total stays in [0, max_value]

    def __post_init__(self):
        if not 0 <= self.min_start <= self.max_start <= self.max_value:
            raise ValueError(f"ArithmeticConfig: need 0 <= min_start <= max_start <= max_value, got "
                             f"{self.min_start}, {self.max_start}, {self.max_value}")
        if not 1 <= self.min_amount <= self.max_amount:
            raise ValueError(f"ArithmeticConfig: need 1 <= min_amount <= max_amount, got "
                             f"{self.min_amount}, {self.max_amount}")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"ArithmeticConfig: need 1 <= min_steps <= max_steps, got "
                             f"{self.min_steps}, {self.max_steps}")


@dataclass(frozen=True)
class SolutionStep:
    """One line-step of working: ``before op amount = result``."""

    before: int
    op: str  # "+" or "-"
    amount: int
    result: int


@dataclass(frozen=True)
class ArithmeticProblem:
    """A word problem: ``start`` things, then ``changes`` (signed) applied in order."""

    question: str
    start: int
    changes: tuple[int, ...]

    @property
    def answer(self) -> int:
        return self.start + sum(self.changes)

    def steps(self) -> list[SolutionStep]:
        """The correct working, one step per change."""
        steps, total = [], self.start
        for change in self.changes:
            steps.append(SolutionStep(total, "+" if change > 0 else "-", abs(change), total + change))
            total += change
        return steps

    def solution_text(self, steps: Sequence[SolutionStep]) -> str:
        """A completion writing out ``steps`` (the correct ones, or a noisy copy for a warm start)."""
        return format_solution(steps)

    @property
    def completion(self) -> str:
        """The reference completion (what the model should write after the prompt)."""
        return self.solution_text(self.steps())

    @property
    def prompt(self) -> str:
        return PREAMBLE + question_block(self.question)


def format_solution(steps: Sequence[SolutionStep]) -> str:
    """`` 14+7=21 21-5=16\\n#### 16``: the working on one line, then the last result after ####."""
    working = " ".join(f"{s.before}{s.op}{s.amount}={s.result}" for s in steps)
    return f" {working}\n#### {steps[-1].result}"


def question_block(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def split_of(start: int, changes: Sequence[int]) -> str:
    """The split ("train" or "eval") a problem's arithmetic belongs to; fixed, seed-independent."""
    digest = hashlib.blake2b(f"{start}:{','.join(map(str, changes))}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_MODULUS == 0 else "train"


@dataclass(frozen=True)
class Wording:
    """How a problem is told: who, what, and one phrase per change (amounts filled in)."""

    name: str
    pronoun: str
    item: str
    phrases: tuple[str, ...]  # e.g. ("buys 7 more", "gives away 5")

    def sentences(self, start: int) -> list[str]:
        """The statement, one sentence per fact: the start, then each change in order."""
        changes = [f"{self.pronoun if i == 0 else 'Then ' + self.pronoun.lower()} {phrase}."
                   for i, phrase in enumerate(self.phrases)]
        return [f"{self.name} has {start} {self.item}.", *changes]

    def question(self, start: int) -> str:
        return " ".join([*self.sentences(start), f"How many {self.item} does {self.name} have now?"])


def draw_wording(rng: random.Random, changes: Sequence[int]) -> Wording:
    """A random person, item and verb per change (a gain verb for a positive change, else a loss verb)."""
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    phrases = tuple(rng.choice(GAIN_PHRASES if change > 0 else LOSS_PHRASES).format(n=abs(change))
                    for change in changes)
    return Wording(name, pronoun, item, phrases)


def _render_question(rng: random.Random, start: int, changes: Sequence[int]) -> str:
    return draw_wording(rng, changes).question(start)


def _draw_arithmetic(rng: random.Random, config: ArithmeticConfig) -> tuple[int, tuple[int, ...]]:
    """A start and signed changes whose running totals stay within [0, config.max_value]."""
    total = start = rng.randint(config.min_start, config.max_start)
    changes = []
    for _ in range(rng.randint(config.min_steps, config.max_steps)):
        allowed_gain = min(config.max_amount, config.max_value - total)
        allowed_loss = min(config.max_amount, total)
        signs = [s for s, allowed in ((1, allowed_gain), (-1, allowed_loss)) if allowed >= config.min_amount]
        sign = rng.choice(signs)  # never empty: totals stay in range and max_amount >= min_amount
        change = sign * rng.randint(config.min_amount, allowed_gain if sign > 0 else allowed_loss)
        changes.append(change)
        total += change
    return start, tuple(changes)


def generate_problems(split: str, num: int, seed: int = 0, config: ArithmeticConfig = ArithmeticConfig(),
                      *, distinct: bool = True) -> list[ArithmeticProblem]:
    """``num`` problems of ``split``, the same for the same arguments.

    distinct: no two problems share their arithmetic (start and changes); False allows repeats
        (with fresh wording), for more training problems than the number space holds.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"turbogrpo-arithmetic:{split}:{seed}")
    problems, seen = [], set()
    max_draws = 1000 + 100 * num
    for _ in range(max_draws):
        if len(problems) == num:
            return problems
        start, changes = _draw_arithmetic(rng, config)
        if (distinct and (start, changes) in seen) or split_of(start, changes) != split:
            continue
        seen.add((start, changes))
        problems.append(ArithmeticProblem(_render_question(rng, start, changes), start, changes))
    raise ValueError(f"could not draw {num} distinct {split} problems with {config}; "
                     "ask for fewer or widen the number ranges")


def problem_records(problems: Sequence[ArithmeticProblem]) -> list[dict[str, str]]:
    """Rows for the generic prompt pipeline: ``prompt`` (full prompt text), ``question``,
    ``answer`` (the gold number, for rewards) and ``solution`` (the reference completion)."""
    return [{"prompt": p.prompt, "question": p.question, "answer": str(p.answer), "solution": p.completion}
            for p in problems]


def demo_records(split: str, num: int, seed: int = 0,
                 config: ArithmeticConfig = ArithmeticConfig()) -> list[dict[str, str]]:
    """``problem_records(generate_problems(split, num, seed, config))``."""
    return problem_records(generate_problems(split, num, seed, config))


def demo_chat_records(split: str, num: int, seed: int = 0,
                      config: ArithmeticConfig = ArithmeticConfig()) -> list[dict[str, str]]:
    """``demo_records`` with each prompt as the user's message: the demo prompt up to its question, without
    the closing ``\\nAnswer:`` that a chat template writes as the assistant turn's header (the demo model's
    ``turbogrpo.env.tasks.DEMO_CHAT_TEMPLATE`` does), so that a multi-turn rollout sees the demo prompt."""
    header = question_block("").removeprefix("Question: ")  # "\nAnswer:"
    return [{**row, "prompt": row["prompt"].removesuffix(header)} for row in demo_records(split, num, seed, config)]


def _few_shot_block() -> str:
    rng = random.Random("turbogrpo-arithmetic:few-shot")
    shots = [(23, (8, -5)), (14, (-9, 6)), (17, (-9, -4))]
    blocks = []
    for start, changes in shots:
        problem = ArithmeticProblem(_render_question(rng, start, changes), start, changes)
        blocks.append(question_block(problem.question) + problem.completion + "\n\n")
    return "".join(blocks)


PREAMBLE = INSTRUCTION + _few_shot_block()
