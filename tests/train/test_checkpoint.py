"""Checkpoints: safetensors + JSON round trip (no pickle), atomic replacement, pruning."""

import errno
import json
import random

import numpy as np
import pytest
import torch

from turbogrpo.models import tiny_model
from turbogrpo.placement import DistInfo
from turbogrpo.train import checkpoint as ckpt

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def trained_pair(seed=0):
    model = tiny_model("qwen2", vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=1, seed=seed,
                       tie_word_embeddings=True)
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim > 1]},
                                   {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.99))
    for _ in range(2):
        model(torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_round_trip_restores_model_optimizer_rng_and_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("checkpoints must never be unpickled"))
    model, optimizer = trained_pair()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    path = ckpt.save_checkpoint(tmp_path, 3, model, optimizer, {"data": {"epoch": 1, "position": 5}}, SINGLE)
    expected_draws = draws()
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_state = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
                      for k, v in optimizer.state_dict()["state"].items()}

    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "optimizer.safetensors",
                                                      "rng-rank0.json", "rng-rank0.safetensors", "state.json"]
    assert ckpt.latest_checkpoint(tmp_path) == path

    fresh, fresh_optimizer = trained_pair(seed=1)  # different weights and moments
    resumed = ckpt.load_checkpoint(path, fresh, fresh_optimizer, SINGLE)
    assert resumed.step == 3 and resumed.state == {"data": {"epoch": 1, "position": 5}}
    assert draws() == expected_draws
    for name, param in fresh.named_parameters():
        assert torch.equal(param, expected_params[name]), name
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # ties survive the round trip
    state = fresh_optimizer.state_dict()["state"]
    assert state.keys() == expected_state.keys()
    for k in state:
        for kk in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[k][kk], expected_state[k][kk])
    assert fresh_optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert fresh_optimizer.param_groups[1]["weight_decay"] == 0.0


def test_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained_pair()
    first = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE)
    real_save = ckpt.save_tensors

    def crash_on_optimizer(tensors, path):
        if path.name == "optimizer.safetensors":
            raise KeyboardInterrupt("killed mid-write")
        real_save(tensors, path)

    monkeypatch.setattr(ckpt, "save_tensors", crash_on_optimizer)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C (or SIGTERM) mid-write: the half-written folder goes
        ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE)
    assert not (tmp_path / ".tmp-step-000002").exists() and not (tmp_path / "step-000002").exists()
    assert ckpt.latest_checkpoint(tmp_path) == first
    (tmp_path / ".tmp-step-000002").mkdir()  # what a SIGKILL mid-write leaves: debris ...
    (tmp_path / ".tmp-step-000002" / "model.safetensors").write_bytes(b"half")
    assert ckpt.latest_checkpoint(tmp_path) == first  # ... that is ignored

    monkeypatch.setattr(ckpt, "save_tensors", real_save)
    second = ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE)
    assert ckpt.latest_checkpoint(tmp_path) == second
    assert not (tmp_path / ".tmp-step-000002").exists()


def test_latest_pointer_to_a_missing_folder_falls_back_to_the_newest_complete_one(tmp_path):
    model, optimizer = trained_pair()
    ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE, keep=5)
    second = ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE, keep=5)
    (tmp_path / "latest").write_text("step-000009")
    assert ckpt.latest_checkpoint(tmp_path) == second


def test_old_checkpoints_are_pruned(tmp_path):
    model, optimizer = trained_pair()
    for step in range(1, 5):
        ckpt.save_checkpoint(tmp_path, step, model, optimizer, {}, SINGLE, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000004"]


def test_resume_with_another_world_size_is_refused(tmp_path):
    model, optimizer = trained_pair()
    path = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE)
    state = json.loads((path / "state.json").read_text())
    state["world_size"] = 2
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="written by 2 processes"):
        ckpt.load_checkpoint(path, model, optimizer, SINGLE)


def test_pruning_keeps_checkpoints_that_are_not_this_runs(tmp_path):
    model, optimizer = trained_pair()
    later = ckpt.save_checkpoint(tmp_path, 7, model, optimizer, {}, SINGLE)  # e.g. left by a resumed-from-5 run
    for step in range(1, 4):
        ckpt.save_checkpoint(tmp_path, step, model, optimizer, {}, SINGLE, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003", later.name]
    assert (tmp_path / "latest").read_text() == "step-000003"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000003"  # not the later one


def truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


@pytest.mark.parametrize("damage, bad_file, problem", [
    (truncate, "model.safetensors", "is missing, truncated or corrupt"),
    (truncate, "optimizer.safetensors", "is missing, truncated or corrupt"),
    (truncate, "state.json", "is truncated or corrupt"),
    (lambda path: path.write_text(""), "rng-rank0.json", "is truncated or corrupt"),
    (lambda path: path.unlink(), "rng-rank0.safetensors", "is missing, truncated or corrupt"),
])
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage, bad_file, problem):
    model, optimizer = trained_pair()
    first = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE)
    second = ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE)
    assert ckpt.checkpoint_problem(second) is None
    damage(second / bad_file)
    notices = []
    assert ckpt.latest_checkpoint(tmp_path, notice=notices.append) == first
    assert len(notices) == 1
    assert notices[0].startswith(f"checkpoint {second} is unusable: {second / bad_file} {problem} (")
    assert notices[0].endswith("); trying the one before it")
    assert ckpt.checkpoint_problem(second).startswith(f"{second / bad_file} {problem}")
    ckpt.load_checkpoint(first, model, optimizer, SINGLE)  # the fallback loads


def test_non_finite_weights_are_never_saved(tmp_path):
    model, optimizer = trained_pair()
    first = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE)
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(ckpt.CheckpointError, match=r"not saving checkpoint .*step-000002: the weights are not finite "
                                                    r"\(inf/NaN in model.norm.weight\); the previous checkpoint "
                                                    r".*step-000001 and the `latest` pointer are intact"):
        ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE)
    assert not (tmp_path / "step-000002").exists() and ckpt.latest_checkpoint(tmp_path) == first


def test_a_full_disk_during_a_checkpoint_says_the_previous_one_is_intact(tmp_path, monkeypatch):
    model, optimizer = trained_pair()
    first = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE)

    def disk_full(tensors, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "save_tensors", disk_full)
    with pytest.raises(ckpt.CheckpointError, match=r"could not write checkpoint .*step-000002 \(No space left on "
                                                    r"device: .*rng-rank0.safetensors\); the previous checkpoint "
                                                    r".*step-000001 and the `latest` pointer are intact. Free space"):
        ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE)
    assert not (tmp_path / ".tmp-step-000002").exists() and ckpt.latest_checkpoint(tmp_path) == first


def test_a_full_disk_inside_safetensors_is_one_line_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
    from safetensors import SafetensorError
    model, optimizer = trained_pair()
    first = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, SINGLE)

    def disk_full(tensors, path):  # what safetensors raises when the disk fills up (not an OSError)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr("turbogrpo.files.save_file", disk_full)
    with pytest.raises(ckpt.CheckpointError, match=r"could not write checkpoint .*step-000002 \(No space left on "
                                                    r"device: .*rng-rank0.safetensors\); the previous checkpoint "):
        ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, SINGLE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    assert ckpt.latest_checkpoint(tmp_path) == first
