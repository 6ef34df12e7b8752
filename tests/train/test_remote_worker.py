"""train.rollout_worker = "remote": the rollout worker started with ``turbogrpo rollout-worker`` (here a subprocess
pointed at 127.0.0.1 and a free port, standing in for another machine), over torch.distributed. Real runs of the
tiny model (CPU, a few steps); no timing asserts."""

import signal
import socket
import subprocess
import sys
import time
import typing

import pytest
import torch
from safetensors.torch import load_file

from turbogrpo.batch import Groups
from turbogrpo.config import TrainConfig, load_config
from turbogrpo.rollout import Rollout
from turbogrpo.rollout.types import RolloutStats
from turbogrpo.train import wire
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.remote_transport import first_difference
from turbogrpo.train.rollout_worker import TRANSPORTS, RolloutWorkerError

from .test_async import ASYNC, restore_threads  # (restore_threads: a fixture)
from .test_resume import REPO, at_first_checkpoint, command, comparable, subprocess_run_setup
from .tiny_run import overrides


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def remote(port: int, **extra) -> dict:
    return {**ASYNC, "train.rollout_worker": '"remote"', "train.rollout_port": port,
            "train.rollout_connect_timeout_s": 60, **extra}


def said(err: str) -> list[str]:
    """The lines a turbogrpo process says itself (not a library's warnings)."""
    return [line for line in err.splitlines() if line.startswith("turbogrpo: ")]


def start_worker(config, sets: list[str], env: dict, port: int) -> subprocess.Popen:
    """``turbogrpo rollout-worker`` for trainer rank 0 at 127.0.0.1:``port``, in its own process."""
    return subprocess.Popen([sys.executable, "-m", "turbogrpo", "rollout-worker", str(config), "--trainer",
                             f"127.0.0.1:{port}", "--set", *sets], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_transports_are_the_settings_values():
    assert set(TRANSPORTS) == set(typing.get_args(typing.get_type_hints(TrainConfig)["rollout_worker"]))


def test_a_rollout_crosses_the_wire_bit_for_bit():
    """Every Groups field a worker sends (mixed dtypes, an empty completion, host and device tensors alike) comes
    back with the same bits, shapes and dtypes; a header naming another dtype is refused."""
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(0, 50, (n,), generator=gen) for n in (3, 0, 5, 1)]
    groups = Groups([torch.arange(4), torch.arange(7)], completions, (2, 2), finish_reasons=["stop", "length"] * 2,
                    sampler_logps=[torch.randn(c.numel(), generator=gen) for c in completions],
                    model_mask=[torch.rand(c.numel(), generator=gen) > 0.5 for c in completions],
                    prompt_hidden=[torch.randn(4, 3, generator=gen).bfloat16(), torch.randn(7, 3).bfloat16()])
    groups = groups.at_version(6)
    stats = RolloutStats(num_forwards=4, num_generated_tokens=9, wall_time_s=0.5, live_batch_sizes=[4, 2])
    frame = wire.encode(wire.rollout_message(3, Rollout(groups, stats)))
    message = wire.decode(frame.header, frame.payload.clone(), torch.device("cpu"))
    back = wire.rollout_of(message)
    assert message.header["step"] == 3 and back.stats == stats
    assert back.groups.sizes == (2, 2) and back.groups.finish_reasons == groups.finish_reasons
    for name in ("prompts", "completions", "sampler_logps", "model_mask", "versions", "prompt_hidden"):
        for sent, got in zip(getattr(groups, name), getattr(back.groups, name), strict=True):
            assert got.dtype == sent.dtype and torch.equal(got.view(-1).view(torch.uint8),
                                                           sent.contiguous().view(-1).view(torch.uint8)), name
    forged = frame.header.numpy().tobytes().replace(b'"torch.int64"', b'"torch.complex64"')
    with pytest.raises(ValueError, match="complex64"):
        wire.decode(torch.frombuffer(bytearray(forged), dtype=torch.uint8), frame.payload, torch.device("cpu"))


def test_the_first_differing_sampling_setting_is_named_as_its_config_key():
    trainer = {"model": {"dtype": "float32"}, "rollout": {"temperature": 1.0, "top_p": 1.0}, "seed": 0}
    assert first_difference(trainer, trainer) == ""
    assert first_difference(trainer, {**trainer, "rollout": {"temperature": 0.7, "top_p": 1.0}}) == (
        "config key 'rollout.temperature' is 1.0 in the trainer's run and 0.7 here")
    assert first_difference(trainer, {**trainer, "seed": 1}) == (
        "config key 'train.seed' is 0 in the trainer's run and 1 here")


def test_a_remote_worker_draws_the_run_of_the_local_one_bit_for_bit(tmp_path, restore_threads):
    """k = 1, 3 steps: the worker in another process started by the CLI (weights, requests and rollouts over gloo)
    gives the metrics and final weights of the local worker exactly: a step's rollout depends only on its prompts,
    seed and version. The worker exits 0 once the trainer is done."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    port = free_port()
    # (model.linear_kernel "auto" picks a kernel by timing each process's own matmuls: fixed here, as timing is not
    # what this test compares)
    extra = {"train.num_steps": 3, "train.checkpoint_every": 0, "algo.num_iterations": 2,
             "model.linear_kernel": '"module"'}
    train(load_config(None, overrides(model_dir, rows, tmp_path / "local", **{**ASYNC, **extra})))
    sets = overrides(model_dir, rows, tmp_path / "remote", **remote(port, **extra))
    worker = start_worker(config, sets, env, port)
    try:
        train(load_config(None, sets))
        _, err = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-3000:]
    assert said(err)[-1] == "turbogrpo: rollout worker of rank 0: stopped; it stops", err[-3000:]
    local, far = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "remote")
    assert [r["staleness/lag_max"] for r in far if "reward" in r] == [0.0, 2.0, 2.0]
    assert comparable(local) == comparable(far)
    final_local = load_file(tmp_path / "local" / "step-000003" / "model.safetensors")
    final_far = load_file(tmp_path / "remote" / "step-000003" / "model.safetensors")
    assert final_local.keys() == final_far.keys()
    for name in final_local:
        assert torch.equal(final_local[name], final_far[name]), name


def test_a_trainer_whose_worker_never_comes_stops_with_one_line(tmp_path, restore_threads):
    model_dir, rows, _, _ = subprocess_run_setup(tmp_path)
    port = free_port()
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(port, **{"train.rollout_connect_timeout_s": 1}))
    with pytest.raises(RolloutWorkerError) as err:
        train(load_config(None, sets))
    message = str(err.value)
    assert message.startswith(f"no rollout worker connected to rank 0 (port {port}) within 1 s") and "\n" not in message


def test_a_worker_with_other_sampling_settings_is_refused_on_both_sides(tmp_path, restore_threads):
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    port = free_port()
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(port))
    worker = start_worker(config, [*sets, "rollout.temperature=0.5"], env, port)
    try:
        with pytest.raises(RolloutWorkerError) as err:
            train(load_config(None, sets))
        _, worker_err = worker.communicate(timeout=120)
    finally:
        worker.kill()
    expected = "config key 'rollout.temperature' is 1.0 in the trainer's run and 0.5 here"
    assert "refused this run: " + expected in str(err.value) and "\n" not in str(err.value)
    assert worker.returncode == 2 and said(worker_err)[-1] == (f"turbogrpo: error: {expected}; start the rollout "
                                                               "worker with the run's config"), worker_err[-3000:]


def endless_remote_run(tmp_path) -> tuple[subprocess.Popen, subprocess.Popen]:
    """A worker and its trainer (each its own process) in a run of endless tiny steps, after its first checkpoint
    (in tmp_path/out)."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    port = free_port()
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(port, **{"train.num_steps": 1_000_000,
                                                                          "train.checkpoint_every": 1,
                                                                          "data.eval_path": '""'}))
    worker = start_worker(config, sets, env, port)
    return worker, at_first_checkpoint(command(config, sets), env)


@pytest.mark.parametrize("killed, how", [("worker", signal.SIGKILL), ("trainer", signal.SIGKILL),
                                         ("worker", signal.SIGTERM)], ids=["worker", "trainer", "worker_sigterm"])
def test_a_side_killed_mid_run_ends_the_other_with_one_line(tmp_path, killed, how):
    """SIGKILL of the worker: the trainer stops with one RolloutWorkerError line, no hang; SIGTERM (or Ctrl-C) of the
    worker: the same, saying so. SIGKILL of the trainer: the worker sees its connection close and exits by itself."""
    worker, trainer = endless_remote_run(tmp_path)
    try:
        (worker if killed == "worker" else trainer).send_signal(how)
        survivor = trainer if killed == "worker" else worker
        _, err = survivor.communicate(timeout=120)
    finally:
        for child in (worker, trainer):
            child.kill()
    assert survivor.returncode == 1, err[-3000:]
    last = said(err)[-1]
    assert "Traceback" not in err, err[-3000:]
    if how == signal.SIGTERM:
        assert last.startswith("turbogrpo: the rollout worker (rank 0's, ") and last.endswith(
            "'s rollout: interrupted (Ctrl-C or SIGTERM on its machine)"), err[-3000:]
    elif killed == "worker":
        assert last.startswith("turbogrpo: the rollout worker (rank 0's, ") and " is gone " in last, err[-3000:]
    else:
        assert "the trainer is gone" in last, err[-3000:]
    assert list((tmp_path / "out").glob("step-*"))  # (the run had checkpointed; keep_checkpoints may have moved on)


def test_sigterm_reaches_a_trainer_waiting_for_a_worker_that_hangs(tmp_path):
    """The worker stopped (SIGSTOP: a hung machine) while the trainer waits for its rollout: SIGTERM still stops the
    trainer at once (exit 143, naming its checkpoint), as it stops one waiting for a local worker."""
    worker, trainer = endless_remote_run(tmp_path)
    try:
        worker.send_signal(signal.SIGSTOP)
        time.sleep(3)  # a tiny step takes well under a second: the trainer now waits for the next rollout
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=60)
    finally:
        for child in (worker, trainer):
            child.kill()
    assert trainer.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in said(err)[-1] and "step-" in said(err)[-1], err[-3000:]


@pytest.mark.slow
def test_sigterm_then_resume_with_a_new_worker_repeats_the_uninterrupted_run(tmp_path, restore_threads):
    """k = 1, SIGTERM after the checkpoint at step 2: the trainer exits 143 and tells its worker to stop (0); the
    resumed trainer sends a new worker the checkpoint's in-flight version before its own, and ends bit for bit
    where an uninterrupted run (with the local worker) ends."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    port = free_port()
    extra = {"train.num_steps": 4, "train.checkpoint_every": 2, "model.linear_kernel": '"module"'}
    sets = overrides(model_dir, rows, tmp_path / "stopped", **remote(port, **extra))
    worker = start_worker(config, sets, env, port)
    try:
        trainer = at_first_checkpoint(command(config, sets), env)
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 143 and "step-000002" in said(err)[-1], err[-3000:]
        _, worker_err = worker.communicate(timeout=60)
        assert worker.returncode == 0, worker_err[-3000:]
        worker = start_worker(config, sets, env, port)
        resumed = subprocess.run(command(config, sets, "--resume"), cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        _, worker_err = worker.communicate(timeout=60)
        assert worker.returncode == 0, worker_err[-3000:]
    finally:
        worker.kill()
    train(load_config(None, overrides(model_dir, rows, tmp_path / "straight", **{**ASYNC, **extra})))
    final_stopped = load_file(tmp_path / "stopped" / "step-000004" / "model.safetensors")
    final_straight = load_file(tmp_path / "straight" / "step-000004" / "model.safetensors")
    for name in final_straight:
        assert torch.equal(final_stopped[name], final_straight[name]), name
    assert comparable(read_metrics(tmp_path / "stopped")) == comparable(read_metrics(tmp_path / "straight"))
