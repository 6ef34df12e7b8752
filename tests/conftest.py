"""The whole suite runs away from the user's files.

Every test starts in an empty working folder of its own, and the session's HOME, XDG cache and turbogrpo
cache are temporary folders, so a test never reads or writes the checkout's ``runs/`` (``make demo``
leaves ``runs/demo`` there), the user's ``~/.cache/turbogrpo`` or anything else in their home. Tests that
need the checkout's files name them by absolute path (``REPO / "configs" / ...``).

``pytest_sessionfinish`` checks the promise: the checkout's ``runs/`` and the real home's turbogrpo cache
hold the same entries after the suite as before it, else the session fails and names what changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REAL_HOME = Path.home()
# Variables that point a library at a folder under the home (the user's caches and configs).
ISOLATED_ENV = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TURBOGRPO_CACHE", "HF_HOME", "MPLCONFIGDIR")


def user_folders() -> dict[str, list[str]]:
    """What the user's own folders hold now: the checkout's runs/ and the real home's turbogrpo cache."""
    watched = {"runs": REPO / "runs", "cache": REAL_HOME / ".cache" / "turbogrpo"}
    return {name: sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.is_dir() else []
            for name, folder in watched.items()}


def pytest_configure(config: pytest.Config) -> None:
    # Set before any test module imports a library that reads them (matplotlib, huggingface_hub, turbogrpo).
    config._user_folders_before = user_folders()
    home = Path(tempfile.mkdtemp(prefix="turbogrpo-tests-home-"))
    config._isolated_home = home
    values = {"HOME": home, "XDG_CACHE_HOME": home / ".cache", "XDG_CONFIG_HOME": home / ".config",
              "TURBOGRPO_CACHE": home / ".cache" / "turbogrpo", "HF_HOME": home / ".cache" / "huggingface",
              "MPLCONFIGDIR": home / ".config" / "matplotlib"}
    config._saved_env = {name: os.environ.get(name) for name in ISOLATED_ENV}
    for name in ISOLATED_ENV:
        os.environ[name] = str(values[name])


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "_isolated_home", None) is not None:
        shutil.rmtree(config._isolated_home, ignore_errors=True)
    for name, value in getattr(config, "_saved_env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def own_working_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test runs in an empty folder of its own (relative paths such as ``runs/demo`` land there)."""
    folder = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(folder)
    return folder


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = getattr(session.config, "_user_folders_before", None)
    if before is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    after = user_folders()
    changed = [name for name in before if before[name] != after[name]]
    if changed:
        problems = "; ".join(f"{name}: {sorted(set(after[name]) ^ set(before[name]))[:5]}" for name in changed)
        session.config.get_terminal_writer().line(f"the suite wrote to the user's folders ({problems})", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` as tests/scheduling.py refines it (files sharing a session engine together, the longest
    files first); any other ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.scheduling import SharedUnitsLongestFirst, refines_this_xdist
    # pytest-xdist is not pinned: where its scheduler's internals moved, its own loadfile runs (only slower).
    return SharedUnitsLongestFirst(config, log) if refines_this_xdist() else None
