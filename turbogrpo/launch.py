"""``turbogrpo train|demo --nproc-per-node N``: the same command on N processes of this machine, started
by torchrun's own launcher (``torch.distributed.run``, standalone: a free port, no rendezvous setup).

Why not only ``torchrun``: its launcher turns SIGTERM (and Ctrl-C) into a ``SignalException`` that it
prints as a traceback and exits 1, whatever its ranks did. Run from here, the stop ends as it does for one
process: the ranks stop together at a step's end (train/stops.py), rank 0 prints one line naming the
checkpoint to resume from, and the exit status is 128 + the signal's number (143 for SIGTERM, 130 for
Ctrl-C). A rank's own failure ends with that rank's exit status; its message is the rank's one line.
"""

from __future__ import annotations

import os


def check_launch(num_processes: int) -> bool:
    """Whether ``--nproc-per-node num_processes`` asks this process to launch the ranks (it is not one of
    them already); ValueError when it contradicts the torchrun job this process belongs to."""
    if num_processes < 1:
        raise ValueError(f"--nproc-per-node: {num_processes} is not a number of processes; use an integer >= 1")
    world_size = os.environ.get("WORLD_SIZE")
    if world_size is None:
        return num_processes > 1
    if int(world_size) != num_processes:
        raise ValueError(f"--nproc-per-node: {num_processes} processes asked for inside a torchrun job of "
                         f"{world_size}; drop the flag under torchrun, or start the command without torchrun")
    return False  # a rank: the launcher has done its part


def launch(num_processes: int, argv: list[str]) -> int:
    """Run ``python -m turbogrpo ARGV`` on ``num_processes`` ranks (ARGV keeps --nproc-per-node: each
    rank sees it matches its job and runs); returns the job's exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        torchrun.main(["--standalone", f"--nproc-per-node={num_processes}", "-m", "turbogrpo", *argv])
    except SignalException as stop:  # the launcher was stopped: it has stopped the ranks (they report)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:  # a rank failed (it printed why): its exit status
        _, failure = failed.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0
