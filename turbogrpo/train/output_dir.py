"""A run's output folder: one run at a time, never mixed with or written over another run.

* An exclusive ``flock`` on ``<output_dir>/.lock`` makes a second run into the same folder fail at
  once. The kernel drops the lock when the process ends, however it ends (SIGKILL included), so a
  stale lock never blocks a later run.
* A fresh run refuses a folder that holds files, unless ``--overwrite``, which moves them aside into
  ``<output_dir>.previous-<time>/``: nothing a user has is deleted.
* ``--resume`` compares the stored ``config.json`` with the new config and refuses a change in any
  key that changes what is trained, naming the keys.
* A run that finished writes ``complete.json``; resuming it again does nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from turbogrpo.config import Config
from turbogrpo.train.distributed import DistInfo, all_reduce_max_int

LOCK_FILE = ".lock"
COMPLETE_FILE = "complete.json"
CONFIG_FILE = "config.json"

# Keys a resumed run may change: they say how long to run, where and how to log, evaluate or compute,
# not what is trained (micro-batches sum exactly to the step's batch, and every backend is exact).
# train.num_steps is here so a finished run can be extended (the lr schedule then follows the new length).
RESUMABLE_KEYS = (
    "train.num_steps", "train.output_dir", "train.checkpoint_every", "train.keep_checkpoints", "train.eval_every",
    "train.save_final_model", "train.num_threads", "train.max_nonfinite_steps", "train.accuracy_reward",
    "train.reward_failure_limit", "train.micro_batch_tokens", "model.device", "model.gradient_checkpointing",
    "model.logprob_backend", "data.eval_path", "data.num_eval_problems", "data.num_eval_samples", "log",
    "distributed.backend",
)


class OutputDir:
    """The claimed output folder; :meth:`release` drops the lock (rank 0 holds it, other ranks nothing)."""

    def __init__(self, path: Path, lock: IO[str] | None):
        self.path = path
        self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None


def claim_output_dir(config: Config, dist: DistInfo, *, resume: bool, overwrite: bool) -> OutputDir:
    """Create and lock ``train.output_dir`` and check that this run may write there (ValueError if not).

    Rank 0 does the work; every rank learns whether it failed, so none is left waiting in a collective.
    """
    path = Path(config.train.output_dir)
    lock, error = None, None
    if dist.is_main:
        try:
            _make_folder(path)
            lock = _take_lock(path)
            if resume:
                _check_same_training(path, config)
            else:
                _fresh_folder(path, overwrite)
        except ValueError as err:
            if lock is not None:
                lock.close()
            error = err
    if all_reduce_max_int(int(error is not None), dist, dist.device):
        raise error or ValueError(f"rank 0 refused train.output_dir {path}; see its message")
    return OutputDir(path, lock)


def mark_complete(path: Path, step: int) -> None:
    """Record that the run trained to ``step`` and wrote its final outputs."""
    (path / COMPLETE_FILE).write_text(json.dumps({"step": step}))


def completed_step(path: Path) -> int | None:
    """The step a finished run in ``path`` trained to (None: not finished)."""
    try:
        return int(json.loads((path / COMPLETE_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- steps of the claim -----------------------------------------------------------------------------


def _make_folder(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"config key 'train.output_dir': {str(path)!r} is a file, not a folder; choose a "
                         "folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"config key 'train.output_dir': cannot create folder {str(path)!r} "
                         f"({err.strerror or err}); choose a folder path you can write to") from None


def _take_lock(path: Path) -> IO[str]:
    try:
        handle = open(path / LOCK_FILE, "a+")
    except OSError as err:
        raise ValueError(f"config key 'train.output_dir': cannot write in {str(path)!r} ({err.strerror or err}); "
                         "choose a folder you can write to") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(f"train.output_dir {str(path)!r} is in use by another run ({holder}); wait for it to end "
                         "or choose another train.output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
    handle.flush()
    return handle


def _entries(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name != LOCK_FILE)


def _fresh_folder(path: Path, overwrite: bool) -> None:
    entries = _entries(path)
    if not entries:
        return
    if not overwrite:
        shown = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(f"train.output_dir {str(path)!r} already holds files ({shown}); continue that run with "
                         "--resume, start anew with --overwrite (which moves them aside, deleting nothing), or "
                         "choose another train.output_dir")
    aside = path.with_name(f"{path.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.mkdir()
    for entry in entries:
        entry.rename(aside / entry.name)
    tqdm.write(f"--overwrite: moved the earlier contents of {path} to {aside}")


def _check_same_training(path: Path, config: Config) -> None:
    stored_file = path / CONFIG_FILE
    if not stored_file.is_file():
        return
    try:
        stored = json.loads(stored_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--resume: cannot read {stored_file} ({err}); it should hold the config the run was "
                         "trained with") from None
    changed = changed_training_keys(stored, config.to_dict())
    if changed:
        shown = ", ".join(f"{key} ({before!r} -> {after!r})" for key, before, after in changed)
        raise ValueError(f"--resume: the config differs from the one {path} was trained with in keys that change "
                         f"training: {shown}. Resume with the stored values, or start a new run (another "
                         "train.output_dir, or --overwrite)")


def changed_training_keys(stored: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key, stored value, new value) of every key present in both configs whose change changes training."""
    before, after = _flatten(stored), _flatten(current)
    return [(key, before[key], after[key]) for key in sorted(before.keys() & after.keys())
            if before[key] != after[key] and not any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)]


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Sections to dotted keys; lists (rewards included) stay whole values."""
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and prefix.count(".") < 1:  # sections, not a reward's kwargs
            flat.update(_flatten(value, key + "."))
        else:
            flat[key] = value
    return flat
