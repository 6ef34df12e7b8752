"""GSM8K-format data: ``{"question": ..., "answer": "<worked solution>\\n#### <number>"}`` per line.

The gold answer is the text after the last ``####`` with thousands separators removed
("#### 70,000" -> "70000"). The same ``#### <answer>`` convention is how completions state their
final answer, so rewards use ``extract_hash_answer`` on completions too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from turbogrpo.data.sources import read_records

# Thousands separators inside numbers ("70,000"), not commas between list items ("1, 2").
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def extract_hash_answer(text: str) -> str | None:
    """The final answer written after the last ``####`` (to the end of that line), or None if absent.

    >>> extract_hash_answer("She makes 9 * 2 = 18\\n#### 18")
    '18'
    """
    head, marker, tail = text.rpartition("####")
    if not marker:
        return None
    answer = _THOUSANDS_COMMA.sub("", tail.strip().split("\n", 1)[0].strip())
    return answer or None


def gsm8k_records(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a GSM8K jsonl file with an added ``gold`` column (the final answer, e.g. ``"18"``).

    ``question`` is the prompt; ``answer`` keeps the full worked solution.
    """
    records = read_records(path)
    for i, record in enumerate(records):
        for column in ("question", "answer"):
            if not isinstance(record.get(column), str):
                raise ValueError(f"{Path(path)} row {i}: GSM8K rows need a string {column!r} column")
        gold = extract_hash_answer(record["answer"])
        if gold is None:
            raise ValueError(f"{Path(path)} row {i}: answer has no final '#### <number>' line")
        record["gold"] = gold
    return records
