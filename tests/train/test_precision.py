"""Mixed precision: float32 masters with bf16 compute learn at GRPO learning rates, match a float32 step
within bf16 tolerance, export in the asked dtype; pure bf16 is an opt-in that warns."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turbogrpo.algo import LOSSES, LossNormalizer
from turbogrpo.config import AlgoConfig
from turbogrpo.config import load_config
from turbogrpo.models import tiny_model
from turbogrpo.prefix import compute_logprobs
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics
from turbogrpo.batch import length_mask, pad_ragged
from turbogrpo.train.precision import PURE_BF16_WARNING, run_precision

from .conftest import random_step_batch
from .tiny_run import overrides, write_model, write_rows

# lr 1e-6 (TRL's default): an update of ~1e-6 on a weight of ~0.02 is under half of bf16's spacing there.
SMALL_LR = {"optim.lr": 1e-6, "train.num_steps": 3, "train.checkpoint_every": 0, "data.num_eval_problems": 2,
            "data.num_eval_samples": 0, "log.completions_every": 0, "log.report": "false"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("assets")
    return write_model(folder / "model"), write_rows(folder / "rows.jsonl")


def changed_share(model_dir, out):
    """Share of the weights that differ from the start after the run, and the saved weights' dtypes."""
    start = load_file(model_dir / "model.safetensors")
    end = load_file(out / "step-000003" / "model.safetensors")
    changed = sum(int((end[k] != start[k].to(end[k].dtype)).sum()) for k in start)  # (pure bf16 loads rounded)
    return changed / sum(t.numel() for t in start.values()), {t.dtype for t in end.values()}


def test_bf16_mixed_learns_at_a_small_lr_like_float32_and_pure_bf16_warns(assets, tmp_path):
    model_dir, rows = assets
    shares = {}
    for name, extra in {"float32": {}, "bfloat16": {"model.dtype": "bfloat16"},
                        "pure": {"model.dtype": "bfloat16", "model.pure_bf16": "true"}}.items():
        config = load_config(None, overrides(model_dir, rows, tmp_path / name, **SMALL_LR, **extra))
        if name == "pure":
            with pytest.warns(UserWarning, match="model.pure_bf16 = true"):
                train(config)
        else:
            train(config)
        shares[name] = changed_share(model_dir, tmp_path / name)
    assert shares["float32"][1] == shares["bfloat16"][1] == {torch.float32}  # checkpoints hold float32 masters
    assert shares["pure"][1] == {torch.bfloat16}
    assert shares["float32"][0] > 0.99
    assert shares["bfloat16"][0] > 0.99, shares  # (the bf16 parameters of the past: under 1%)
    assert shares["pure"][0] < 0.2, shares  # the rounding the warning is about
    gaps = [r["logprob_gap"] for r in read_metrics(tmp_path / "bfloat16") if "logprob_gap" in r]
    assert len(gaps) == 3 and all(0 <= g < 0.05 for g in gaps)  # sampler and trainer both compute in bf16

    # final/ is exported in the run's compute dtype and declares it, so dtype="auto" loads it as saved.
    assert json.loads((tmp_path / "bfloat16" / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16" / "final", dtype="auto")
    masters = load_file(tmp_path / "bfloat16" / "step-000003" / "model.safetensors")
    assert final.dtype == torch.bfloat16
    for name, param in final.named_parameters():
        assert torch.equal(param, masters[name].to(torch.bfloat16)), name


def test_final_dtype_overrides_the_export(assets, tmp_path):
    model_dir, rows = assets
    train(load_config(None, overrides(model_dir, rows, tmp_path, **{
        **SMALL_LR, "model.dtype": "bfloat16", "train.final_dtype": "float32", "train.num_steps": 1})))
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype="auto")
    assert final.dtype == torch.float32


def one_step(model, batch, precision):
    """Loss and parameter gradients of one dapo step of ``batch`` under ``precision``."""
    model.zero_grad(set_to_none=True)
    forward = precision.computing(compute_logprobs)
    result = forward(model, batch.prompts, batch.nested(), share_prefix=True)
    logps = batch.per_completion(result.logps)
    mask_BL = length_mask([t.numel() for t in logps], device=logps[0].device)
    loss, _ = LOSSES["dapo"](pad_ragged(logps), pad_ragged([t.float() for t in batch.old_logps]), None,
                             batch.advantages.float(), mask_BL, LossNormalizer.for_batch(mask_BL, 16),
                             AlgoConfig())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_one_bf16_mixed_step_matches_float32_within_bf16_tolerance():
    """Each precision against a float32 truth: bf16 compute rounds to ~3 significant digits, so the
    loss and every gradient agree to a few 1e-3 (relative), far outside float32's 1e-6."""
    model = tiny_model("qwen2", vocab_size=64, hidden=64, layers=2, seed=5)
    batch = random_step_batch([9, 5], [[4, 7, 3], [6, 2]], vocab=64, seed=1, logp_center=-4.0, logp_spread=0.3)
    truth_loss, truth_grads = one_step(model, batch, run_precision("float32"))
    loss, grads = one_step(model, batch, run_precision("bfloat16"))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters stay float32
    assert all(g.dtype == torch.float32 for g in grads.values())
    torch.testing.assert_close(loss, truth_loss, rtol=2e-2, atol=1e-3)
    assert loss != truth_loss  # bf16 did compute
    for name, truth in truth_grads.items():
        error = (grads[name] - truth).norm() / truth.norm()
        assert error < 3e-2, (name, float(error))


def test_run_precision_table():
    assert run_precision("float32").param_dtype == torch.float32 and not run_precision("float32").mixed
    mixed = run_precision("bfloat16")
    assert (mixed.param_dtype, mixed.compute_dtype) == (torch.float32, torch.bfloat16)
    pure = run_precision("bfloat16", pure_bf16=True)
    assert (pure.param_dtype, pure.compute_dtype, pure.mixed) == (torch.bfloat16, torch.bfloat16, False)
    assert "rounds away" in PURE_BF16_WARNING
