"""The docs site builds with `mkdocs build --strict`, and no page (README.md included) links to a file or
anchor that does not exist; a dead link fails naming its file (mkdocs) and line (our check)."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.docs.markdown import REPO, dead_links, doc_files

MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict"]


def mkdocs_build(project, site) -> subprocess.CompletedProcess:
    return subprocess.run([*MKDOCS, "-f", str(project / "mkdocs.yml"), "-d", str(site)], capture_output=True,
                          text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)


def test_site_builds_strictly(tmp_path):
    built = mkdocs_build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()


def test_no_dead_links():
    problems = [p for path in doc_files() for p in dead_links(path)]
    assert problems == [], "\n".join(problems)


@pytest.fixture
def docs_copy(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(REPO / "docs", project / "docs")
    shutil.copy(REPO / "mkdocs.yml", project / "mkdocs.yml")
    page = project / "docs" / "guide" / "rewards.md"
    page.write_text(page.read_text() + "\nSee [the old page](no-such-page.md) and [a part](data.md#no-such-part).\n")
    return project, page


def test_a_dead_link_fails_the_build_naming_the_file(docs_copy, tmp_path):
    project, _ = docs_copy
    built = mkdocs_build(project, tmp_path / "site")
    assert built.returncode != 0
    assert "guide/rewards.md" in built.stderr and "no-such-page.md" in built.stderr


def test_a_dead_link_is_reported_with_file_and_line(docs_copy):
    project, page = docs_copy
    line = len(page.read_text().splitlines())
    assert dead_links(page, root=project) == [
        f"docs/guide/rewards.md:{line}: no-such-page.md (no such file)",
        f"docs/guide/rewards.md:{line}: data.md#no-such-part (no heading or anchor 'no-such-part' in data.md)"]
