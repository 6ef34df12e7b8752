"""Environment calls on daemon threads (``rollout.env_calls.EnvCalls``): a time limit per call, exits and
interrupts raised by environment code kept as that call's failure, at most ``max_workers`` at once, awaited
coroutines, and no thread that can keep the process alive."""

import asyncio
import threading
import time
from concurrent.futures import ALL_COMPLETED

import pytest

from turbogrpo.rollout.env_calls import EnvCallFailed, EnvCalls, EnvCallTimeout, run_awaited

STUCK = threading.Event()  # never set: a call waiting on it never returns


def stuck():
    STUCK.wait()


def test_a_call_past_its_time_limit_fails_and_frees_its_slot():
    calls = EnvCalls(max_workers=1, timeout_s=0.2)
    started = time.monotonic()
    hung, queued = calls.submit(stuck), calls.submit(lambda: "after")
    with pytest.raises(EnvCallTimeout, match=r"did not return within 0.2 s \(env.call_timeout_s\)"):
        calls.result(hung)
    assert calls.result(queued) == "after"  # the abandoned call's slot went to the queued one
    assert time.monotonic() - started < 5
    # Its thread is a daemon: the interpreter's exit never waits for it.
    assert all(t.daemon for t in threading.enumerate() if t.name == "turbogrpo-env-call")


def test_the_clock_starts_when_a_call_starts_not_when_it_is_queued():
    calls = EnvCalls(max_workers=1, timeout_s=0.5)
    futures = [calls.submit(time.sleep, 0.3) for _ in range(3)]  # 0.9 s in all, each within its 0.5 s
    calls.wait(futures, ALL_COMPLETED)
    assert [f.exception() for f in futures] == [None, None, None]


@pytest.mark.parametrize("exit_", [SystemExit(0), SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
def test_exits_and_interrupts_from_environment_code_are_that_calls_failure(exit_):
    def leaves():
        raise exit_
    with pytest.raises(EnvCallFailed, match=f"raised {type(exit_).__name__}"):
        EnvCalls(2, None).call(leaves)


def test_one_worker_runs_environment_code_serially():
    """A read-sleep-write counter: concurrent calls lose updates, one worker never does."""
    def count(state):
        seen = state["n"]
        time.sleep(0.002)
        state["n"] = seen + 1

    for workers, exact in ((1, True), (16, False)):
        state = {"n": 0}
        calls = EnvCalls(workers, None)
        calls.wait([calls.submit(count, state) for _ in range(31)], ALL_COMPLETED)
        assert (state["n"] == 31) is exact


def test_awaitable_results_are_awaited():
    async def judge(x):
        await asyncio.sleep(0)
        return x * 2
    assert EnvCalls(1, None).call(judge, 21) == 42
    assert run_awaited(judge, x=4) == 8


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="max_workers must be an integer >= 1"):
        EnvCalls(0)
    with pytest.raises(ValueError, match="time limit must be a number of seconds >= 0"):
        EnvCalls(1, -1)


def test_a_pool_travels_to_another_process_as_its_settings():
    """The asynchronous loop sends episodes (each holding the pool that times its get_reward) from the rollout
    worker to the trainer: the pool arrives as a fresh one with the same limits, and it works there."""
    import pickle

    calls = EnvCalls(max_workers=3, timeout_s=2.5)
    calls.call(lambda: None)
    copy = pickle.loads(pickle.dumps(calls))
    assert (copy.max_workers, copy.timeout_s) == (3, 2.5) and copy is not calls
    assert copy.call(lambda x: x + 1, 1) == 2
