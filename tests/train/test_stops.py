"""Stopping ranks at step ends (train/stops.py): a rank that stops keeps noting signals while it unwinds, so the
SIGTERM torchrun's agent sends the other ranks once one exits cannot raise a second stop inside their cleanup."""

import os
import signal

import pytest
import torch

import turbogrpo.train.stops as stops_module
from turbogrpo.placement import DistInfo
from turbogrpo.train.stops import Terminated, stops_at_step_ends


@pytest.fixture
def two_ranks(monkeypatch):
    """This process as one of two ranks whose all-reduce returns its own value (no process group needed)."""
    saved = {signum: signal.getsignal(signum) for signum in stops_module.STOPS}
    monkeypatch.setattr(stops_module, "all_reduce_max_int", lambda value, dist, device: value)
    yield DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def raise_terminated(signum, frame):
    raise Terminated()


def test_a_signal_inside_the_loop_is_raised_at_the_step_end_only(two_ranks):
    signal.signal(signal.SIGTERM, raise_terminated)
    with pytest.raises(Terminated):
        with stops_at_step_ends(two_ranks) as stop:
            os.kill(os.getpid(), signal.SIGTERM)  # noted, not raised here
            reached_the_step_end = True
            stop.check()
    assert reached_the_step_end


def test_a_stopping_rank_notes_a_second_sigterm_instead_of_raising_it_in_its_cleanup(two_ranks):
    signal.signal(signal.SIGTERM, raise_terminated)  # the CLI's handler outside the loop
    with pytest.raises(Terminated):
        with stops_at_step_ends(two_ranks) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            stop.check()
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent, while this rank unwinds: must not raise
    assert signal.getsignal(signal.SIGTERM) == stop.note


def test_a_loop_that_ends_normally_gives_the_handlers_back(two_ranks):
    signal.signal(signal.SIGTERM, raise_terminated)
    with stops_at_step_ends(two_ranks) as stop:
        stop.check()
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
