"""Two gloo processes on CPU give what one process gives on the same global batch."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turbogrpo.algo import LOSSES
from turbogrpo.config import load_config
from turbogrpo.placement import DistInfo
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.output_dir import run_record
from turbogrpo.train.rank_agreement import describe_first_difference, training_keys

from . import dist_worker
from .test_resume import comparable
from .tiny_run import overrides, write_model, write_rows

REPO = Path(__file__).resolve().parents[2]
SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    model_dir, rows = write_model(out / "model"), write_rows(out / "rows.jsonl")
    mp.spawn(dist_worker.run, args=(2, free_ports(5), str(out), str(model_dir), str(rows)), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("run_name", [f"ddp-{name}" for name in sorted(LOSSES)] + ["fsdp2-dapo"])
def test_two_processes_equal_one_process_on_the_same_global_batch(two_ranks, run_name):
    strategy, loss_name = run_name.split("-", 1)
    expected_params, expected_metrics = dist_worker.two_updates(loss_name, "ddp", SINGLE)
    got_params = load_file(two_ranks / f"{run_name}.safetensors")
    got_metrics = json.loads((two_ranks / "metrics.json").read_text())[run_name]
    assert got_params.keys() == expected_params.keys()
    for name, value in expected_params.items():
        torch.testing.assert_close(got_params[name], value, rtol=1e-10, atol=1e-12, msg=name)
    for got, expected in zip(got_metrics, expected_metrics):
        for key, value in expected.items():
            if key != "num_micro_batches":  # some shares are counted in float32 (e.g. gspo's clip ratio)
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert got_metrics[0]["num_micro_batches"] == 3  # the shorter rank ran a zero-weight filler


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_whole_loop_runs_on_two_processes(two_ranks, strategy):
    out = two_ranks / f"train-{strategy}"
    steps = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == ([1, 2] if strategy == "ddp" else [1, 2, 3])  # fsdp2 was resumed
    assert all(r["logprob_gap"] < 1e-4 and r["kl"] >= 0 for r in steps)
    assert (out / "step-000002" / "rng-rank1.safetensors").is_file()
    assert (out / "latest").read_text() == ("step-000002" if strategy == "ddp" else "step-000003")
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_fsdp2_bf16_mixed_keeps_float32_shards_and_logs_the_gap_and_tis(two_ranks):
    out = two_ranks / "train-fsdp2-bf16"
    steps = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 < r["logprob_gap"] < 0.05  # both sample and train in bf16; the kernels still differ
        assert 0.9 < r["tis/weight_mean"] < 1.1 and 0 <= r["tis/frac_capped"] <= 1
        # The mismatch metrics over both ranks' tokens: the mean is the gap; truncation masks nothing.
        assert r["mismatch/abs_delta_mean"] == pytest.approx(r["logprob_gap"], rel=1e-4)
        assert 0 <= r["mismatch/abs_delta_p50"] <= r["mismatch/abs_delta_p99"] <= r["mismatch/abs_delta_max"]
        assert r["mismatch/k3_kl"] > 0 and r["mismatch/frac_tokens_masked"] == 0.0
    assert {t.dtype for t in load_file(out / "step-000002" / "model.safetensors").values()} == {torch.float32}
    assert AutoModelForCausalLM.from_pretrained(out / "final", dtype="auto").dtype == torch.bfloat16


# ~25 s on a quiet 2-core machine: 2 spawned ranks import, roll out and train one step
def test_multiturn_with_an_environment_on_two_processes(tmp_path):
    """DDP with an [env]: an update on a global batch of conversations equals one process's (environment ids
    masked on both), and the shipped multi-turn config trains a step on 2 ranks, each rolling out its own
    prompts' conversations with its own environments, both ranks holding the same (moved) parameters after it."""
    from .test_multiturn_training import multiturn_batch
    spawn_bounded(dist_worker.multiturn, (2, free_ports(2), str(tmp_path)), nprocs=2, timeout_s=180)
    expected_params, expected_metrics = dist_worker.two_updates("dapo", "ddp", SINGLE, multiturn_batch())
    got_params = load_file(tmp_path / "multiturn-update.safetensors")
    for name, value in expected_params.items():
        torch.testing.assert_close(got_params[name], value, rtol=1e-10, atol=1e-12, msg=name)
    for got, expected in zip(json.loads((tmp_path / "multiturn-update.json").read_text()), expected_metrics):
        for key in ("grad_norm", "num_tokens", "entropy"):
            if key in expected:
                assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-12), key

    initial = AutoModelForCausalLM.from_pretrained(REPO / "turbogrpo" / "assets" / "demo_model").state_dict()
    rollouts = [json.loads((tmp_path / f"rollout-step0-rank{r}.json").read_text()) for r in (0, 1)]
    assert [len(r["prompts"]) for r in rollouts] == [2, 2] and [len(r["completions"]) for r in rollouts] == [8, 8]
    assert not set(map(tuple, rollouts[0]["prompts"])) & set(map(tuple, rollouts[1]["prompts"]))  # own halves
    assert all(r["env_tokens"] > 0 for r in rollouts)  # each rank's environments replied (retries prefilled)
    ranks = [load_file(tmp_path / f"params-step1-rank{r}.safetensors") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), name   # DDP: one update on both ranks
    assert any(not torch.equal(ranks[0][name], value) for name, value in initial.items() if name in ranks[0])
    steps = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert [r["step"] for r in steps] == [1]
    for record in steps:
        assert record["env/failures"] == 0 and record["env/env_tokens"] > 0 and record["logprob_gap"] < 1e-4


# 2 ranks and 2 rollout workers, twice, on 2 cores (the local run is also the per-rank worker check: one run, not two)
def test_each_rank_pairs_with_the_remote_worker_of_its_rank_as_with_its_local_one(tmp_path):
    """DDP, k = 1. With local workers, every rank's worker draws its own prompts one update behind, and every rank's
    checkpoint part holds the version its in-flight rollout samples with (the same weights on both ranks: one DDP
    update). With train.rollout_worker = "remote", rank r pairs with the worker started with `--rank r` (each pair a
    group of its own beside the ranks' gloo group), and the run equals the one with local workers bit for bit."""
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    spawn_bounded(dist_worker.asynchronous, (2, free_ports(1), str(tmp_path), str(model_dir), str(rows)), nprocs=2,
                  timeout_s=300)
    steps = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert [r["staleness/lag_max"] for r in steps] == [0.0, 1.0, 1.0]
    parts = [load_file(tmp_path / "run" / "step-000002" / f"extra-rank{r}.safetensors") for r in (0, 1)]
    assert parts[0] and parts[0].keys() == parts[1].keys() and all(k.startswith("v1/") for k in parts[0])
    assert all(torch.equal(parts[0][k], parts[1][k]) for k in parts[0])

    master, rollout = free_ports(2)
    config = tmp_path / "run.toml"
    config.write_text("# everything is set on the command line\n")
    sets = overrides(model_dir, rows, tmp_path / "remote", **dist_worker.ASYNCHRONOUS,
                     **dist_worker.remote_workers(rollout))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    workers = [subprocess.Popen([sys.executable, "-m", "turbogrpo", "rollout-worker", str(config), "--trainer",
                                 f"127.0.0.1:{rollout}", "--rank", str(rank), "--set", *sets], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        spawn_bounded(dist_worker.asynchronous, (2, [master], str(tmp_path), str(model_dir), str(rows), rollout),
                      nprocs=2, timeout_s=300)
        for worker in workers:
            _, err = worker.communicate(timeout=60)
            assert worker.returncode == 0, err[-3000:]
    finally:
        for worker in workers:
            worker.kill()
    local, remote = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "remote")
    assert [r["staleness/lag_max"] for r in remote if "reward" in r] == [0.0, 1.0, 1.0]
    assert comparable(local) == comparable(remote)


def spawn_bounded(fn, args, nprocs: int, timeout_s: float) -> None:
    """``mp.spawn(fn, args, nprocs)``, failing (its processes ended) when it is not done in ``timeout_s``: a
    rank left waiting in a collective must fail the test, not hang the suite."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} ranks not done after {timeout_s:.0f} s (one waits in a collective?)")


def test_ranks_that_disagree_refuse_to_start_naming_the_first_differing_key(tmp_path):
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    cases = dist_worker.DISAGREEMENTS
    spawn_bounded(dist_worker.disagreeing, (2, free_ports(len(cases)), str(tmp_path), str(model_dir), str(rows)),
                  nprocs=2, timeout_s=120)
    shown = {"optim.lr": "config key 'optim.lr' differs (rank 0 0.003, rank 1 0.001)",
             "data.num_train_problems": "config key 'data.num_train_problems' differs (rank 0 2000, rank 1 100)",
             "rewards.0.weight": "config key 'rewards.0.weight' differs (rank 0 1.0, rank 1 2.0)",
             "rollout.num_generations": "config key 'rollout.num_generations' differs (rank 0 4, rank 1 2)",
             "rows": "the content of data.path (its fingerprint) differs (rank 0 '"}
    for case, difference in shown.items():
        messages = [(tmp_path / f"{case}-rank{rank}.txt").read_text() for rank in (0, 1)]
        assert messages[0] == messages[1], case  # both ranks stop, with the same line
        reports = [(tmp_path / f"{case}-rank{rank}-reports.txt").read_text() for rank in (0, 1)]
        assert reports == ["True", "False"], case  # which rank 0 alone prints
        assert messages[0].startswith(f"the 2 ranks do not train with the same settings: {difference}"), messages[0]
        assert "\n" not in messages[0]
        assert not (tmp_path / case).exists() or not any((tmp_path / case).iterdir())  # refused before any output


def test_rank_local_keys_do_not_count_and_every_training_key_is_named_by_its_set_name(tmp_path):
    base = load_config(None, ["train.num_threads=1", "log.progress_bar=true"])
    local = load_config(None, ["train.num_threads=2", "log.progress_bar=false", "log.tensorboard=false"])
    assert training_keys(run_record(base)) == training_keys(run_record(local))
    changed = load_config(None, ["rewards.0.weight=0.5", "algo.epsilon_high=0.3"])
    keys_a, keys_b = training_keys(run_record(base)), training_keys(run_record(changed))
    assert [k for k in keys_a if keys_a[k] != keys_b[k]] == ["rewards.0.weight", "algo.epsilon_high"]  # config order
    assert describe_first_difference([keys_a, keys_b]).startswith(
        "the 2 ranks do not train with the same settings: config key 'rewards.0.weight' differs "
        "(rank 0 1.0, rank 1 0.5)")
    assert describe_first_difference([keys_a, {**keys_a, "extra.key": 1}]).startswith(
        "the 2 ranks do not train with the same settings: config key 'extra.key' differs (rank 0 has none, rank 1 1)")
