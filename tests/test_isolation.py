"""The suite stays out of the user's files (tests/conftest.py): the checkout's runs/, the cache, the home."""

import os
from pathlib import Path

from turbogrpo.cache import cache_root
from turbogrpo.config import load_config

from tests.conftest import REAL_HOME, REPO


def test_each_test_starts_in_an_empty_folder_outside_the_checkout():
    here = Path.cwd().resolve()
    assert list(here.iterdir()) == []
    assert REPO not in here.parents and here != REPO


def test_relative_run_folders_land_in_the_test_folder():
    """`make demo` leaves runs/demo in the checkout; a test's default output_dir must not meet it."""
    output_dir = Path(load_config(None, []).train.output_dir).resolve()
    assert Path.cwd().resolve() in output_dir.parents
    assert not output_dir.exists()


def test_home_and_caches_are_temporary():
    assert Path.home() != REAL_HOME and Path(os.environ["HOME"]) == Path.home()
    for folder in (cache_root(), Path(os.environ["HF_HOME"]), Path(os.environ["MPLCONFIGDIR"])):
        assert REAL_HOME not in folder.parents and Path.home() in folder.parents
