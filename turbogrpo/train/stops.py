"""Stopping a run on SIGTERM or Ctrl-C, one process or many.

One process stops where it is: the CLI turns SIGTERM into :class:`Terminated` (a KeyboardInterrupt), and
the loop names the last complete checkpoint. Ranks under ``torchrun`` must not stop where they are: a rank
that leaves while another waits in a collective makes that one fail with gloo's "Connection reset by
peer" (or NCCL's timeout) instead of reporting the checkpoint. So inside the step loop
(:func:`stops_at_step_ends`) the signals are only noted, and after each step the ranks agree in one
all-reduce whether any rank received one; then every rank raises the same stop at the same point.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from turbogrpo.placement import DistInfo
from turbogrpo.train.distributed import all_reduce_max_int


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler ending a job), handled like Ctrl-C: the run stops, its lock and
    processes are released, and the last complete checkpoint is named (exit status 143)."""


# The stop each signal raises. Their numbers order them: SIGTERM (15) wins over Ctrl-C (2) when ranks differ.
STOPS = {signal.SIGTERM: Terminated, signal.SIGINT: KeyboardInterrupt}


class StepEndStop:
    """The signals this rank received inside the step loop (noted, not raised); :meth:`check` raises the
    stop on every rank at once."""

    def __init__(self, dist: DistInfo):
        self.dist = dist
        self.received = 0
        """The largest signal number received (0: none)."""

    def note(self, signum: int, frame) -> None:
        self.received = max(self.received, signum)

    def check(self) -> None:
        """Every rank calls it after each step: raise the stop of the signal any rank received
        (Terminated for SIGTERM, KeyboardInterrupt for Ctrl-C). One all-reduce (a host sync, once per step)."""
        signum = all_reduce_max_int(self.received, self.dist, self.dist.device)
        if signum:
            raise STOPS[signal.Signals(signum)]()


class _StopsWhereItIs:
    """One process: the CLI's handlers raise at once; nothing to agree on."""

    def check(self) -> None:
        pass


@contextlib.contextmanager
def stops_at_step_ends(dist: DistInfo) -> Iterator[StepEndStop | _StopsWhereItIs]:
    """Inside, under torchrun, SIGTERM and Ctrl-C stop every rank together at the next step end (call
    ``check()`` after each step); one process (or a non-main thread, which cannot set handlers) stops at once."""
    if not dist.enabled or threading.current_thread() is not threading.main_thread():
        yield _StopsWhereItIs()
        return
    stop = StepEndStop(dist)
    previous = {signum: signal.signal(signum, stop.note) for signum in STOPS}
    stopping = False
    try:
        yield stop
    except KeyboardInterrupt:  # Terminated too: this rank stops
        stopping = True
        raise
    finally:
        for signum, handler in previous.items():
            # A stopping rank goes on noting signals while it unwinds: when one rank exits, torchrun's agent sends
            # SIGTERM to the others, which are stopping at the same step end, and a stop raised again inside their
            # cleanup (a __del__, a finally) prints a traceback or cuts the cleanup short.
            signal.signal(signum, stop.note if stopping else handler)
