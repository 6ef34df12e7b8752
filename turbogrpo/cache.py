"""turbogrpo's cache folder, and the entries in it, which are verified before every use.

    cache_root()                              $TURBOGRPO_CACHE, else ~/.cache/turbogrpo
    verified_entry(folder, source, build)     ``folder`` when its record matches; else built once, then it

An entry is a folder whose record file (``ENTRY_RECORD``) holds what it was built from (``source``: any
JSON, e.g. a GGUF file's name, size and SHA-256) and the size and SHA-256 of every file in it, written
when it was built. Using an entry checks all of them, so a same-size overwrite of a weight file is
caught like a truncation: the entry is rebuilt, never used. Hashing costs about 0.4 s per 540 MiB
(SmolLM2-135M in float32) on this project's 2-core AMD EPYC (SHA-NI, 1.26 GB/s; blake2b is half as
fast there), and is done once per process per file version (path, size, mtime, inode).

Several processes may need one entry at once (``torchrun``, a sweep started in parallel). Readers take
no lock: a complete entry appears by one rename, so a cache prepared by another user serves its
complete entries without write access. A builder takes an exclusive ``flock`` on the folder that holds
the entries (no lock file is left behind; builds of different entries there wait for each other, which
is rare and short next to a conversion), checks again (another process may have finished it
meanwhile), builds into a private temporary folder beside it and renames that into place; the kernel
drops the lock however the builder ends.

Every failure is one ValueError line: an entry that is not readable (files of another user) is told
apart from a cache that cannot be written, and a full disk is named as such.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from turbogrpo.files import describe_os_error, fsync_dir, fsync_file

CACHE_ENV = "TURBOGRPO_CACHE"
ENTRY_RECORD = "turbogrpo_source.json"
_NOT_PERMITTED = (errno.EACCES, errno.EPERM)


class CacheNotReadable(ValueError):
    """An entry exists but this user may not read it."""


def cache_root() -> Path:
    """The cache directory: ``$TURBOGRPO_CACHE``, else ``~/.cache/turbogrpo``. Every cache turbogrpo keeps
    (converted models, drafts, latency profiles) is under it."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "turbogrpo").expanduser()


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, read once per version of it in this process (see ``_sha256``)."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """A changed file (new size, mtime or inode: a rebuilt entry is a new inode) gets a new key; a
    policy and its reference read from one entry hash it once."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def verified_entry(folder: Path, source: dict, build: Callable[[Path], None], *, what: str) -> Path:
    """``folder`` once it is a complete entry built from ``source``: as it is when its record and every
    file's size and SHA-256 match, else rebuilt by ``build(tmp)`` (which fills an empty folder) under
    the entry's lock. ``what`` names the entry in messages ("the converted model")."""
    if entry_problem(folder, source) is None:
        return folder
    parent = folder.parent
    ensure_writable(parent, what)
    with _locked(parent, what):
        if entry_problem(folder, source) is None:  # another process built it while this one waited
            return folder
        _build(folder, source, build, what)
    problem = entry_problem(folder, source)
    if problem is not None:  # written and at once unreadable or changed: say so rather than loop
        raise ValueError(f"{what} in {folder} does not verify right after it was built ({problem})")
    return folder


def entry_problem(folder: Path, source: dict) -> str | None:
    """Why ``folder`` is not a complete, unchanged entry built from ``source`` (None: it is). An entry
    this user may not read raises CacheNotReadable instead: rebuilding it would not help."""
    try:
        record = json.loads((folder / ENTRY_RECORD).read_text())
        if not isinstance(record, dict) or record.get("source") != source:
            return "its record is of another source" if isinstance(record, dict) else "its record is damaged"
        files = record.get("files")
        if not isinstance(files, dict) or not files:
            return "its record lists no files"
        for name, expected in files.items():
            path = folder / name
            if not isinstance(expected, dict) or not path.is_file():
                return f"{name} is missing" if isinstance(expected, dict) else "its record is of an older version"
            if path.stat().st_size != expected.get("size"):
                return f"{name} has another size"
            if sha256_of(path) != expected.get("sha256"):
                return f"{name} has changed (its SHA-256 differs from the one recorded)"
    except FileNotFoundError:
        return "it is not there"
    except OSError as err:
        if err.errno in _NOT_PERMITTED:
            raise CacheNotReadable(
                f"the model cache entry {folder} is not readable ({describe_os_error(err)}): it belongs to "
                f"another user; ask them to make it readable (chmod -R a+rX) or set {CACHE_ENV} to a folder "
                "of your own") from None
        return f"it cannot be read ({describe_os_error(err)})"
    except ValueError:
        return "its record is damaged"
    return None


def _build(folder: Path, source: dict, build: Callable[[Path], None], what: str) -> None:
    """Build the entry into a private folder beside ``folder``, record its files, rename it into place
    (a damaged old entry is moved aside first and deleted after)."""
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{folder.name}-"))
    old = folder.with_name(f".old-{folder.name}-{os.getpid()}")
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like a normal model folder
        build(staging)
        files = {}
        for path in sorted(staging.iterdir()):
            if path.is_file():
                fsync_file(path)
                files[path.name] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
        record = staging / ENTRY_RECORD
        record.write_text(json.dumps({"source": source, "files": files}, indent=1))
        fsync_file(record)
        fsync_dir(staging)
        if folder.exists():  # damaged: replaced, never used (we hold the lock: no other builder is here)
            os.rename(folder, old)
        os.rename(staging, folder)
        fsync_dir(folder.parent)
    except (OSError, SafetensorError) as err:
        raise ValueError(f"could not write {what} to {folder.parent} ({describe_os_error(err)}); "
                         f"{_remedy(err)}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _remedy(err: BaseException) -> str:
    text = describe_os_error(err)
    if "No space left" in text or getattr(err, "errno", None) == errno.ENOSPC:
        return f"the disk is full: free space there or set {CACHE_ENV} to a folder on another disk"
    return f"free space, fix the folder's permissions, or set {CACHE_ENV} to another directory"


def ensure_writable(folder: Path, what: str) -> None:
    """A ValueError naming ``folder`` and ``CACHE_ENV`` where ``what`` cannot be written into it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-").close()
    except OSError as err:
        raise ValueError(f"cannot write the model cache {folder} ({describe_os_error(err)}), which {what} "
                         f"has to be built into; set {CACHE_ENV} to a writable directory") from None


class _locked:
    """An exclusive ``flock`` on directory ``path`` for the ``with`` block (blocking: a builder waits for
    another)."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise ValueError(f"cannot lock {self.path} to build {self.what} ({describe_os_error(err)}); set "
                             f"{CACHE_ENV} to a writable directory") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def measured_once(name: str, key: dict, measure: Callable[[], object]) -> object:
    """A choice this machine measured (JSON: a kernel's row threshold, say), kept under
    ``cache_root()/measured/<name>/`` for ``key`` (what it depends on: CPU kind, dtype, threads), so that every
    process on this machine makes the same one. Timing is noisy: two processes that each timed for themselves
    could pick differently, and a rollout worker (another process) or a resumed run whose kernel rounds
    differently from the first run's breaks bit-exact resumes. The first value written wins (``os.link`` of a
    complete file fails where another process was first; that one's is read). A cache that cannot be written
    still answers, measured in this process (and remembered for it)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if (name, digest) not in _MEASURED:
        _MEASURED[name, digest] = _measured_on_this_machine(name, digest, key, measure)
    return _MEASURED[name, digest]


def measured_before(name: str, key: dict) -> object | None:
    """What ``measured_once(name, key, ...)`` answered on this machine, or None where it has not measured yet: for a
    caller that cannot time anything where it stands (inside a compiler's pass)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if (name, digest) not in _MEASURED:
        try:
            _MEASURED[name, digest] = json.loads((cache_root() / "measured" / name / f"{digest}.json").read_text())["value"]
        except (OSError, ValueError, KeyError):
            return None
    return _MEASURED[name, digest]


_MEASURED: dict[tuple[str, str], object] = {}
"""``measured_once``'s answers in this process."""


def _measured_on_this_machine(name: str, digest: str, key: dict, measure: Callable[[], object]) -> object:
    folder = cache_root() / "measured" / name
    path = folder / f"{digest}.json"
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError):
        pass  # not measured yet (or damaged: measured again, and not replaced)
    value = measure()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=f".tmp-{digest}-", delete=False) as file:
            file.write(json.dumps({"key": key, "value": value}))
        try:
            os.link(file.name, path)
        except FileExistsError:
            value = json.loads(path.read_text())["value"]  # another process measured first: its choice holds
        finally:
            os.unlink(file.name)
    except (OSError, ValueError, KeyError):
        pass  # an unwritable cache: this process's own measurement
    return value
