"""Running environment code (turn handlers, ``reset``, ``get_reward``, factories) off the main thread, each
call bounded in time, none able to end or hang the run.

Why not ``concurrent.futures.ThreadPoolExecutor``: its workers are joined when the pool closes and again at
interpreter exit, so one environment call that never returns keeps the process alive after SIGTERM or Ctrl-C
(only SIGKILL ends it); and its futures hand a ``SystemExit`` raised inside environment code to whoever reads
the result, which then exits with the environment's code, no message and no checkpoint. Here:

* every call runs on a daemon thread, never joined: a stuck call is abandoned, not waited for;
* at most ``max_workers`` calls run at once (1: environment code never runs concurrently); the rest queue;
* a call that has run ``timeout_s`` seconds fails with ``EnvCallTimeout`` (its thread is abandoned and its
  slot freed, so queued calls still run); the clock starts when the call starts, not when it is queued;
* ``SystemExit``, ``KeyboardInterrupt`` or any other ``BaseException`` raised by environment code becomes an
  ``EnvCallFailed`` (an ``Exception``): the conversation's failure, never the run's end. A real Ctrl-C or
  SIGTERM lands in the main thread, which is only ever waiting here, so it ends the run as it does elsewhere;
* a call returning an awaitable (an ``async def`` tool, ``reply`` or ``get_reward``, as TRL allows) is
  awaited on the worker thread's own event loop (``asyncio.run``).

The futures are ``concurrent.futures.Future``; read them with ``result`` and ``wait`` here (not the
module's), which enforce the time limit.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any


class EnvCallFailed(RuntimeError):
    """Environment code ended in a way that must not end the run (a time limit, ``SystemExit`` ...)."""


class EnvCallTimeout(EnvCallFailed):
    """An environment call that did not return within the time limit."""


def run_awaited(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its result awaited when it is awaitable (an ``async def`` environment method;
    TRL awaits async tools and ``get_reward``). Runs its own event loop: call it off any running loop."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        async def awaited():
            return await result
        result = asyncio.run(awaited())
    return result


class EnvCalls:
    """Daemon-thread calls of environment code, at most ``max_workers`` at once, each limited to ``timeout_s``
    seconds (None or 0: no limit). See the module docstring."""

    def __init__(self, max_workers: int = 16, timeout_s: float | None = None):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1 (1 runs environment code serially), got "
                             f"{max_workers!r}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s >= 0):
            raise ValueError(f"the environment call time limit must be a number of seconds >= 0 (0: none), got "
                             f"{timeout_s!r}")
        self.max_workers = max_workers
        self.timeout_s = timeout_s or None
        self._lock = threading.Lock()
        self._queued: collections.deque = collections.deque()   # (future, fn, args), not yet started
        self._running: dict[Future, float] = {}                 # started and not abandoned -> deadline

    def __reduce__(self):
        # Sent to another process (the asynchronous loop's episodes travel from its rollout worker to the
        # trainer, which calls get_reward), a pool travels as its settings: calls in flight stay behind.
        return EnvCalls, (self.max_workers, self.timeout_s)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on a daemon thread as soon as a worker slot is free."""
        future: Future = Future()
        with self._lock:
            self._queued.append((future, fn, args))
            self._start_queued()
        return future

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run here as it would be in the pool (limited, exits caught), waited for."""
        return self.result(self.submit(fn, *args))

    def result(self, future: Future) -> Any:
        """The call's result, waiting at most until its deadline; raises its failure (``EnvCallFailed`` for a
        time limit or an exit, else the exception environment code raised)."""
        self.wait([future], FIRST_COMPLETED)
        return future.result()

    def wait(self, futures: Iterable[Future], return_when: str) -> None:
        """Block like ``concurrent.futures.wait`` (``FIRST_COMPLETED`` or ``ALL_COMPLETED``), failing every call
        that passes its deadline meanwhile."""
        futures = list(futures)
        while True:
            self.expire()
            pending = [f for f in futures if not f.done()]
            if not pending or (return_when == FIRST_COMPLETED and len(pending) < len(futures)):
                return
            wait_futures(pending, timeout=self._time_to_next_deadline(), return_when=return_when)

    def expire(self) -> None:
        """Fail (``EnvCallTimeout``) and abandon every running call past its deadline; queued calls take
        their slots."""
        if self.timeout_s is None:
            return
        now = time.monotonic()
        with self._lock:
            expired = [f for f, deadline in self._running.items() if deadline <= now]
            for future in expired:
                del self._running[future]
            self._start_queued()
        for future in expired:
            future.set_exception(EnvCallTimeout(f"did not return within {self.timeout_s:g} s (env.call_timeout_s)"))

    def _time_to_next_deadline(self) -> float | None:
        with self._lock:
            if self.timeout_s is None or not self._running:
                return None
            return max(0.0, min(self._running.values()) - time.monotonic())

    def _start_queued(self) -> None:
        """Start queued calls while slots are free (lock held)."""
        while self._queued and len(self._running) < self.max_workers:
            future, fn, args = self._queued.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self._running[future] = time.monotonic() + (self.timeout_s or float("inf"))
            threading.Thread(target=self._work, args=(future, fn, args), daemon=True,
                             name="turbogrpo-env-call").start()

    def _work(self, future: Future, fn: Callable[..., Any], args: tuple) -> None:
        result, error = None, None
        try:
            result = run_awaited(fn, *args)
        except Exception as err:
            error = err
        except BaseException as err:  # SystemExit, KeyboardInterrupt ... from environment code: its failure only
            error = EnvCallFailed(f"raised {type(err).__name__}({', '.join(map(repr, err.args))}) (environment "
                                  "code cannot end the run)")
        with self._lock:
            if self._running.pop(future, None) is None:  # past its deadline: already failed and abandoned
                return
            self._start_queued()
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
