"""`turbogrpo train` on tiny hybrid models, end to end on the native engine: single-turn runs (gated DeltaNet,
Mamba-2), and branching multi-turn conversations through the shipped multi-turn config, each step's sampler log-probs
the trainer's."""

from pathlib import Path

import torch

from tests.mixers.conftest import build_hybrid
from tests.train.test_multiturn_run import CONFIG as MULTITURN_CONFIG, one_thread, small  # noqa: F401 (a fixture)
from tests.train.tiny_run import char_tokenizer, overrides, write_rows
from turbogrpo.config import load_config
from turbogrpo.models import resolve_model_path
from turbogrpo.train import loop
from turbogrpo.train.metrics import read_metrics


def write_hybrid(folder: Path, model_type: str, tokenizer, ends_turns: bool = False) -> Path:
    """A tiny ``model_type`` with ``tokenizer``'s vocabulary; ``ends_turns``: its LM head draws the end-of-sequence
    token (the demo template's end of turn) about one draw in three, any other token uniformly, so that a random
    model's conversations get environment replies."""
    model = build_hybrid(model_type, torch.float32, vocab_size=len(tokenizer), max_position_embeddings=512)
    if ends_turns:
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.zero_()
            head[tokenizer.eos_token_id, 0] = 20.0   # above the others' 0 by log(V) where hidden[0] > ~0.3
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def trained_steps(run_dir: Path) -> list[dict]:
    return [record for record in read_metrics(run_dir) if "reward" in record]


def test_a_single_turn_run_trains_a_gated_deltanet_and_a_mamba2_hybrid(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl")
    for model_type in ("qwen3_5_text", "nemotron_h"):
        model_dir = write_hybrid(tmp_path / model_type, model_type, char_tokenizer())
        sets = overrides(model_dir, rows, tmp_path / f"run-{model_type}", **{
            "train.num_steps": 2, "data.num_eval_problems": 2, "train.checkpoint_every": 0, "log.report": "false"})
        summary = loop.train(load_config(None, sets))
        steps = trained_steps(tmp_path / f"run-{model_type}")
        assert summary.steps == 2 and len(steps) == 2, model_type
        assert all(record["logprob_gap"] < 1e-4 for record in steps), model_type


def test_a_branching_multiturn_run_trains_a_hybrid(tmp_path):
    """The shipped multi-turn config's conversations (the demo's tokenizer and chat template), forked 2 x 2, on a
    tiny Qwen3.5: the environment's replies go through the recurrent layers, forks copy their states."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("demo"))
    model_dir = write_hybrid(tmp_path / "model", "qwen3_5_text", tokenizer, ends_turns=True)
    summary = loop.train(load_config(MULTITURN_CONFIG, small(tmp_path / "run", **{
        "model.path": f'"{model_dir}"', "rollout.branching": "[2, 2]", "log.completions_every": 0})))
    steps = trained_steps(tmp_path / "run")
    assert summary.steps == 2 and len(steps) == 2
    for record in steps:
        assert record["env/env_tokens"] > 0 and record["env/failures"] == 0
        assert record["logprob_gap"] < 1e-4
