"""Two gloo processes on CPU give what one process gives on the same global batch."""

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turbogrpo.algo import LOSSES
from turbogrpo.train.distributed import DistInfo
from turbogrpo.train.metrics import read_metrics

from . import dist_worker
from .tiny_run import write_model, write_rows

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
    assert {t.dtype for t in load_file(out / "step-000002" / "model.safetensors").values()} == {torch.float32}
    assert AutoModelForCausalLM.from_pretrained(out / "final", dtype="auto").dtype == torch.bfloat16
