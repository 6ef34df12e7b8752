"""`turbogrpo train` with an environment that never returns: SIGTERM and Ctrl-C still end the run as they do
elsewhere (its checkpoint named, exit status 143 or 130), the stuck environment thread abandoned."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.test_multiturn_run import CONFIG, REPO, one_thread, small  # noqa: F401 (autouse fixture: restores torch threads)
from turbogrpo.config import load_config
from turbogrpo.env.tasks import RetryArithmetic
from turbogrpo.train import loop
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.state import RewardFailure

DEFAULT_SIGINT_THEN_CLI = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                           "runpy.run_module('turbogrpo', run_name='__main__', alter_sys=True)")
"""``python -m turbogrpo`` with Python's own SIGINT handler installed first: a shell without job control starts
a background job with SIGINT ignored (`make test &`, checked: its Python reports SIG_IGN), an ignored signal
stays ignored across exec, and Python keeps it, so the Ctrl-C case would sit until the timeout."""

HANGING_ENV = '''
import os, pathlib, threading
from turbogrpo.env.tasks import RetryArithmetic

class HangsAfterACheckpoint(RetryArithmetic):
    """RetryArithmetic until the run has saved a checkpoint; then reply() never returns."""

    def reply(self, message):
        run = pathlib.Path(os.environ["HANG_RUN_DIR"])
        if any(run.glob("step-*")):
            (run.parent / "stuck").touch()
            threading.Event().wait()
        return super().reply(message)
'''


@pytest.mark.parametrize("signum, status, how", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                 (signal.SIGINT, 130, "interrupted")])
def test_a_stuck_environment_cannot_keep_a_signalled_run_alive(tmp_path, signum, status, how):
    (tmp_path / "hanging_env.py").write_text(HANGING_ENV)
    run = tmp_path / "run"
    sets = small(run, **{"train.num_steps": 3, "train.checkpoint_every": 1, "data.num_eval_problems": 2,
                         "env.factory": '"hanging_env:HangsAfterACheckpoint"', "env.call_timeout_s": 0})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "HANG_RUN_DIR": str(run),
           "OMP_WAIT_POLICY": "PASSIVE", "PYTHONFAULTHANDLER": "1"}
    # Ctrl-C's default handler in the child whatever the suite's process did to SIGINT: an ignored signal stays
    # ignored across exec, and Python then installs no KeyboardInterrupt handler (after the vLLM tests the run
    # sat in a plain lock wait that SIGINT never interrupted).
    process = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGINT_THEN_CLI, "train", str(CONFIG), "--set", *sets],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "stuck").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the environment never got stuck"
            time.sleep(0.2)
        process.send_signal(signum)
        try:
            _, stderr = process.communicate(timeout=60)  # before: the pool waited for the stuck thread forever
        except subprocess.TimeoutExpired:  # still alive: every thread's stack (faulthandler on SIGABRT) says where
            process.send_signal(signal.SIGABRT)
            pytest.fail(f"the run outlived {signum.name} by 60 s; its threads:\n{process.communicate(timeout=30)[1]}")
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == status, stderr
    checkpoint = run / "step-000001"
    assert f"turbogrpo: {how} at step 1; continue with" in stderr and str(checkpoint) in stderr, stderr


def test_every_conversation_failing_stops_the_run_naming_the_environment_method(tmp_path):
    """GuessNumber on the arithmetic rows (no 'secret' column): every reset() raises; the stop names it, not
    a reward that "returned None"."""
    config = load_config(CONFIG, small(tmp_path / "run", **{"env.factory": '"turbogrpo.env.tasks:GuessNumber"',
                                                            "train.num_steps": 1}))
    with pytest.raises(RewardFailure) as stop:
        loop.train(config)
    message = str(stop.value)
    assert "(item 0: GuessNumber: reset() raised ValueError: GuessNumber needs a row with a 'secret'" in message
    assert "returned None" not in message


class DictReply(RetryArithmetic):
    """Every other environment (by creation) answers with a dict instead of a string."""
    made = 0

    def __init__(self):
        super().__init__()
        DictReply.made += 1
        self.broken = DictReply.made % 2 == 0

    def reply(self, message):
        return {"text": "Wrong."} if self.broken else super().reply(message)


def test_environment_failures_reach_the_log_and_completions_jsonl(tmp_path, capsys):
    DictReply.made = 0
    extras = {"env.factory": '"tests.train.test_multiturn_faults:DictReply"', "train.num_steps": 1,
              "log.num_completions": 8, "rollout.temperature": 1.0, "algo.loss": '"grpo"'}
    loop.train(load_config(CONFIG, small(tmp_path / "run", **extras)))
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    errors = [s.get("env_error") for s in samples]
    assert "reply() returned a dict, not a str or None" in errors
    assert all(e in (None, "reply() returned a dict, not a str or None") for e in errors)
    record = next(r for r in read_metrics(tmp_path / "run") if "reward" in r)
    assert record["env/failures"] > 0
    assert "DictReply: reply() returned a dict, not a str or None" in record["rewards/environment/first_error"]
    console = capsys.readouterr().out  # the console warnings (tqdm.write)
    assert "DictReply: reply() returned a dict" in console
    assert "conversations failed at step 1 (first: reply() returned a dict, not a str or None)" in console
