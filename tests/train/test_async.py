"""The asynchronous loop (train.max_staleness = k > 0): a rollout worker process draws step t+1 while step t
updates. Real runs of the tiny and the demo model (CPU, 2-3 steps); no timing asserts (the machine is shared)."""

import json
import os
import pickle
import queue
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turbogrpo.config import EnvConfig, LoraConfig, ModelConfig, RolloutConfig, load_config
from turbogrpo.placement import DistInfo, thread_split
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.worker.rollout_worker import WorkerSpec, _worker_main
from turbogrpo.train.worker.weight_ring import WeightRing, sampling_version
from turbogrpo.train.worker.local import SharedMemoryLink
from turbogrpo.train.worker.protocol import WorkerFailed

from .test_resume import at_first_checkpoint, command, comparable, subprocess_run_setup
from .tiny_run import overrides, write_model, write_rows

REPO = Path(__file__).resolve().parents[2]
ASYNC = {"train.max_staleness": 1, "train.num_threads": 1, "train.rollout_threads": 1}  # algo.tis_cap "auto": 2


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the runs set train.num_threads = 1 in this process


def stepped(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "reward" in r]


def test_sampling_versions_lag_by_k_after_the_first_k_steps():
    assert [sampling_version(s, 1) for s in range(4)] == [0, 0, 1, 2]
    assert [sampling_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]
    assert thread_split(0, 0, cores=2) == (1, 1) and thread_split(0, 0, cores=16) == (8, 8)
    assert thread_split(3, 0, cores=16) == (3, 8) and thread_split(0, 2, cores=16) == (14, 2)


def test_the_ring_keeps_k_plus_one_versions_apart():
    context = torch.multiprocessing.get_context("spawn")
    param = torch.zeros(3)
    ring = WeightRing({"w": param}, 2, context)
    for version in range(3):
        ring.publish(version, {"w": torch.full((3,), float(version))})
    target = torch.empty(3)
    ring.load_into(2, {"w": target}, alive=lambda: None)
    assert target.tolist() == [2.0] * 3 and ring.published.value == 2
    ring.load_into(1, {"w": target}, alive=lambda: None)   # the previous version is still there (k = 1)
    assert target.tolist() == [1.0] * 3
    saved = ring.state([1])
    ring.publish(3, {"w": torch.full((3,), 3.0)})          # overwrites version 1's slot
    ring.restore(saved, [1])
    ring.load_into(1, {"w": target}, alive=lambda: None)
    assert target.tolist() == [1.0] * 3


def test_k1_first_step_is_the_on_policy_step_then_every_token_lags_by_the_update(tmp_path, restore_threads,
                                                                                 monkeypatch):
    """k = 1: step 1 is drawn from version 0 with step 1's seed, exactly as the on-policy loop draws it (the
    worker's model and engine sample like the trainer's); steps 2 and 3 sample one GRPO step behind, which is
    algo.num_iterations = 2 optimizer steps, and the correction's weights move off 1."""
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    extra = {"train.num_steps": 3, "algo.num_iterations": 2, "train.checkpoint_every": 0, "algo.tis_cap": 2,
             "train.num_threads": 1}
    from turbogrpo.train import loop
    with monkeypatch.context() as patch:  # k = 0 starts no worker process
        patch.setattr(loop, "RolloutWorker", lambda *a, **k: pytest.fail("a rollout worker at k = 0"))
        train(load_config(None, overrides(model_dir, rows, tmp_path / "k0", **extra)))
    train(load_config(None, overrides(model_dir, rows, tmp_path / "k1", **{**extra, **ASYNC})))
    k0, k1 = stepped(tmp_path / "k0"), stepped(tmp_path / "k1")
    first = comparable([k0[0], k1[0]])
    assert first[0] == first[1], {k: (first[0][k], first[1].get(k)) for k in first[0] if first[0][k] != first[1].get(k)}
    assert [r["staleness/lag_max"] for r in k1] == [0.0, 2.0, 2.0]
    assert [r["staleness/lag_mean"] for r in k1] == [0.0, 2.0, 2.0]
    assert [r["staleness/lag_max"] for r in k0] == [0.0, 0.0, 0.0]
    # On-policy the behaviour weight is 1 within the sampler-trainer gap; one update behind it is not.
    assert all(abs(r["staleness/weight_max"] - 1) < 1e-4 for r in k0)
    assert all(abs(r["tis/weight_mean"] - 1) < 1e-4 for r in k0)  # over the scored tokens, whatever was skipped
    assert all(r["staleness/weight_max"] > 1 + 1e-3 for r in k1[1:])
    assert k1[1]["reward"] != k0[1]["reward"] or k1[1]["loss"] != k0[1]["loss"]  # step 2 drew from older weights
    assert "time/weight_push" in k1[1]


# single_turn and multi_turn: slow (speculative_cost_sizing and multi_turn_tree_sharing run the same configs and
# settings, each with one feature more)
@pytest.mark.parametrize("config, extra", [
    pytest.param("demo.toml", {"train.prompts_per_step": 4, "data.num_eval_problems": 4, "data.num_eval_samples": 1},
                 marks=pytest.mark.slow),
    pytest.param("demo_multiturn.toml", {}, marks=pytest.mark.slow),
    ("demo_multiturn.toml", {"train.sharing": '"tree"', "rollout.branching": "[2, 2]"}),
    ("demo.toml", {"train.prompts_per_step": 4, "data.num_eval_problems": 4, "data.num_eval_samples": 1,
                   "rollout.speculation": '"cost"'}),  # as configs/longform.toml (whose model is built by a script)
], ids=["single_turn", "multi_turn", "multi_turn_tree_sharing", "speculative_cost_sizing"])
def test_max_staleness_1_runs_the_shipped_demo_configs(tmp_path, restore_threads, config, extra):
    from .test_multiturn_run import small
    sets = small(tmp_path / "run", **{**ASYNC, "train.save_final_model": "false", **extra})
    if config == "demo.toml":  # (small() cuts the multi-turn config; these are the single-turn one's)
        sets = [s for s in sets if not s.startswith(("env.", "data.num_train_problems"))]
    summary = train(load_config(REPO / "configs" / config, sets))
    records = stepped(tmp_path / "run")
    assert summary.steps == 2 and [r["step"] for r in records] == [1, 2]
    assert [r["staleness/lag_max"] for r in records] == [0.0, 1.0]
    assert records[1]["staleness/weight_max"] != 1.0
    assert all("tis/weight_mean" in r for r in records)  # algo.tis_cap = "auto" corrects stale rollouts
    if "rollout.speculation" in extra:  # the worker drafts (its own cost-model profile), the trainer teaches it
        assert all(r["draft/tokens"] > 0 and "spec/tree_size" in r for r in records)  # (trees where they pay)
    elif config != "demo.toml":
        assert all(r["env/env_tokens"] > 0 for r in records)  # conversations with environment replies


@pytest.mark.parametrize("variant", ["speculative", "lora"])
def test_the_worker_samples_with_exactly_the_version_the_trainer_published(tmp_path, restore_threads, variant):
    """k = 1: step 3's rollout was drawn by the worker with version 1. Replayed here without a worker, from the
    run's checkpoint at step 1 (that version), it gives the same completions, and a wrong version other ones:

    * speculative (fixed sizing, the draft learning in the trainer): version 1 is the policy after one update and
      the draft after one lesson (their weights travel together); the speculation figures are equal too, and the
      initial draft (what the worker would hold had the draft's weights not travelled) gives other completions;
    * LoRA (the adapters are the trainable parameters that travel; a learning rate that moves samples in one
      step): version 0's adapters give other completions."""
    from turbogrpo.rewards import build_rewards
    from turbogrpo.placement import join_job
    from turbogrpo.train.draft_learning import speculation_metrics
    from turbogrpo.train.loop import begin_step, sample
    from turbogrpo.train.run import build_run
    from turbogrpo.train.output_dir import run_record
    from turbogrpo.train.state import start
    extra = ({"rollout.speculation": '"fixed"'} if variant == "speculative" else
             {"lora.enabled": "true", "lora.r": 4, "optim.lr": 3e-3, "optim.warmup_steps": 0})
    sets = [f"{k}={v}" for k, v in {
        **ASYNC, **extra, "train.num_steps": 3, "train.prompts_per_step": 4,
        "train.checkpoint_every": 1, "train.keep_checkpoints": 3, "train.save_final_model": "false",
        "model.linear_kernel": '"module"',
        "log.completions_every": 1, "log.num_completions": 32, "log.progress_bar": "false", "log.tensorboard": "false",
        "log.report": "false", "data.num_eval_problems": 4, "data.num_eval_samples": 1,
        "train.output_dir": f'"{tmp_path / "run"}"'}.items()]
    train(load_config(REPO / "configs" / "demo.toml", sets))
    record = stepped(tmp_path / "run")[2]
    assert record["staleness/lag_max"] == 1.0 and (variant == "lora" or record["draft/tokens"] > 0)
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    drawn = [sample["completion"] for sample in logged if sample["step"] == 3]
    for name in ("step-000002", "step-000003"):  # the replays resume the checkpoint at step 1
        shutil.rmtree(tmp_path / "run" / name)
    (tmp_path / "run" / "latest").write_text("step-000001")
    shutil.copytree(tmp_path / "run", tmp_path / "again")

    def replayed(wrong: bool) -> tuple[list[str], dict]:
        """Step 3's rollout drawn in this process from version 1 (``wrong``: the initial draft, or version 0)."""
        folder = tmp_path / ("again" if wrong else "run")
        config = load_config(REPO / "configs" / "demo.toml", [*sets, f'train.output_dir="{folder}"'])
        torch.set_num_threads(1)  # the worker's (train.rollout_threads)
        run = build_run(config, join_job("cpu", "gloo"), build_rewards(config.rewards),
                        run_record(config))
        initial = {k: v.clone() for k, v in run.draft.draft.state_dict().items()} if run.draft is not None else None
        state = start(run, resume=not (wrong and variant == "lora"))  # no worker: the step samples itself
        if wrong and initial is not None:
            run.draft.draft.load_state_dict(initial)
        for _ in range(2 - state.step):  # up to step 3's prompts
            next(run.batches)
        data = sample(run, begin_step(run, 2))
        return run.tokenizer.batch_decode(data.batch.completions, skip_special_tokens=True), \
            speculation_metrics(data.rollout.stats)

    texts, figures = replayed(wrong=False)
    assert texts == drawn and len(drawn) == 32
    assert {k: v for k, v in figures.items() if k != "time/draft_forward"} == {
        k: v for k, v in record.items() if k.startswith("spec/")}
    assert replayed(wrong=True)[0] != drawn


def test_a_worker_that_raises_sends_one_line_naming_its_error():
    """The worker's own loop (run in this process): a model that cannot be built comes back as one line."""
    reader, writer = torch.multiprocessing.get_context("spawn").Pipe(duplex=False)
    spec = WorkerSpec(ModelConfig(path="/nonexistent/model"), LoraConfig(), RolloutConfig(), EnvConfig(), 0, 1, 1, 1)
    dist = DistInfo(0, 1, 0, torch.device("cpu"))
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        _worker_main(spec, dist, SharedMemoryLink(None, queue.Queue(), writer, os.getppid()))
    finally:  # the worker's own handlers (Ctrl-C ignored, SIGTERM as SystemExit) must not stay in the suite
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    message = pickle.loads(reader.recv_bytes())
    assert isinstance(message, WorkerFailed) and "/nonexistent/model" in message.error and "\n" not in message.error


def workers_of(pid: int) -> list[int]:
    """The rollout worker processes of ``pid``: its spawned children (not multiprocessing's resource tracker)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
        except OSError:
            continue
    return found


def gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by its (dead) parent's reaper
            return True
        time.sleep(0.2)
    return False


# off: slow (the fixed-speculation case runs the same SIGTERM, checkpoint and resume, with the draft in flight too)
@pytest.mark.parametrize("speculation", [pytest.param("off", marks=pytest.mark.slow), "fixed"])
def test_sigterm_ends_the_worker_too_and_a_resumed_run_repeats_the_uninterrupted_one(tmp_path, restore_threads,
                                                                                     speculation):
    """k = 1, SIGTERM after the checkpoint at step 2: exit status 143, the checkpoint named, no worker left; the
    checkpoint holds the weights step 3's in-flight rollout was drawn from (with speculation, its draft's too), and
    the resumed run (which draws it again from them) ends bit for bit where an uninterrupted run ends."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    extra = {**ASYNC, "train.num_steps": 4, "train.checkpoint_every": 2, "rollout.speculation": f'"{speculation}"',
             "model.linear_kernel": '"module"'}
    stopped_dir = tmp_path / "stopped"
    sets = overrides(model_dir, rows, stopped_dir, **extra)
    child = at_first_checkpoint(command(config, sets), env)
    workers = workers_of(child.pid)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "step-000002" in err.strip().splitlines()[-1], err[-3000:]
    assert workers and all(gone(pid) for pid in workers)
    saved = load_file(stopped_dir / "step-000002" / "extra-rank0.safetensors")
    in_flight = [name for name in saved if name.startswith("v1/")]  # step 3 samples with version 1
    assert in_flight and all(name.startswith(("v1/", "draft/", "optimizer/", "sizing/")) for name in saved)
    assert any(name.startswith("v1/draft/") for name in in_flight) == (speculation != "off")

    resumed = subprocess.run(command(config, sets, "--resume"), cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight_dir = tmp_path / "straight"
    train(load_config(None, overrides(model_dir, rows, straight_dir, **extra)))
    final_stopped = load_file(stopped_dir / "step-000004" / "model.safetensors")
    final_straight = load_file(straight_dir / "step-000004" / "model.safetensors")
    for name in final_straight:
        assert torch.equal(final_stopped[name], final_straight[name]), name
    assert comparable(read_metrics(stopped_dir)) == comparable(read_metrics(straight_dir))


def test_a_worker_killed_mid_run_stops_the_run_with_one_line_naming_it(tmp_path):
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    sets = overrides(model_dir, rows, tmp_path / "out", **{**ASYNC, "train.num_steps": 1_000_000,
                                                            "train.checkpoint_every": 1, "data.eval_path": '""'})
    child = at_first_checkpoint(command(config, sets), env)
    workers = workers_of(child.pid)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    _, err = child.communicate(timeout=300)
    assert workers and child.returncode != 0, err[-3000:]
    assert "the rollout worker (turbogrpo-rollout-rank0" in err and "died with exit code -9" in err, err[-3000:]
