"""Built-in multi-turn tasks for SmolLM2-135M-Instruct: a calculator tool and a guess-the-number game.

Each row's ``prompt`` is a list of chat messages (a short system prompt and one worked example
conversation, then the question); its other columns go to the environment's ``reset(**row)``
(``turbogrpo.env.tasks``: ``Calculator`` reads ``answer``, ``GuessNumber`` reads ``secret``).

* ``calculator`` ("What is 37 * 52 - 18?"): two operations on two-digit numbers, which the model cannot
  do in its head (0% greedy without the tool) but can hand to the ``calculate`` tool in the pythonic call
  format (``<tool_call>calculate("37 * 52 - 18")</tool_call>``). Each problem's split is a fixed hash of its
  arithmetic, so a held-out problem never appears in training.
* ``guess_number``: a secret in 1..16 found with "Higher."/"Lower." replies in at most ``[env] max_turns``
  guesses. The secrets are the same 16 in both splits (the game has no other content); the held-out rows are
  fixed (seed 0, each secret equally often) and the training rows are drawn from the run's seed.

Base rates (greedy and sampled, before training) are in ``bench/results/smollm2_tool_task_rates.json``
(``scripts/smollm2_tool_task_rates.py``).
"""

from __future__ import annotations

import hashlib
import random

CALCULATOR_SYSTEM = "You have a calculator tool. Use it for arithmetic, then reply with only the number."
CALCULATOR_SHOT = (
    {"role": "user", "content": "What is 37 * 52 - 18?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "37 * 52 - 18"}}}]},
    {"role": "tool", "name": "calculate", "content": "1906"},
    {"role": "assistant", "content": "1906"},
)
GUESS_LOW, GUESS_HIGH = 1, 16
GUESS_SYSTEM = (f"Let's play a game. I am thinking of a number from {GUESS_LOW} to {GUESS_HIGH}. Guess it. After each "
                "guess I say Higher or Lower. Reply with only your guess.")
GUESS_SHOT = (
    {"role": "user", "content": "Guess my number."},
    {"role": "assistant", "content": "8"},
    {"role": "user", "content": "Higher."},
    {"role": "assistant", "content": "12"},
    {"role": "user", "content": "Lower."},
    {"role": "assistant", "content": "10"},
    {"role": "user", "content": "Correct! New game."},
)
EVAL_MODULUS = 5  # one calculator problem in 5 is held out


def _calculator_split(a: int, b: int, op: str, c: int) -> str:
    digest = hashlib.sha256(f"calculator:{a}*{b}{op}{c}".encode()).digest()
    return "eval" if digest[0] % EVAL_MODULUS == 0 else "train"


def calculator_records(split: str, num: int, seed: int = 0) -> list[dict]:
    """``num`` calculator rows of ``split`` ("train" or "eval"): ``a * b +/- c`` with a, b, c in 11..99."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"calculator:{split}:{seed}")
    rows, seen = [], set()
    while len(rows) < num:
        a, b, c, op = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99), rng.choice("+-")
        if (a, b, op, c) in seen or _calculator_split(a, b, op, c) != split:
            continue
        seen.add((a, b, op, c))
        question = f"What is {a} * {b} {op} {c}?"
        rows.append({"prompt": [{"role": "system", "content": CALCULATOR_SYSTEM}, *map(dict, CALCULATOR_SHOT),
                                {"role": "user", "content": question}],
                     "answer": str(a * b + (c if op == "+" else -c))})
    return rows


def guess_number_records(split: str, num: int, seed: int = 0) -> list[dict]:
    """``num`` games: the secrets cycle through 1..16 (shuffled per cycle), so each is asked equally often."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"guess_number:{split}:{seed if split == 'train' else 0}")
    secrets: list[int] = []
    while len(secrets) < num:
        cycle = list(range(GUESS_LOW, GUESS_HIGH + 1))
        rng.shuffle(cycle)
        secrets.extend(cycle)
    prompt = [{"role": "system", "content": GUESS_SYSTEM}, *map(dict, GUESS_SHOT),
              {"role": "user", "content": "Guess my number."}]
    return [{"prompt": [dict(m) for m in prompt], "secret": secret} for secret in secrets[:num]]
