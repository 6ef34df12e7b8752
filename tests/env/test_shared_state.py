"""Shared state between environments: one instance returned twice by a factory and a fork() that returns itself or
None are refused in one line; env.max_workers = 1 runs environment code one call at a time."""

import threading
import time

import pytest

from tests.env.test_episode import demo, episodes  # noqa: F401 (fixture)
from turbogrpo.config import EnvConfig
from turbogrpo.env.tasks import RetryArithmetic
from turbogrpo.train.episodes import build_episode_sampler

SHARED = RetryArithmetic()


def shared_factory():
    return SHARED


def test_a_factory_returning_one_instance_twice_is_refused(demo):
    with pytest.raises(ValueError, match="returned the same RetryArithmetic object twice; each conversation needs its "
                                         "own environment"):
        episodes(demo, shared_factory, num_rows=1)


class ForksToItself(RetryArithmetic):
    def fork(self):
        return self


class ForksToNothing(RetryArithmetic):
    def fork(self):
        self.forked = True  # (a fork() that forgot its return)


@pytest.mark.parametrize("env, returned", [(ForksToItself, "the same object"), (ForksToNothing, "None")])
def test_a_fork_that_returns_itself_or_none_is_refused(demo, env, returned):
    with pytest.raises(ValueError, match=fr"but {env.__name__}.fork\(\) returned {returned}; it must return an "
                                         "independent copy"):
        episodes(demo, env, num_rows=1, num_samples=4, branching=[2, 2])


class Crowded(RetryArithmetic):
    """Records how many environment calls of its class run at once."""
    lock = threading.Lock()
    running = most = 0

    def reply(self, message):
        with Crowded.lock:
            Crowded.running += 1
            Crowded.most = max(Crowded.most, Crowded.running)
        time.sleep(0.02)
        with Crowded.lock:
            Crowded.running -= 1
        return super().reply(message)


def test_one_worker_runs_environment_code_one_call_at_a_time(demo):
    Crowded.most = 0
    episodes(demo, Crowded, num_rows=2, num_samples=4, max_turns=3, max_workers=1, reply_timing="arrival")
    assert Crowded.most == 1
    sampler = build_episode_sampler(EnvConfig(factory="turbogrpo.env.tasks:RetryArithmetic", max_workers=1,
                                              call_timeout_s=2.5), tokenizer=None)
    assert (sampler.max_workers, sampler.call_timeout_s) == (1, 2.5)
