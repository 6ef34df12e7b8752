"""Turning rows into tokenized prompts: chat template, length limit, empty prompts.

The prompt column holds either a string (the user's message) or a list of chat messages
(``[{"role": ..., "content": ...}, ...]``). A tokenizer with a chat template formats either with
``add_generation_prompt=True``; without a template a string is used as is. Every other column is
passed through untouched, for reward functions (e.g. the gold answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ON_TOO_LONG = ("skip", "error")
ON_EMPTY = ("error", "skip")


@dataclass(frozen=True)
class PromptExample:
    """One prompt, ready for rollout.

    text: the prompt as given to the tokenizer (chat template applied when used).
    token_ids: LongTensor [P] on the CPU.
    columns: the row's other columns (everything but the prompt column), for rewards.
    index: the row's position in the source, for logs.
    messages: the prompt as chat messages (system prompt first) where the chat template formats it, else
        None; multi-turn rollouts render them again, with the environment's tools and first observation.
    """

    text: str
    token_ids: torch.Tensor
    columns: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True)
class PromptSet:
    """The usable prompts of a source and what was left out (counts, for the run log)."""

    examples: list[PromptExample]
    num_too_long: int
    num_empty: int


def uses_chat_template(tokenizer, chat_template: bool | None) -> bool:
    """Whether prompts get the chat template: ``None`` means "if the tokenizer has one"."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError("data.chat_template = \"always\" but the tokenizer has no chat template; set the config "
                         "key data.chat_template = \"auto\" (use it when present) or \"never\" (build_prompts: "
                         "chat_template=None or False)")
    return has_template if chat_template is None else chat_template


def format_prompt(prompt: str | list[dict[str, str]], tokenizer, *, use_template: bool,
                  system_prompt: str | None = None) -> str:
    """The prompt text the model sees."""
    if isinstance(prompt, str) and not use_template:
        return prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"
    if not use_template:
        raise ValueError("a prompt given as chat messages needs the tokenizer's chat template, which is off "
                         "or missing; set the config key data.chat_template = \"auto\" with a tokenizer that "
                         "has one, or give prompts as plain strings (build_prompts: chat_template=None)")
    return tokenizer.apply_chat_template(prompt_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True)


def prompt_messages(prompt: str | list[dict[str, str]], system_prompt: str | None = None) -> list[dict[str, str]]:
    """The prompt as chat messages: a string is the user's message; the system prompt goes first."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _is_empty(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return not prompt.strip()
    return not prompt or all(not str(m.get("content", "")).strip() for m in prompt)


def _check_prompt_type(prompt: Any, index: int, prompt_column: str) -> None:
    is_messages = isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)
    if not (isinstance(prompt, str) or is_messages or prompt is None):
        raise ValueError(f"row {index}: prompt column {prompt_column!r} must be a string or a list of "
                         f"chat messages, got {type(prompt).__name__}")
    for number, message in enumerate(prompt if is_messages else ()):
        problem = _message_problem(message)
        if problem:
            raise ValueError(f"row {index}: message {number} of prompt column {prompt_column!r} {problem}; each "
                             "message is {\"role\": \"system\" | \"user\" | \"assistant\", \"content\": text}")


def _message_problem(message: dict) -> str | None:
    """What is wrong with one chat message (None: a role and text content)."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        return "has no role" if role is None else f"has role {role!r}, not a non-empty string"
    if not isinstance(content, str):
        return "has no content" if content is None else f"has {type(content).__name__} content, not a string"
    return None


def _formatted(prompt: Any, tokenizer, index: int, *, use_template: bool, system_prompt: str | None) -> str:
    """``format_prompt``, with a chat template's own refusal (roles that must alternate, no system
    role ...) turned into a one-line ValueError naming the row."""
    from jinja2 import TemplateError
    try:
        return format_prompt(prompt, tokenizer, use_template=use_template, system_prompt=system_prompt)
    except TemplateError as err:
        plain = (", or set the config key data.chat_template = \"never\" to use the text as it is"
                 if isinstance(prompt, str) else "")
        raise ValueError(f"row {index}: the tokenizer's chat template refused the prompt ({err}); fix the row's "
                         f"messages (and data.system_prompt) to what the template accepts{plain}") from None


def _too_long(num_tokens: int, max_prompt_tokens: int | None, max_positions: int | None,
              max_new_tokens: int) -> str | None:
    """Why a prompt of ``num_tokens`` is too long, or None."""
    if max_prompt_tokens is not None and num_tokens > max_prompt_tokens:
        return f"more than max_prompt_tokens={max_prompt_tokens}"
    if max_positions is not None and num_tokens + max_new_tokens > max_positions:
        return (f"which with max_new_tokens={max_new_tokens} is more than the model's {max_positions} positions "
                "(max_position_embeddings)")
    return None


def build_prompts(rows: Sequence[dict[str, Any]], tokenizer, *, prompt_column: str = "prompt",
                  max_prompt_tokens: int | None = None, on_too_long: str = "skip", on_empty: str = "error",
                  chat_template: bool | None = None, system_prompt: str | None = None,
                  max_positions: int | None = None, max_new_tokens: int = 0) -> PromptSet:
    """Tokenized prompts for ``rows``.

    max_prompt_tokens: prompts with more tokens are skipped and counted (``on_too_long="skip"``) or
        raise ValueError (``"error"``). None: no limit.
    max_positions: the model's position limit; a prompt that leaves fewer than ``max_new_tokens``
        positions for its completion is too long by the same rule. None: no limit.
    on_empty: a missing, None or blank prompt raises (``"error"``) or is skipped and counted.
    chat_template: None uses the tokenizer's template when it has one; True requires it; False
        never uses it.
    """
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
    if on_empty not in ON_EMPTY:
        raise ValueError(f"on_empty must be one of {ON_EMPTY}, got {on_empty!r}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
    if rows and not any(prompt_column in row for row in rows):
        raise ValueError(f"prompt column {prompt_column!r} is in no row; the columns are {sorted(rows[0])}")
    use_template = uses_chat_template(tokenizer, chat_template)
    examples, num_too_long, num_empty = [], 0, 0
    for index, row in enumerate(rows):
        prompt = row.get(prompt_column)
        _check_prompt_type(prompt, index, prompt_column)
        if prompt is None or _is_empty(prompt):
            if on_empty == "error":
                raise ValueError(f"row {index}: prompt column {prompt_column!r} is empty; to skip such rows set "
                                 "the config key data.on_empty = \"skip\" (build_prompts: on_empty='skip')")
            num_empty += 1
            continue
        text = _formatted(prompt, tokenizer, index, use_template=use_template, system_prompt=system_prompt)
        # A chat template writes its own special tokens (e.g. BOS); plain text gets the tokenizer's.
        token_ids = tokenizer(text, add_special_tokens=not use_template)["input_ids"]
        too_long = _too_long(len(token_ids), max_prompt_tokens, max_positions, max_new_tokens)
        if too_long is not None:
            if on_too_long == "error":
                raise ValueError(f"row {index}: prompt has {len(token_ids)} tokens, {too_long}; to skip such rows set "
                                 "the config key data.on_overlong = \"skip\" (build_prompts: on_too_long='skip')")
            num_too_long += 1
            continue
        columns = {k: v for k, v in row.items() if k != prompt_column}
        messages = tuple(prompt_messages(prompt, system_prompt)) if use_template else None
        examples.append(PromptExample(text, torch.tensor(token_ids, dtype=torch.long), columns, index, messages))
    return PromptSet(examples, num_too_long, num_empty)
