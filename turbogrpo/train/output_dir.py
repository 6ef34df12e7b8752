"""A run's output folder: one run at a time, never mixed with or written over another run.

* An exclusive ``flock`` on ``<output_dir>/.lock`` makes a second run into the same folder fail at
  once. The kernel drops the lock when the process ends, however it ends (SIGKILL included), so a
  stale lock never blocks a later run.
* A fresh run refuses a folder that holds files, unless ``--overwrite``, which moves them aside into
  ``<output_dir>.previous-<time>/``: nothing a user has is deleted.
* The path is resolved before anything moves, and a folder that is, holds or sits inside the model,
  the data, the draft or a reward module (the CLI adds the config file) is refused: outputs never mix
  with inputs, and ``--overwrite`` never moves them. ``turbogrpo draft train --out`` claims its folder
  by the same rules (:func:`claim_folder`).
* ``--overwrite`` moves all the files aside or, when one cannot move, none.
* ``--resume`` compares the stored ``config.json`` with the new config and refuses a change in any
  key that changes what is trained, naming the keys; and ``inputs.json``'s fingerprints of the training
  data and the model folder with those files now, refusing ones rewritten since the run started.
* A run that finished writes ``complete.json``; resuming it again does nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from turbogrpo.config import Config
from turbogrpo.files import write_text_atomically
from turbogrpo.placement import DistInfo
from turbogrpo.train.distributed import all_reduce_max_int

OUTPUT_KEY = "train.output_dir"
LOCK_FILE = ".lock"
COMPLETE_FILE = "complete.json"
CONFIG_FILE = "config.json"
INPUTS_FILE = "inputs.json"

# Keys a resumed run may change: they say how long to run, where and how to log, evaluate or compute,
# not what is trained (micro-batches sum exactly to the step's batch, and every backend is exact).
# train.num_steps is here so a finished run can be extended (the lr schedule then follows the new length).
RESUMABLE_KEYS = (
    "train.num_steps", "train.output_dir", "train.checkpoint_every", "train.keep_checkpoints", "train.eval_every",
    "train.save_final_model", "train.num_threads", "train.max_nonfinite_steps", "train.accuracy_reward",
    "train.reward_failure_limit", "train.micro_batch_tokens", "train.sharing", "model.device",
    "model.gradient_checkpointing", "model.logprob_backend", "data.eval_path", "data.num_eval_problems",
    "data.num_eval_samples", "log", "distributed.backend",
    # the machines' settings: where the rollout worker runs and how the two find and trust each other (a step's
    # rollout depends on its prompts, seed and version alone, whichever worker draws it) and its threads
    "train.rollout_worker", "train.rollout_host", "train.rollout_port", "train.rollout_connect_timeout_s",
    "train.rollout_secret_file", "train.rollout_threads",
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


@dataclass(frozen=True)
class RunRecord:
    """What a run's output folder records of the run's inputs, taken from its config once
    (:func:`run_record`): checked when the folder is claimed, written by ``state.start``, compared by
    ``--resume``."""

    output_dir: str
    """train.output_dir as configured (normalised, not yet resolved)."""
    config: dict
    """The whole config as plain data (``Config.to_dict``): config.json, and the keys a resume compares."""
    inputs: dict[str, Path]
    """The local files and folders the run reads, by config key (:func:`run_inputs`)."""
    fingerprinted: dict[str, tuple[str, int | None]]
    """By config key, the local input a resumed run reads again and trains on, and the size above which
    its files are fingerprinted by samples (:attr:`fingerprints`)."""

    @cached_property
    def fingerprints(self) -> dict[str, str | None]:
        """By config key, a fingerprint of each local input a resumed run reads again and trains on
        (``fingerprinted``); None for what is not a local file (a built-in task, a Hub id). Read from disk
        once per run: the ranks' agreement, the resume check and inputs.json all use these."""
        return {key: fingerprint(path, whole_up_to=whole_up_to)
                for key, (path, whole_up_to) in self.fingerprinted.items()}


def run_record(config: Config) -> RunRecord:
    """The output folder's record of ``config``'s inputs: the one function here that reads the whole
    config; the rest of this module works on the record. data.path (its rows) and model.path (LoRA's
    frozen base and the reference are reloaded from it) are fingerprinted."""
    inputs = run_inputs(model_path=config.model.path, data_path=config.data.path, eval_path=config.data.eval_path,
                        draft_path=config.draft.path, reward_functions=[r.function for r in config.rewards])
    return RunRecord(config.train.output_dir, config.to_dict(), inputs,
                     {"data.path": (config.data.path, None),
                      "model.path": (str(inputs["model.path"]), SAMPLED_ABOVE_BYTES)})


def claim_output_dir(record: RunRecord, dist: DistInfo, *, resume: bool, overwrite: bool) -> OutputDir:
    """Create and lock train.output_dir (``record.output_dir``) and check that this run may write there
    (ValueError if not).

    The path is resolved first (``.``, ``a/..`` and symlinks name the folder they lead to), and a folder
    that is, holds or sits inside the model, the data or the draft is refused before anything moves.
    Rank 0 does the work; every rank learns whether it failed, so none is left waiting in a collective.
    """
    path = Path(record.output_dir).expanduser().resolve()
    lock, error = None, None
    if dist.is_main:
        try:
            lock = claim_folder(path, OUTPUT_KEY, record.inputs, resume=resume, overwrite=overwrite)
            if resume:
                _check_same_training(path, record.config)
                _check_same_inputs(path, record)
        except ValueError as err:
            if lock is not None:
                lock.close()
            error = err
    if all_reduce_max_int(int(error is not None), dist, dist.device):
        raise error or ValueError(f"rank 0 refused train.output_dir {path}; see its message")
    return OutputDir(path, lock)


def claim_folder(path: Path, key: str, inputs: dict[str, Path], *, resume: bool, overwrite: bool) -> IO[str]:
    """Lock the output folder ``path`` (given by ``key``: a config key or a command-line flag) and, for a
    fresh start, check that it is empty or move its files aside (``overwrite``); returns the lock.

    ``inputs`` are the files and folders the command reads, by the key that names them: an output
    folder that is, holds or sits inside one of them is refused (an ``--overwrite`` would move them aside,
    and outputs would mix with them)."""
    check_apart_from_inputs(path, key, inputs)
    _make_folder(path, key)
    lock = _take_lock(path, key)
    try:
        if not resume:
            _fresh_folder(path, key, overwrite)
    except ValueError:
        lock.close()
        raise
    return lock


def run_inputs(*, model_path: str, data_path: str, eval_path: str, draft_path: str,
               reward_functions: list[str]) -> dict[str, Path]:
    """The local files and folders a run reads, by config key: the model, its data, the draft, and the
    files of reward modules already imported (``train`` imports them before it claims the folder)."""
    from turbogrpo.models import model_source
    from turbogrpo.speculative.built_drafts import resolve_draft_path
    draft = Path(resolve_draft_path(draft_path)) if draft_path != "scratch" else None
    inputs = {"model.path": model_source(model_path), "data.path": Path(data_path), "data.eval_path": Path(eval_path)}
    if draft is not None:
        inputs["draft.path"] = draft
    for number, function in enumerate(reward_functions):
        module_file = getattr(sys.modules.get(function.partition(":")[0]), "__file__", None)
        if ":" in function and module_file:
            inputs[f"rewards.{number}.function"] = Path(module_file)
    return {key: path for key, path in inputs.items() if str(path) not in ("", ".") or key == "model.path"}


def mark_complete(path: Path, step: int) -> None:
    """Record that the run trained to ``step`` and wrote its final outputs."""
    write_text_atomically(path / COMPLETE_FILE, json.dumps({"step": step}))


def completed_step(path: Path) -> int | None:
    """The step a finished run in ``path`` trained to (None: not finished)."""
    try:
        return int(json.loads((path / COMPLETE_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- steps of the claim -----------------------------------------------------------------------------


def _named(key: str) -> str:
    """How a message names the setting behind a path: a config key, or a command-line flag as it is."""
    return key if key.startswith("--") else f"config key {key!r}"


def check_apart_from_inputs(path: Path, key: str, inputs: dict[str, Path]) -> None:
    """ValueError when output folder ``path`` (resolved) is, holds or sits inside one of ``inputs`` (by the
    key or flag that names each; missing ones are passed over)."""
    for input_key, given in inputs.items():
        source = given.expanduser()
        if not source.exists():
            continue
        source = source.resolve()
        if path == source or path in source.parents or source in path.parents:
            relation = ("is" if path == source else "holds" if path in source.parents else "sits inside")
            raise ValueError(f"{_named(key)}: {str(path)!r} {relation} {input_key} {str(source)!r}; outputs "
                             f"must not mix with what the run reads, so choose a {key} outside it")


def _make_folder(path: Path, key: str) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"{_named(key)}: {str(path)!r} is a file, not a folder; choose a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{_named(key)}: cannot create folder {str(path)!r} "
                         f"({err.strerror or err}); choose a folder path you can write to") from None


def _take_lock(path: Path, key: str) -> IO[str]:
    try:
        handle = open(path / LOCK_FILE, "a+")
    except OSError as err:
        raise ValueError(f"{_named(key)}: cannot write in {str(path)!r} ({err.strerror or err}); "
                         "choose a folder you can write to") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(f"{key} {str(path)!r} is in use by another run ({holder}); wait for it to end "
                         f"or choose another {key}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
    handle.flush()
    return handle


def _entries(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name != LOCK_FILE)


def _fresh_folder(path: Path, key: str, overwrite: bool) -> None:
    entries = _entries(path)
    if not entries:
        return
    if not overwrite:
        shown = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(f"{key} {str(path)!r} already holds files ({shown}); continue that run with "
                         "--resume, start anew with --overwrite (which moves them aside, deleting nothing), or "
                         f"choose another {key}")
    aside = move_aside(entries, path)
    tqdm.write(f"--overwrite: moved the earlier contents of {path} to {aside}")


def move_aside(entries: list[Path], path: Path) -> Path:
    """Move ``entries`` (files in folder ``path``) into a new ``<path>.previous-<time>/`` beside it, all
    or nothing: when one cannot move, those already moved go back and a ValueError says why."""
    aside = path.with_name(f"{path.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    try:
        aside.mkdir()
    except OSError as err:
        raise ValueError(f"--overwrite: cannot create {str(aside)!r} to move the earlier files of {str(path)!r} "
                         f"into ({err.strerror or err}); nothing was moved") from None
    moved: list[Path] = []
    try:
        for entry in entries:
            entry.rename(aside / entry.name)
            moved.append(entry)
    except OSError as err:
        for done in reversed(moved):
            (aside / done.name).rename(done)
        aside.rmdir()
        raise ValueError(f"--overwrite: cannot move {str(entry)!r} to {str(aside)!r} ({err.strerror or err}); "
                         "nothing was moved") from None
    return aside


def _check_same_training(path: Path, config: dict) -> None:
    stored_file = path / CONFIG_FILE
    if not stored_file.is_file():
        return
    try:
        stored = json.loads(stored_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--resume: cannot read {stored_file} ({err}); it should hold the config the run was "
                         "trained with") from None
    check_same_training(str(path), stored, config)


def check_same_training(trained: str, stored: dict, config: dict) -> None:
    """ValueError naming every key that changes training whose value in ``config`` differs from ``stored``,
    the config that ``trained`` (a run folder, a checkpoint) was trained with."""
    changed = changed_training_keys(stored, config)
    if changed:
        shown = ", ".join(f"{key} ({before!r} -> {after!r})" for key, before, after in changed)
        raise ValueError(f"--resume: the config differs from the one {trained} was trained with in keys that change "
                         f"training: {shown}. Resume with the stored values, or start a new run (another "
                         "train.output_dir, or --overwrite)")


def record_inputs(path: Path, record: RunRecord) -> None:
    """Write the run's ``config.json`` (the whole config, as ``config.dump_config`` writes it) and
    ``inputs.json``: fingerprints of what the run reads from disk (``RunRecord.fingerprints``), which
    ``--resume`` checks."""
    write_text_atomically(path / CONFIG_FILE, json.dumps(record.config, indent=2, sort_keys=True))
    write_text_atomically(path / INPUTS_FILE, json.dumps(record.fingerprints))


# Files above this size are fingerprinted by their size and three 1 MiB samples (start, middle, end):
# a retrained model changes every weight, and reading a 15 GB model whole on every resume would not do.
SAMPLED_ABOVE_BYTES = 64 << 20
SAMPLE_BYTES = 1 << 20


def fingerprint(path_text: str, *, whole_up_to: int | None = None) -> str | None:
    """sha256 of a file, or of every file (relative path and content) in a folder; files larger than
    ``whole_up_to`` bytes contribute their size and three samples instead. None when ``path_text`` is
    not a local file or folder."""
    root = Path(path_text).expanduser() if path_text else None
    if root is None or not root.exists():
        return None
    digest = hashlib.sha256()
    for file in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root)}\0{size}\0".encode())
        with open(file, "rb") as handle:
            if whole_up_to is not None and size > whole_up_to:
                for offset in (0, size // 2, max(0, size - SAMPLE_BYTES)):
                    handle.seek(offset)
                    digest.update(handle.read(SAMPLE_BYTES))
            else:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _check_same_inputs(path: Path, record: RunRecord) -> None:
    stored_file = path / INPUTS_FILE
    try:
        stored = json.loads(stored_file.read_text())
    except (OSError, ValueError):
        return  # a run from before inputs.json, or one that never got past loading its model
    current = record.fingerprints
    changed = [key for key, value in current.items() if isinstance(stored, dict) and key in stored
               and stored[key] != value]
    if changed:
        configured = _flatten(record.config)
        shown = ", ".join(f"{key} {configured[key]!r}" for key in changed)
        raise ValueError(f"--resume: {shown} changed since {path} started (the content differs from the "
                         f"fingerprint in {stored_file}); resuming would train on other rows or weights. Restore "
                         "it, or start a new run (another train.output_dir, or --overwrite)")


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
