"""LoRA on tied layers: adapters on the tied LM head or on the embedding train on the native engine (with
``embed_tokens`` among the targets every engine stopped at the start with an AttributeError about
``num_embeddings``), the sampler's log-probs equal the trainer's, and the adapters change what is learned."""

import pytest
import torch

from turbogrpo.config import load_config
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics

from .tiny_run import overrides, write_model, write_rows


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head", "q_proj"]], ids=["embedding", "tied_head"])
def test_lora_on_a_tied_layer_trains_with_the_samplers_log_probs_equal_to_the_trainers(tmp_path, targets):
    model_dir, rows = write_model(tmp_path / "model", tie_word_embeddings=True), write_rows(tmp_path / "rows.jsonl")
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.tie_word_embeddings  # (the case at hand)
    sets = overrides(model_dir, rows, tmp_path / "out", **{
        "lora.enabled": "true", "lora.r": 4, "lora.target_modules": str(targets).replace("'", '"'),
        "train.num_steps": 3, "train.checkpoint_every": 0, "data.eval_path": '""', "optim.warmup_steps": 0})
    summary = train(load_config(None, sets))
    records = [r for r in read_metrics(tmp_path / "out") if "reward" in r]
    assert summary.steps == 3 and len(records) == 3
    assert all(r["logprob_gap"] < 1e-5 for r in records), [r["logprob_gap"] for r in records]
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) and r["grad_norm"] > 0 for r in records)
