"""The data kinds (``data.kind``): where each reads its training and held-out rows.

A kind is one entry in one of two registries: ``BUILTIN_TASKS`` for a generated task (``records(split, num,
seed) -> rows``: its training and held-out splits), ``FILE_KINDS`` for rows read from a file (``reader(data,
path) -> rows``: data.path's for training, data.eval_path's held out). A held-out file beside a built-in task
is read as plain rows. ``data`` is the [data] config section (``config.DataConfig``).
"""

from __future__ import annotations

from turbogrpo.data.arithmetic import demo_chat_records, demo_records
from turbogrpo.data.gsm8k import gsm8k_records
from turbogrpo.data.longform import longform_records
from turbogrpo.data.small_arithmetic import small_arithmetic_records
from turbogrpo.data.sources import read_records, source_kind
from turbogrpo.data.tool_tasks import calculator_records, guess_number_records

# The built-in tasks' generators, by data.kind: records(split, num, seed) -> rows.
BUILTIN_TASKS = {"arithmetic": demo_records, "arithmetic_chat": demo_chat_records, "longform": longform_records,
                 "small_arithmetic": small_arithmetic_records, "calculator": calculator_records,
                 "guess_number": guess_number_records}


def builtin_rows(data, split: str, seed: int) -> list[dict]:
    num = data.num_train_problems if split == "train" else data.num_eval_problems
    return BUILTIN_TASKS[data.kind](split, num, seed=seed)


def file_rows(data, path: str) -> list[dict]:
    """The rows of a jsonl or parquet file, or of a folder saved by ``datasets`` (its data.split)."""
    split = data.split if source_kind(path) == "datasets" else None
    return read_records(path, split=split)


# The kinds that read their rows from a file, by data.kind: reader(data, path) -> rows.
FILE_KINDS = {
    "rows": file_rows,
    "gsm8k": lambda data, path: gsm8k_records(path),
}


def train_rows(data, seed: int) -> list[dict]:
    """The training rows of ``data.kind``: a built-in task's generated from ``seed``, else data.path's."""
    if data.kind in BUILTIN_TASKS:
        return builtin_rows(data, "train", seed)
    return FILE_KINDS[data.kind](data, data.path)


def eval_rows(data) -> list[dict] | None:
    """Held-out rows: ``data.eval_path``'s (read as its kind reads a file; plain rows beside a built-in task),
    else a built-in task's eval split (fixed, so every run is scored on the same problems); None where there
    is no held-out source."""
    if data.eval_path:
        return FILE_KINDS.get(data.kind, file_rows)(data, data.eval_path)
    if data.kind in BUILTIN_TASKS:
        return builtin_rows(data, "eval", seed=0)
    return None
