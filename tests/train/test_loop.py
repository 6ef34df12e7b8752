"""End-to-end trainer runs on a tiny model: outputs, reward failures, NaN/inf stop, LoRA."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turbogrpo.algo import LOSSES
from turbogrpo.config import load_config
from turbogrpo.train import loop
from turbogrpo.train.loop import TrainingDiverged, train
from turbogrpo.cpu_capability import cpu_capability
from turbogrpo.train.machine_record import read_machine_records
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.state import RewardFailure

from .tiny_run import overrides, write_model, write_rows

STEP_KEYS = {"reward", "reward_std", "rewards/digit_share/mean", "rewards/digit_share/std", "kl", "clip_ratio/region",
             "entropy", "completion_length/mean", "time/rollout", "time/logprobs", "time/update", "tokens_per_s",
             "logprob_gap", "grad_norm", "lr", "loss"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("assets")
    return write_model(folder / "model"), write_rows(folder / "rows.jsonl")


def run(assets, out, **extra):
    model_dir, rows = assets
    return train(load_config(None, overrides(model_dir, rows, out, **extra)))


def test_short_training_writes_metrics_checkpoints_report_and_final_model(assets, tmp_path):
    summary = run(assets, tmp_path, **{"algo.beta": 0.05, "algo.num_iterations": 2, "log.tensorboard": "true"})
    assert summary.steps == 4 and [e["step"] for e in summary.evals] == [0, 4]
    records = read_metrics(tmp_path)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert STEP_KEYS <= record.keys()
        assert record["logprob_gap"] < 1e-4  # the sampler and the trainer saw the same weights
        # On-policy: every token drawn by the weights the update starts from, so weights exp(prox - behav) ~ 1.
        assert record["staleness/lag_mean"] == 0 and record["staleness/lag_max"] == 0
        assert abs(record["staleness/weight_mean"] - 1) < 1e-4 and abs(record["staleness/weight_max"] - 1) < 1e-3
        assert record["kl"] >= 0 and record["skipped_steps"] == 0
        assert "tis/weight_mean" not in record  # algo.tis_cap "auto": off where the native engine samples on-policy
        # The mismatch metrics: the same float32 forwards differ by rounding only; nothing masked with no correction.
        assert record["mismatch/abs_delta_mean"] == pytest.approx(record["logprob_gap"], rel=1e-4, abs=1e-9)
        quantiles = [record[f"mismatch/abs_delta_{q}"] for q in ("p50", "p99", "max")]
        assert 0 <= quantiles[0] <= quantiles[1] <= quantiles[2] < 1e-3
        assert 0 <= record["mismatch/k3_kl"] < 1e-8 and "mismatch/frac_tokens_masked" not in record
    assert steps[0]["kl"] < steps[-1]["kl"]  # the policy moves away from the reference
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 4]
    assert [r["step"] for r in records if "eval/sampled_accuracy" in r] == [0, 4]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000004"]
    assert {p.name for p in (tmp_path / "report").iterdir()} >= {"rewards.png", "phases.png", "training.png",
                                                                  "mismatch.png", "report.md"}
    assert "Sampler vs trainer: |Δ log p| mean" in (tmp_path / "report" / "report.md").read_text()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert {"logprob_gap", "mismatch/k3_kl", "mismatch/abs_delta_p99"} <= set(scalars)
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {2, 4} and {"prompt", "completion", "reward", "rewards"} <= samples[0].keys()
    machines = read_machine_records(tmp_path)  # the CPU capability every kernel choice saw, per start
    assert [m["step"] for m in machines] == [0] and machines[0]["cpu_capability"] == cpu_capability().record()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    trained = load_file(tmp_path / "step-000004" / "model.safetensors")
    for name, param in final.named_parameters():
        assert torch.equal(param, trained[name])


def test_failing_reward_is_counted_and_its_first_failure_printed(assets, tmp_path, capsys):
    summary = run(assets, tmp_path, **{"rewards.1.function": "tests.train.tiny_run:flaky", "rewards.1.fallback": -1.0,
                                        "train.num_steps": 2, "train.checkpoint_every": 0,
                                        "train.reward_failure_limit": 0})
    assert summary.steps == 2
    printed = [line for line in capsys.readouterr().out.splitlines() if "reward 'flaky'" in line]
    assert printed == ["warning: reward 'flaky' failed on 16 of 16 completions at step 1 (RuntimeError: reward "
                       "service unavailable); those get its fallback -1 (counted in metrics.jsonl as "
                       "rewards/<name>/num_failed; only the first failure of each function is printed)"]
    steps = [r for r in read_metrics(tmp_path) if "reward" in r]
    # Call 1 raises (all 16 items fall back), call 2 returns None for its first item.
    assert [r["rewards/flaky/num_failed"] for r in steps] == [16, 1]
    assert steps[0]["rewards/flaky/first_error"] == "RuntimeError: reward service unavailable"
    assert steps[0]["rewards/flaky/mean"] == -1.0


def test_a_megabyte_reward_error_is_printed_cut_and_logged_whole(assets, tmp_path, capsys):
    run(assets, tmp_path, **{"rewards.1.function": "tests.train.tiny_run:chatty", "train.num_steps": 1,
                             "train.checkpoint_every": 0, "train.reward_failure_limit": 0})
    printed = [line for line in capsys.readouterr().out.splitlines() if "reward 'chatty'" in line]
    assert len(printed) == 1 and len(printed[0]) < 1_000 and "1,400,014 characters in all" in printed[0]
    logged = [r for r in read_metrics(tmp_path) if "reward" in r][0]["rewards/chatty/first_error"]
    assert logged == "RuntimeError: " + "detail " * 200_000


def test_nonfinite_steps_are_skipped_then_the_run_stops_with_a_good_checkpoint(assets, tmp_path, monkeypatch):
    real_loss, real_step = LOSSES["dapo"], loop.grpo_step
    current = {}

    def step_recorder(run_, step):
        current["step"] = step
        return real_step(run_, step)

    def poisoned(*args, **kwargs):  # from the third step (index 2) on, the loss is NaN
        loss, metrics = real_loss(*args, **kwargs)
        return (loss * float("nan") if current["step"] >= 2 else loss), metrics

    monkeypatch.setitem(LOSSES, "dapo", poisoned)
    monkeypatch.setattr(loop, "grpo_step", step_recorder)
    with pytest.raises(TrainingDiverged, match=r"stopped at step 4: 2 optimizer steps in a row had NaN/inf"):
        run(assets, tmp_path, **{"train.checkpoint_every": 1, "train.keep_checkpoints": 5,
                                 "train.max_nonfinite_steps": 2})
    steps = [r for r in read_metrics(tmp_path) if "reward" in r]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1]  # step 4 stopped before logging
    assert (tmp_path / "latest").read_text() == "step-000004"
    good = load_file(tmp_path / "step-000002" / "model.safetensors")
    stopped = load_file(tmp_path / "step-000004" / "model.safetensors")
    assert all(torch.equal(good[name], stopped[name]) for name in good)  # skipped steps changed nothing
    assert json.loads((tmp_path / "step-000004" / "state.json").read_text())["extra"]["nonfinite_total"] == 2


def test_lora_trains_adapters_only_with_the_base_as_reference(assets, tmp_path):
    model_dir, _ = assets
    run(assets, tmp_path, **{"lora.enabled": "true", "lora.r": 4, "lora.alpha": 8, "algo.beta": 0.1,
                             "train.num_steps": 2, "train.checkpoint_every": 0, "optim.lr": 2e-2})
    saved = load_file(tmp_path / "step-000002" / "model.safetensors")
    assert saved and all("lora_" in name for name in saved)
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    steps = [r for r in read_metrics(tmp_path) if "reward" in r]
    assert steps[0]["kl"] < 1e-6 < steps[1]["kl"]  # adapters start at zero, so step 1 is the base model


@pytest.mark.parametrize("reward, message", [
    ("flaky", r"reward 'flaky' failed on 16 of 16 completions at step 1 \(RuntimeError: reward service unavailable\); "
              r"stopped, since train.reward_failure_limit = 1"),
    # R07: finite rewards whose float32 group std is inf would silently give every advantage 0.
    ("overflowing", r"the rewards at step 1 are too large for float32: their group means or stds overflow to inf, "
                    r"so the advantages would be 0 or NaN \(largest \|reward\| on this rank: 'overflowing' 3e\+38"),
])
def test_rewards_that_cannot_train_stop_the_run_before_any_update(assets, tmp_path, reward, message):
    extra = {"rewards.0.function": "tests.train.tiny_run:overflowing"} if reward == "overflowing" else \
        {"rewards.1.function": "tests.train.tiny_run:flaky"}
    with pytest.raises(RewardFailure, match=message):
        run(assets, tmp_path, **extra, **{"train.num_steps": 2, "train.checkpoint_every": 0, "data.eval_path": '""'})
    assert not [r for r in read_metrics(tmp_path) if "reward" in r]


def test_a_missing_answer_column_stops_the_run_instead_of_reporting_zero_accuracy(assets, tmp_path):
    model_dir, _ = assets
    rows = tmp_path / "no_answer.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Count to {i}:", "solution": str(i)}) + "\n" for i in range(8)))
    with pytest.raises(RewardFailure, match=r"held-out accuracy at step 0 cannot be measured: reward 'math_accuracy' "
                                            r"failed on 8 of 8 held-out answers \(ValueError: math_accuracy needs "
                                            r"the gold-answer column 'answer'"):
        train(load_config(None, overrides(model_dir, rows, tmp_path / "out", **{"data.num_eval_samples": 0})))
