"""Reading the Markdown of README.md and docs/: fenced code blocks (with the line each starts on and the
marker that keeps one from running) and relative links (with the line each sits on)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`\s]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
HTML_ID = re.compile(r"""<a\s+id=["'](?P<id>[^"']+)["']""")


def doc_files() -> list[Path]:
    """README.md, then every page under docs/, in a fixed order (shell blocks share one run folder)."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    file: str          # relative to the repository
    line: int          # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason of a preceding <!-- not run: ... --> marker

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.code.splitlines() if line.strip()), "")


def code_blocks(path: Path, root: Path = REPO) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, start = len(opening["indent"]), i
        i += 1
        body = []
        while i < len(lines) and not (FENCE.match(lines[i]) and FENCE.match(lines[i])["info"] == ""):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path.relative_to(root)}:{start + 1}: code block never closed")
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(previous)
        blocks.append(Block(str(path.relative_to(root)), start + 1, opening["info"], "\n".join(body) + "\n",
                            marker["reason"] if marker else None))
        i += 1
    return blocks


def slug(heading: str) -> str:
    """The anchor mkdocs' toc (and, for these headings, GitHub) gives a heading."""
    text = re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", "", heading)      # inline formatting
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)                  # links: their text
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    found, in_code = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        heading = HEADING.match(line)
        if heading:
            found.add(slug(heading["text"]))
        found.update(m["id"] for m in HTML_ID.finditer(line))
    return found


def dead_links(path: Path, root: Path = REPO) -> list[str]:
    """Each relative link of a page whose file or anchor does not exist, as 'file:line: target (why)'."""
    problems, in_code = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match["target"]
            if re.match(r"^[a-z]+:", target):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not linked.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where} (no heading or anchor {anchor!r} in {linked.name})")
    return problems
