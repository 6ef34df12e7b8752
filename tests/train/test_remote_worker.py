"""train.rollout_worker = "remote": the rollout worker started with ``turbogrpo rollout-worker`` (here a subprocess
pointed at 127.0.0.1 and a free port, standing in for another machine), over torch.distributed. Real runs of the
tiny model (CPU, a few steps); no timing asserts."""

import datetime
import json
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
from turbogrpo.data import PromptExample
from turbogrpo.env import EnvRollout, Episode, environment_reward
from turbogrpo.rollout import Rollout
from turbogrpo.rollout.multiturn import MultiTurnRollout, MultiTurnStats
from turbogrpo.rollout.types import RolloutStats
from turbogrpo.train.worker import wire
from turbogrpo.train.worker.partial_rollouts import PendingGroup
from turbogrpo.train.worker.protocol import Drawn, Request
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.worker.remote import first_difference
from turbogrpo.train.worker.rollout_worker import TRANSPORTS, RolloutWorkerError

from .test_async import ASYNC, restore_threads  # (restore_threads: a fixture)
from .test_multiturn_run import final_weights, small
from .test_partial_rollouts import demo as partial_demo
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
    forged = frame.header.replace(b'"torch.int64"', b'"torch.complex64"')
    with pytest.raises(ValueError, match="complex64"):
        wire.decode(forged, frame.payload, torch.device("cpu"))


def crossed(message: wire.Message) -> wire.Message:
    frame = wire.encode(message)
    return wire.decode(frame.header, frame.payload.clone(), torch.device("cpu"))


def assert_same_examples(got: list[PromptExample], sent: list[PromptExample]) -> None:
    assert len(got) == len(sent)
    for a, b in zip(got, sent):
        assert (a.text, a.index, a.columns, a.messages) == (b.text, b.index, b.columns, b.messages)
        assert torch.equal(a.token_ids, b.token_ids)


class Scored:
    """An environment whose reward is given (None: its get_reward() raises)."""

    def __init__(self, value):
        self.value = value

    def get_reward(self):
        if self.value is None:
            raise RuntimeError("no answer to score")
        return self.value


def test_rows_episodes_and_carried_generations_cross_the_wire():
    """What an [env] or partial-rollouts run sends its remote worker and gets back: the prompts' rows (columns,
    chat messages), a checkpoint's carried pool (ids, log-probs, versions bit for bit), the episodes as records whose
    rewards, failures, messages and counters are the episodes' own (each get_reward() read on the worker's side),
    and multi-turn stats. A column JSON cannot hold is refused naming it; an environment's other attributes say
    where the environment is."""
    examples = [PromptExample("Q1", torch.tensor([5, 6, 7]), {"answer": "4", "tags": ["a", 1]}, 3,
                              ({"role": "user", "content": "Q1"},)),
                PromptExample("Q2", torch.tensor([8]), {"answer": "9"}, 7, None)]
    gen = torch.Generator().manual_seed(0)
    pool = [PendingGroup(examples[1], 2, [torch.tensor([1, 2]), torch.tensor([3])],
                         [torch.randn(2, generator=gen), torch.randn(1, generator=gen)],
                         [torch.tensor([4, 6]), torch.tensor([6])], ["stop", None])]
    request = wire.request_of(crossed(wire.request_message(Request(4, 123, 3, [e.token_ids for e in examples],
                                                                   examples, 2, pool), with_rows=True)))
    assert (request.step, request.seed, request.version, request.num_groups) == (4, 123, 3, 2)
    assert_same_examples(request.examples, examples)
    assert_same_examples([g.example for g in request.carried], [examples[1]])
    for name in ("tokens", "logps", "versions"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(request.carried[0], name), getattr(pool[0], name)))
    assert request.carried[0].reasons == ["stop", None] and request.carried[0].started == 2

    completions = [torch.tensor([9, 9, 1]), torch.tensor([2])]
    groups = Groups([examples[0].token_ids], completions, (2,), finish_reasons=["stop", "length"],
                    sampler_logps=[torch.randn(3, generator=gen), torch.randn(1, generator=gen)],
                    model_mask=[torch.tensor([True, False, True]), torch.tensor([True])])
    stats = MultiTurnStats(num_generated_tokens=3, num_env_tokens=1, num_turns=3, turn_prefill_tokens=[2])
    episodes = [Episode(Scored(value), {}, None, None, None, 2, [{"role": "assistant", "content": text}],
                        num_turns=turns, num_tool_calls=calls, error=error)
                for value, text, turns, calls, error in [(1.0, "4", 2, 1, None), (None, "?", 1, 0, "reset() raised")]]
    multiturn = MultiTurnRollout(groups, stats, [2, 1], [None, "reset() raised"], episodes)
    drawn = Drawn(Rollout(groups, stats), EnvRollout(multiturn, episodes, ["<p>"], {"env/turns": 1.5}), examples, pool)
    back = wire.drawn_of(crossed(wire.drawn_message(5, drawn)))
    assert type(back.rollout.stats) is MultiTurnStats and back.rollout.stats == stats
    assert back.rollout.groups.finish_reasons == groups.finish_reasons
    assert all(torch.equal(a, b) for a, b in zip(back.rollout.groups.model_mask, groups.model_mask))
    records = back.episodes.episodes
    assert repr(environment_reward(None, None, environments=records)) == repr(
        environment_reward(None, None, environments=episodes)) == "[1.0, ItemFailure('Scored: reset() raised')]"
    assert [r.failure for r in records] == [e.failure for e in episodes] == [None, "reset() raised"]
    assert [(r.messages, r.num_turns, r.num_tool_calls) for r in records] == [
        (e.messages, e.num_turns, e.num_tool_calls) for e in episodes]
    assert back.episodes.metrics == {"env/turns": 1.5} and back.episodes.prompt_texts == ["<p>"]
    assert back.episodes.rollout.errors == [None, "reset() raised"] and back.episodes.rollout.num_turns == [2, 1]
    assert records[0].env.get_reward() == 1.0
    with pytest.raises(AttributeError, match="Scored.value: the environment lives on the remote rollout worker"):
        records[0].env.value
    assert_same_examples(back.examples, examples)
    assert_same_examples([g.example for g in back.carried], [examples[1]])

    dated = [PromptExample("Q", torch.tensor([1]), {"when": datetime.date(2026, 1, 1)}, 11)]
    with pytest.raises(ValueError, match="column 'when' of row 11 cannot travel to a remote rollout worker"):
        wire.request_message(Request(0, 0, 0, [torch.tensor([1])], dated), with_rows=True)


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


# env_conversations: slow (env_forked_tree_sharing and env_speculative send the same conversations and records)
@pytest.mark.parametrize("config, tree", [
    pytest.param("demo_multiturn.toml", {}, marks=pytest.mark.slow),
    ("demo_multiturn.toml", {"train.sharing": '"tree"', "rollout.branching": "[2, 2]"}),
    ("demo.toml", {}),
    ("demo.toml", {"train.partial_rollouts": 0, "rollout.speculation": '"fixed"'}),
    ("demo_multiturn.toml", {"rollout.speculation": '"fixed"', "draft.learn": "false"}),
], ids=["env_conversations", "env_forked_tree_sharing", "partial_rollouts", "speculative", "env_speculative"])
def test_a_remote_worker_draws_the_local_ones_conversations_and_partial_rollouts_bit_for_bit(tmp_path, restore_threads,
                                                                                             config, tree):
    """k = 1 on the shipped configs: the multi-turn one (each conversation's environment lives and is scored on the
    worker's machine; the trainer gets records), also forked and trained as a tree, the single-turn one with
    partial rollouts (c = 1: the pool travels with every batch) and with speculative rollouts (the draft the trainer
    teaches travels with each version). Metrics, logged completions (env errors included) and final weights equal
    the local worker's run."""
    _, _, _, env = subprocess_run_setup(tmp_path)
    port = free_port()

    def sets(name: str, where: dict) -> list[str]:
        extra = {**where, **tree, "model.linear_kernel": '"module"', "train.save_final_model": "true",
                 "train.eval_every": 0, "log.completions_every": 1}
        if config == "demo.toml":
            return partial_demo(tmp_path / name, **extra)
        return small(tmp_path / name, **{**ASYNC, **extra})

    train(load_config(REPO / "configs" / config, sets("local", {})))
    far = sets("remote", remote(port))
    worker = start_worker(REPO / "configs" / config, far, env, port)
    try:
        train(load_config(REPO / "configs" / config, far))
        _, err = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-3000:]
    local, remote_run = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "remote")
    assert len(local) > 1 and comparable(local) == comparable(remote_run)
    if "rollout.speculation" in tree:  # (a draft learns where there is no environment)
        assert all("spec/accepted_length" in r and (r.get("draft/tokens", 0) > 0) == (config == "demo.toml")
                   for r in remote_run if "reward" in r)
    elif config == "demo.toml":
        assert max(r.get("staleness/lag_mean", 0) for r in remote_run) > 0  # carried generations were trained
    else:
        assert all(r["env/env_tokens"] > 0 for r in remote_run if "reward" in r)  # environments replied
    assert (tmp_path / "local" / "completions.jsonl").read_text() == (tmp_path / "remote" / "completions.jsonl").read_text()
    weights_local, weights_remote = final_weights(tmp_path / "local"), final_weights(tmp_path / "remote")
    assert weights_local.keys() == weights_remote.keys()
    assert all(torch.equal(weights_local[k], weights_remote[k]) for k in weights_local)


def test_a_trainer_whose_worker_never_comes_stops_with_one_line(tmp_path, restore_threads):
    model_dir, rows, _, _ = subprocess_run_setup(tmp_path)
    port = free_port()
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(port, **{"train.rollout_connect_timeout_s": 1}))
    with pytest.raises(RolloutWorkerError) as err:
        train(load_config(None, sets))
    message = str(err.value)
    assert message.startswith(f"no rollout worker connected to rank 0 (port {port}) within 1 s") and "\n" not in message


def refused_on_both_sides(config, sets: list[str], worker_sets: list[str], env: dict, port: int):
    """Train ``sets`` beside a worker started with ``worker_sets``, which the run refuses: the trainer's
    RolloutWorkerError, and the worker's exit status and stderr."""
    worker = start_worker(config, worker_sets, env, port)
    try:
        with pytest.raises(RolloutWorkerError) as err:
            train(load_config(None, sets))
        _, worker_err = worker.communicate(timeout=120)
    finally:
        worker.kill()
    return err.value, worker.returncode, worker_err


def test_a_worker_with_other_sampling_settings_is_refused_on_both_sides(tmp_path, restore_threads):
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    port = free_port()
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(port))
    err, returncode, worker_err = refused_on_both_sides(config, sets, [*sets, "rollout.temperature=0.5"], env, port)
    expected = "config key 'rollout.temperature' is 1.0 in the trainer's run and 0.5 here"
    assert "refused this run: " + expected in str(err) and "\n" not in str(err)
    assert returncode == 2 and said(worker_err)[-1] == (f"turbogrpo: error: {expected}; start the rollout "
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


# whole rollouts: slow (the partial-rollouts case runs the same stop, new worker and in-flight version, and sends
# the carried generations besides)
@pytest.mark.parametrize("partial", [pytest.param(0, marks=pytest.mark.slow), 1], ids=["whole_rollouts", "partial_rollouts"])
def test_sigterm_then_resume_with_a_new_worker_repeats_the_uninterrupted_run(tmp_path, restore_threads, partial):
    """k = 1, SIGTERM after the checkpoint at step 2: the trainer exits 143 and tells its worker to stop (0); the
    resumed trainer sends a new worker the checkpoint's in-flight version before its own (with partial rollouts, the
    generations carried into step 3, in its first request), and ends bit for bit where an uninterrupted run (with
    the local worker) ends."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    port = free_port()
    extra = {"train.num_steps": 4, "train.checkpoint_every": 2, "model.linear_kernel": '"module"',
             "train.partial_rollouts": partial}
    sets = overrides(model_dir, rows, tmp_path / "stopped", **remote(port, **extra))
    worker = start_worker(config, sets, env, port)
    try:
        trainer = at_first_checkpoint(command(config, sets), env)
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 143 and "step-000002" in said(err)[-1], err[-3000:]
        _, worker_err = worker.communicate(timeout=60)
        assert worker.returncode == 0, worker_err[-3000:]
        if partial:  # the pool carried into step 3, which the new worker's first request brings it
            saved = json.loads((tmp_path / "stopped" / "step-000002" / "rng-rank0.json").read_text())
            assert saved["extra"]["carried"], saved["extra"]
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
