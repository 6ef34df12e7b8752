"""Reading prompt rows from local files: jsonl, parquet, or a folder saved by ``datasets``.

Every reader returns plain rows (``list[dict]``); which reader runs is decided by the path alone,
through the ``SOURCE_READERS`` table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _read_jsonl(path: Path, split: str | None) -> list[Row]:
    rows = []
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # -sig: drop a byte-order mark
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} line {line_number}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at "
                                 f"column {err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {line_number}: not valid JSON ({err})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {line_number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path, split: str | None) -> list[Row]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


DEFAULT_SPLIT = "train"
"""The split read from a saved DatasetDict when none is named (data.split's default)."""


def _read_saved_dataset(path: Path, split: str | None) -> list[Row]:
    """A ``Dataset`` or ``DatasetDict`` written by ``save_to_disk``. A DatasetDict is read at ``split``
    (default "train"); a single Dataset, saved without splits, is its own one split: read whole for no
    split or the default "train" (data.split's default, which a user never chose), refused for any other
    split, which it cannot hold."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        split = split or DEFAULT_SPLIT
        if not dataset:
            raise ValueError(f"{path} is a DatasetDict with no splits; save one with splits (e.g. "
                             "DatasetDict({'train': rows}).save_to_disk(folder))")
        if split not in dataset:
            raise ValueError(f"{path} holds splits {sorted(dataset)}; split {split!r} is not one of them: set "
                             f"data.split to one of {sorted(dataset)}")
        dataset = dataset[split]
    elif split not in (None, DEFAULT_SPLIT):
        raise ValueError(f"{path} holds a single dataset saved without splits ({dataset.num_rows} rows, columns "
                         f"{dataset.column_names}), so split {split!r} cannot be read from it; set data.split to "
                         f"{DEFAULT_SPLIT!r} to read all its rows, or point the path at a folder saved from a "
                         f"DatasetDict that has a {split!r} split")
    return dataset.to_list()


SOURCE_READERS: dict[str, Callable[[Path, str | None], list[Row]]] = {
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "datasets": _read_saved_dataset,
}


def source_kind(path: str | os.PathLike) -> str:
    """Which ``SOURCE_READERS`` entry reads ``path``: by suffix for files, "datasets" for a folder
    written by ``save_to_disk``."""
    path = Path(path)
    if path.is_dir():
        if any((path / marker).is_file() for marker in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return "datasets"
        raise ValueError(f"{path} is a folder but not one written by datasets' save_to_disk "
                         "(no dataset_info.json / dataset_dict.json)")
    if not path.is_file():
        raise ValueError(f"data path {path} does not exist")
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in ("jsonl", "parquet"):
        raise ValueError(f"data file {path} has suffix {path.suffix!r}; supported are .jsonl, .parquet, "
                         "or a folder saved with datasets' save_to_disk")
    return suffix


def read_records(path: str | os.PathLike, *, split: str | None = None) -> list[Row]:
    """All rows of a local jsonl / parquet file or saved ``datasets`` folder, as dicts (ValueError naming
    the file when it holds none)."""
    path = Path(path).expanduser()
    kind = source_kind(path)
    if split is not None and kind != "datasets":
        raise ValueError(f"split={split!r} applies only to saved datasets folders, not to {kind} file {path}")
    rows = SOURCE_READERS[kind](path, split)
    if not rows:
        where = f"folder {path}" + (f" (split {split!r})" if split else "") if kind == "datasets" else f"file {path}"
        raise ValueError(f"data {where} holds no rows; give data with at least one row")
    return rows
