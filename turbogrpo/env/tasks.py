"""Built-in environments: a calculator tool, a guess-the-number game, and a retry game for the demo model.

Each is an environment in ``turbogrpo.env.environment``'s sense (TRL's interface, plus ``reply`` for turns
that make no tool call), made by calling its class with no arguments (``turbogrpo.env.tasks:Calculator``
as an ``[env] factory``). Their rewards are 1.0 for a solved episode and 0.0 otherwise.

``SMOLLM2_TOOLS_CHAT_TEMPLATE`` is SmolLM2-Instruct's ChatML with tool support (its own template has none):
tools listed in the system message, calls in the pythonic format, tool replies as ``tool`` turns.
``DEMO_CHAT_TEMPLATE`` is a chat template for the shipped demo model (which has none): the demo prompt
format (``Question: ...\\nAnswer:``) with the model's end-of-sequence token closing its turns, tools listed
up front and Hermes ``<tool_call>`` blocks.
"""

from __future__ import annotations

import ast
import operator
import re

_ANSWER = re.compile(r"####\s*(-?\d+)")
_LAST_INTEGER = re.compile(r"-?\d+")


def final_answer(text: str) -> int | None:
    """The integer after the last ``####`` in ``text``, or None."""
    found = _ANSWER.findall(text)
    return int(found[-1]) if found else None


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (thousands separators dropped), or None."""
    found = _LAST_INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // %, unary minus and parentheses (no names,
    no calls, no powers: a model's expression cannot run code or take unbounded time)."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported expression element {type(node).__name__}; use numbers and + - * / // %")

    if len(expression) > 200:
        raise ValueError("expression is longer than 200 characters")
    return value(ast.parse(expression.strip(), mode="eval").body)


class Calculator:
    """Arithmetic with a calculator tool: the row's ``answer`` is the gold number; the episode ends on the
    first turn without a tool call, whose last integer (``#### N`` or a bare number) is the answer."""

    def __init__(self):
        self.answer: int | None = None
        self.given: int | None = None

    def reset(self, answer: int | str | None = None, **row) -> None:
        self.answer = None if answer is None else int(answer)
        self.given = None
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers joined by +, -, *, / and parentheses, for example "(12 + 7) * 3".
        """
        result = evaluate_arithmetic(expression)
        return str(int(result) if float(result).is_integer() else round(result, 6))

    def reply(self, message: str) -> None:
        self.given = last_integer(message)
        return None

    def get_reward(self) -> float:
        return float(self.answer is not None and self.given == self.answer)


class GuessNumber:
    """Guess a secret number in [low, high] (the row's ``secret``); each guess (the last integer of a turn)
    is answered "higher", "lower" or ends the episode when right."""

    def __init__(self, low: int = 1, high: int = 16):
        self.low, self.high = low, high
        self.secret: int | None = None
        self.solved = False
        self.guesses: list[int] = []

    def reset(self, secret: int | str | None = None, **row) -> None:
        if secret is None or not self.low <= int(secret) <= self.high:
            raise ValueError(f"GuessNumber needs a row with a 'secret' in [{self.low}, {self.high}], got {secret!r}")
        self.secret, self.solved, self.guesses = int(secret), False, []
        return None

    def reply(self, message: str) -> str | None:
        guess = last_integer(message)
        if guess is None:
            return f"Please answer with a number from {self.low} to {self.high}."
        self.guesses.append(guess)
        if guess == self.secret:
            self.solved = True
            return None
        return "Higher." if guess < self.secret else "Lower."

    def get_reward(self) -> float:
        return float(self.solved)


class RetryArithmetic:
    """The demo task with second chances: a wrong ``#### N`` is answered "Wrong. Try again."; the episode
    ends when the answer is right (or at ``[env] max_turns``)."""

    def __init__(self):
        self.answer: int | None = None
        self.solved = False

    def reset(self, answer: int | str, **row) -> None:
        self.answer, self.solved = int(answer), False
        return None

    def reply(self, message: str) -> str | None:
        if final_answer(message) == self.answer:
            self.solved = True
            return None
        return "Wrong. Try again."

    def get_reward(self) -> float:
        return float(self.solved)


DEMO_CHAT_TEMPLATE = (
    "{%- if tools -%}Tools:{%- for tool in tools %} {{ tool.function.name if tool.function is defined else tool.name }}"
    "{%- endfor %}{{ '\n' }}{% endif -%}"  # an expression: trim_blocks would drop a literal newline here
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{{ '\n' if not loop.first }}{{ message.content }}\nAnswer:"
    "{%- elif message.role == 'assistant' -%}{{ message.content }}"
    "{%- for call in message.tool_calls or [] -%}<tool_call>{{ call.function | tojson }}</tool_call>{%- endfor -%}"
    "<|endoftext|>"
    "{%- elif message.role == 'tool' -%}{{ '\nResult: ' ~ message.content ~ '\nAnswer:' }}"
    "{%- endif -%}{%- endfor -%}")
"""Chat template for the shipped demo model (its tokenizer has none); the user's first message is the demo
prompt up to the question (``turbogrpo.data.arithmetic``), ``Answer:`` opens every model turn."""

SMOLLM2_TOOLS_CHAT_TEMPLATE = (
    "{%- set system = messages[0].content if messages[0].role == 'system' else "
    "'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{{ '<|im_start|>system\\n' ~ system }}"
    "{%- if tools -%}{{ '\\n\\nTools:' }}"
    "{%- for tool in tools -%}{%- set f = tool.function if tool.function is defined else tool -%}"
    "{{ '\\n- ' ~ f.name ~ '(' ~ (f.parameters.properties | list | join(', ')) ~ '): ' ~ f.description }}"
    "{%- endfor -%}{{ '\\nTo use a tool, write <tool_call>name(\"argument\")</tool_call>' }}"
    "{%- endif -%}{{ '<|im_end|>\\n' }}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{{ '<|im_start|>user\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' ~ message.content }}"
    "{%- for call in message.tool_calls or [] -%}{{ '<tool_call>' ~ call.function.name ~ '(' }}{%- for value in call.function.arguments.values() -%}{{ (', ' if not loop.first) ~ (value | tojson) }}{%- endfor -%}{{ ')</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' -%}{{ '<|im_start|>tool\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
"""SmolLM2-Instruct's ChatML template (its own has no tools) with tools: their signatures and descriptions in the
system message, calls in the pythonic format inside Hermes tags (``tool_calls.parse_pythonic``: the 135M model
writes ``calculate("37 * 52 - 18")`` reliably, JSON calls it garbles), and tool results as ``tool`` turns."""

CHAT_TEMPLATES = {"demo": DEMO_CHAT_TEMPLATE, "smollm2_tools": SMOLLM2_TOOLS_CHAT_TEMPLATE}
"""Built-in chat templates by the name an ``[env] chat_template`` setting may give instead of Jinja text."""
