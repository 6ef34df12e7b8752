"""The shipped hybrid demo model (scripts/build_demo_model.py --model demo-hybrid) and `turbogrpo demo --model
demo-hybrid`."""

import json

import pytest
import torch

from turbogrpo.cli import demo_config, main
from turbogrpo.models import DEMO_MODELS, demo_model_path, load_demo_model, resolve_model_path

from tests.train.conftest import single_thread  # noqa: F401 (autouse: the demo model runs fastest on one thread)


def test_the_hybrid_demo_model_is_a_small_qwen3_5_with_the_demo_tokenizer():
    model, tokenizer = load_demo_model("demo-hybrid")
    assert model.config.model_type == "qwen3_5_text"
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    assert tokenizer.get_vocab() == load_demo_model("demo")[1].get_vocab()
    folder = demo_model_path("demo-hybrid")
    assert resolve_model_path("demo-hybrid") == folder
    assert sum(f.stat().st_size for f in folder.iterdir()) < 10 * 2**20   # the package stays light


def test_the_hybrid_demo_model_records_its_build_and_held_out_accuracy():
    info = json.loads((demo_model_path("demo-hybrid") / "demo_info.json").read_text())
    assert info["build_config"]["architecture"] == "qwen3_5" and info["build_config"]["tokenizer_from"] == "demo"
    held_out = info["held_out_before_grpo"]
    k = info["build_config"]["eval_samples"]
    # GRPO can only teach what the policy samples: right and wrong answers both occur at temperature 1.
    assert 0 < held_out["pass@1_temperature1"] < held_out[f"pass@{k}_temperature1"] <= 1
    assert 0 <= held_out["greedy_accuracy"] <= 1


def test_an_unknown_demo_model_is_one_line():
    with pytest.raises(ValueError, match=r"demo model 'demo-mamba' is not one of demo, demo-hybrid"):
        demo_model_path("demo-mamba")
    assert DEMO_MODELS == ("demo", "demo-hybrid")


def test_the_hybrid_demo_runs_the_demo_with_its_model():
    hybrid, demo = demo_config(model="demo-hybrid"), demo_config()
    assert hybrid.model.path == "demo-hybrid" and hybrid.train.output_dir == "runs/demo_hybrid"
    assert (hybrid.algo, hybrid.rollout, hybrid.optim, hybrid.data) == (demo.algo, demo.rollout, demo.optim, demo.data)


def test_turbogrpo_demo_model_demo_hybrid_trains_and_reports(tmp_path, capsys):
    sets = ["train.num_steps=2", "train.prompts_per_step=2", "rollout.num_generations=2", "data.num_eval_problems=4",
            "data.num_eval_samples=1", "train.checkpoint_every=0", "log.progress_bar=false",
            f'train.output_dir="{tmp_path / "run"}"']
    assert main(["demo", "--model", "demo-hybrid", "--set", *sets]) == 0
    out = capsys.readouterr().out
    assert "2 steps in" in out and "The demo trained its model with GRPO" in out
    assert (tmp_path / "run" / "final" / "config.json").is_file() and any((tmp_path / "run" / "report").iterdir())


def test_the_warm_start_losses_agree_through_the_cache_and_the_shared_prefix_forward(monkeypatch):
    """scripts/shipped_model.py's two warm-start losses (the demo's through a repeated KV cache, the hybrid's through
    turbogrpo's shared-prefix forward) are one loss: equal on the demo model in float64."""
    import random
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import shipped_model
    from build_demo_model import TASK

    model, tokenizer = load_demo_model("demo", dtype="float64")
    problems = TASK.problems("train", 3, 0)
    prefix = torch.tensor(shipped_model.shared_prefix_ids(tokenizer, TASK.problems("train", 16, 0)))
    completions = [shipped_model.noisy_completion(p, random.Random(0), 0.3) for p in problems]
    batch = shipped_model.encode_batch(tokenizer, problems, completions, len(prefix))
    cached = shipped_model.sft_loss_cached(model, prefix, *batch, 1.0)
    shared = shipped_model.sft_loss_shared_prefix(model, prefix, *batch, 1.0)
    torch.testing.assert_close(torch.stack(shared), torch.stack(cached), rtol=0, atol=1e-10)
