"""docs/design/how-it-works.md's code layout names the package as it is: every folder and file it lists exists
(a move without the page fails here), and every folder of the package is listed."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "design" / "how-it-works.md"


def layout_block() -> str:
    text = PAGE.read_text()
    start = text.index("## Code layout")
    return text[text.index("```text", start) + len("```text"):text.index("```", text.index("```text", start) + 7)]


def listed_entries() -> list[str]:
    """The names at the start of the block's lines (``  prefix/``, ``  batch.py``) under ``turbogrpo/``."""
    return re.findall(r"^  ([A-Za-z_]+(?:/|\.py))\s", layout_block(), flags=re.M)


def named_files() -> set[str]:
    """Files named inside the descriptions (``loop.py``, ``decode.py``)."""
    return set(re.findall(r"\b([a-z_]+\.py)\b", layout_block()))


def test_every_listed_entry_exists_and_every_folder_is_listed():
    package = REPO / "turbogrpo"
    entries = listed_entries()
    assert len(entries) > 15
    missing = [e for e in entries if not (package / e.rstrip("/")).exists()]
    assert missing == []
    folders = {p.name + "/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - set(entries) == set()


def test_every_file_the_descriptions_name_exists_in_the_package():
    files = {p.name for p in (REPO / "turbogrpo").rglob("*.py")} | {p.name for p in (REPO / "bench").glob("*.py")}
    assert sorted(named_files() - files) == []
