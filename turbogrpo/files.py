"""Writing outputs so that nothing is half-written: whole folders appear at once, and safetensors'
I/O failures (a full disk) are ``OSError`` naming the file, like every other write.

    write_folder_atomically(final, write)   write(tmp) into a hidden folder beside final, then rename it
    write_text_atomically(path, text)       the same for one text file
    save_tensors(tensors, path)             safetensors save_file + fsync; OSError on failure
    save_json(value, path)                  json.dumps + fsync, beside save_tensors in a folder being written
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


class WriteError(ValueError):
    """An output could not be written (a full disk, an unwritable folder); the message names it."""


def write_folder_atomically(final: Path, write: Callable[[Path], None], what: str) -> Path:
    """Fill folder ``final`` by ``write(tmp)`` into ``.tmp-<name>/`` beside it, then rename it into place.

    A kill or a full disk during ``write`` leaves ``final`` as it was (absent, or the older copy), never
    a folder that looks whole but lacks files; an older ``final`` is replaced only once the new one is
    complete. ``what`` names the output in the WriteError raised when writing fails (the temporary
    folder is removed then).
    """
    final = Path(final)
    tmp = final.with_name(f".tmp-{final.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a kill during an earlier attempt
        tmp.mkdir(parents=True)
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(tmp)
        replace_folder(tmp, final)
        fsync_dir(final.parent)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(f"could not write {what} {final} ({describe_os_error(err)}); nothing was left "
                         "half-written. Free space (or fix the folder's permissions) and try again") from err
    except BaseException:  # Ctrl-C or SIGTERM mid-write: no debris either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def replace_folder(new: Path, final: Path) -> None:
    """Rename folder ``new`` to ``final``; an existing ``final`` is moved away first and deleted after."""
    if not final.exists():
        os.rename(new, final)
        return
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    os.rename(new, final)
    shutil.rmtree(old, ignore_errors=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace file ``path`` with ``text`` through a temporary file beside it: a reader (or a run killed
    mid-write) sees the old content or the new, never part of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    fsync_file(tmp)
    os.replace(tmp, path)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors`` save_file, flushed to disk; a failed write raises OSError naming ``path``."""
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    except SafetensorError as err:  # a full disk surfaces as this, not as OSError
        raise safetensors_os_error(err, path) from err
    fsync_file(path)


def save_json(value, path: Path) -> None:
    """``value`` as JSON in file ``path``, flushed to disk (a file of a folder that appears whole later:
    ``write_folder_atomically``, a checkpoint's)."""
    path.write_text(json.dumps(value))
    fsync_file(path)


def safetensors_os_error(err: SafetensorError, path: str | Path) -> OSError:
    """The OSError inside a SafetensorError ("IoError(Os { code: 28, ..., message: \"No space ...\" })")."""
    text = str(err)
    code, message = re.search(r"code: (\d+)", text), re.search(r'message: "([^"]*)"', text)
    return OSError(int(code.group(1)) if code else 0, message.group(1) if message else text, str(path))


def describe_os_error(err: BaseException) -> str:
    """'No space left on device: /path/file' for an OSError (its text when it has no strerror)."""
    if isinstance(err, SafetensorError):
        err = safetensors_os_error(err, "")
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return str(err)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
