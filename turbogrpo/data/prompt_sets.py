"""A [data] section's prompt sets: its training and held-out rows (``kinds``) as tokenized prompts
(``prompts.build_prompts``) with the section's options, each bounded by the completion length beside it and
the model's positions; and the check that a step can be filled from them. ``data`` is the [data] config
section (``config.DataConfig``).
"""

from __future__ import annotations

from turbogrpo.config_error import ConfigError
from turbogrpo.data.kinds import eval_rows, train_rows
from turbogrpo.data.prompts import PromptExample, PromptSet, build_prompts

_CHAT_TEMPLATE = {"auto": None, "always": True, "never": False}


def _prompts(rows: list[dict], tokenizer, data, max_new_tokens: int, max_positions: int | None,
             source_key: str, limit_key: str = "rollout.max_new_tokens") -> PromptSet:
    """``rows`` as a PromptSet; a row's ValueError ("row 3: ...") names the data file (``source_key``'s
    value) it is in, so training and held-out rows are told apart. ``limit_key``: the setting that gave
    ``max_new_tokens`` (env.max_conversation_tokens for conversations), named when it leaves no room."""
    try:
        return _build_prompts(rows, tokenizer, data, max_new_tokens, max_positions, limit_key)
    except ValueError as err:
        path = getattr(data, source_key.partition(".")[2])
        if not path or not str(err).startswith("row "):
            raise
        raise ValueError(f"{source_key} {path!r} {err}") from None


def _build_prompts(rows: list[dict], tokenizer, data, max_new_tokens: int, max_positions: int | None,
                   limit_key: str) -> PromptSet:
    if max_positions is not None and max_new_tokens >= max_positions:
        raise ConfigError(f"config key '{limit_key}': {max_new_tokens} leaves no room for "
                          f"a prompt within the model's {max_positions} positions (max_position_embeddings); "
                          "lower it")
    return build_prompts(rows, tokenizer, prompt_column=data.prompt_column, max_prompt_tokens=data.max_prompt_tokens,
                         on_too_long=data.on_overlong, on_empty=data.on_empty,
                         chat_template=_CHAT_TEMPLATE[data.chat_template], system_prompt=data.system_prompt or None,
                         max_positions=max_positions, max_new_tokens=max_new_tokens)


def load_train_prompts(data, tokenizer, *, seed: int, max_new_tokens: int,
                       max_positions: int | None = None, limit_key: str = "rollout.max_new_tokens") -> PromptSet:
    """The training PromptSet of the [data] section (examples plus skipped counts; a built-in task's
    problems drawn with ``seed``, train.seed); prompts too long for ``max_positions`` with
    ``max_new_tokens`` (the setting ``limit_key``) are skipped or refused as data.on_overlong says."""
    return _prompts(train_rows(data, seed), tokenizer, data, max_new_tokens, max_positions, "data.path", limit_key)


def load_eval_prompts(data, tokenizer, *, max_new_tokens: int,
                      max_positions: int | None = None, limit_key: str = "rollout.max_new_tokens"
                      ) -> list[PromptExample]:
    """Held-out prompts: a built-in task's eval split, or ``data.eval_path`` rows ([] if none)."""
    rows = eval_rows(data)
    if rows is None:
        return []
    return _prompts(rows[:data.num_eval_problems], tokenizer, data, max_new_tokens, max_positions,
                    "data.eval_path", limit_key).examples


def check_prompt_count(data, prompts_per_step: int, prompt_set: PromptSet) -> None:
    """ValueError naming the [data] section's source and train.prompts_per_step when a step cannot be
    filled with distinct usable prompts (``prompt_set``: its skipped rows counted)."""
    source = f"data.path {data.path!r}" if data.path else f"the built-in {data.kind} task"
    usable = len(prompt_set.examples)
    skipped = (f" ({prompt_set.num_too_long} skipped as too long for data.max_prompt_tokens="
               f"{data.max_prompt_tokens} or the model, {prompt_set.num_empty} as empty)"
               if prompt_set.num_too_long or prompt_set.num_empty else "")
    if not usable:
        raise ValueError(f"{source} has no usable prompts{skipped}; raise data.max_prompt_tokens, shorten the "
                         "prompts, or check data.prompt_column")
    if prompts_per_step > usable:
        raise ValueError(f"config key 'train.prompts_per_step': {prompts_per_step} is more than the "
                         f"{usable} usable prompts of {source}{skipped}; use at most {usable} or add rows")
