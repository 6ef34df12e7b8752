"""Every shipped config's task (configs/) trained for one step on the shipped hybrid demo model (a Qwen3.5-shaped
gated-DeltaNet hybrid): single-turn, multi-turn with branching through the trie forward, LoRA with a KL term,
bf16 with activation checkpointing, and one asynchronous (k = 1) run. Sizes are cut to the bone; what each case
changes beyond that says why (the demo tokenizer has no ChatML tokens)."""

import json
from pathlib import Path

import pytest

from turbogrpo.config import load_config
from turbogrpo.models import resolve_model_path
from turbogrpo.train import loop
from turbogrpo.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

TINY = {"train.num_steps": 1, "train.prompts_per_step": 1, "rollout.num_generations": 2,
        "rollout.max_new_tokens": 6, "data.num_train_problems": 8, "data.num_eval_problems": 1,
        "data.num_eval_samples": 0, "train.checkpoint_every": 0, "train.num_threads": 1,
        "log.progress_bar": "false", "log.tensorboard": "false", "log.report": "false", "log.completions_every": 0}
CONVERSATIONS = {"env.max_turns": 2, "env.max_turn_tokens": 6, "env.max_conversation_tokens": 32,
                 "rollout.branching": "[1, 2]", "train.sharing": '"tree"'}   # a fork after the first reply, one trie
DEMO_TEMPLATE = {"env.chat_template": '"demo"', "env.end_of_turn": '""'}     # ChatML's <|im_end|> is no demo token

CASES = {
    "demo.toml": {},
    # The demo's answers end within 32 tokens, so a wrong one gets a reply and the conversation forks (with these
    # weights and seed it does; test_hybrid_run.py holds replies and forks on a hybrid whatever the weights).
    "demo_multiturn.toml": {**CONVERSATIONS, "env.max_turn_tokens": 32, "env.max_conversation_tokens": 80},
    "gsm8k.toml": {"model.device": '"cpu"', "data.max_prompt_tokens": 256},          # bf16, checkpointing kept
    "gsm8k_lora_ddp.yaml": {"model.device": '"cpu"', "data.max_prompt_tokens": 256},  # LoRA, beta > 0, 1 rank
    "longform.toml": {},   # a neural draft head learning online, its chains verified on the hybrid
    "smollm2_arithmetic.toml": {},
    "smollm2_calculator.toml": {**CONVERSATIONS, **DEMO_TEMPLATE, "env.tool_parser": '"hermes"'},  # the template's calls
    "smollm2_gsm8k.toml": {"data.max_prompt_tokens": 256},                          # checkpointing kept
    "smollm2_guess_number.toml": {**CONVERSATIONS, **DEMO_TEMPLATE},
}
ASYNC = {"train.max_staleness": 1, "train.rollout_threads": 1}


def write_gsm8k(path: Path) -> Path:
    rows = [{"question": f"Tom has {n} apples and buys {n + 1} more. How many apples does he have?",
             "answer": f"{n}+{n + 1}={2 * n + 1}\n#### {2 * n + 1}"} for n in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sets_for(name: str, tmp_path: Path, extra: dict) -> list[str]:
    sets = {**TINY, "model.path": '"demo-hybrid"', "train.output_dir": f'"{tmp_path / "run"}"', **CASES[name], **extra}
    if load_config(CONFIGS / name).data.kind == "gsm8k":   # the configs read GSM8K beside the checkout
        rows = write_gsm8k(tmp_path / "gsm8k.jsonl")
        sets.update({"data.path": f'"{rows}"', "data.eval_path": f'"{rows}"'})
    return [f"{key}={value}" for key, value in sets.items()]


def test_every_shipped_config_has_a_case():
    assert sorted(path.name for path in CONFIGS.iterdir()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_shipped_config_trains_the_hybrid_demo_model(name, tmp_path):
    config = load_config(CONFIGS / name, sets_for(name, tmp_path, {}))
    assert resolve_model_path(config.model.path).name == "demo_hybrid_model"
    summary = loop.train(config)
    steps = [record for record in read_metrics(tmp_path / "run") if "reward" in record]
    assert summary.steps == 1 and len(steps) == 1, name
    tolerance = 1e-2 if config.model.dtype == "bfloat16" else 1e-4   # sampler vs trainer, in the run's dtype
    assert steps[0]["logprob_gap"] < tolerance, (name, steps[0]["logprob_gap"])
    if config.env.factory:
        assert steps[0]["env/failures"] == 0, name


def test_the_longform_config_speculates_with_neural_chains_on_the_hybrid_and_the_draft_learns(tmp_path):
    """Two steps of configs/longform.toml: the draft head (Llama layers of the hybrid's width) proposes chains and
    learns online from the rollout's features; the second step's draft has learnt from the first rollout."""
    sets = sets_for("longform.toml", tmp_path, {"train.num_steps": 2, "rollout.speculation": '"fixed"',
                                                "rollout.max_new_tokens": 12})
    summary = loop.train(load_config(CONFIGS / "longform.toml", sets))
    steps = [record for record in read_metrics(tmp_path / "run") if "reward" in record]
    assert summary.steps == 2 and len(steps) == 2
    for record in steps:
        assert record["spec/frac_tree_steps"] > 0 and record["draft/tokens"] > 0, record
        assert record["spec/tree_size"] == 1 + 4   # "fixed" sizing's tree (4, 4, 16) as one chain of 4 per row
        assert record["logprob_gap"] < 1e-4


def test_an_asynchronous_run_trains_the_hybrid_demo_model(tmp_path):
    """k = 1: the rollout worker process samples the hybrid (its state cache) one version behind."""
    config = load_config(CONFIGS / "demo.toml", sets_for("demo.toml", tmp_path, {**ASYNC, "train.num_steps": 2}))
    summary = loop.train(config)
    steps = [record for record in read_metrics(tmp_path / "run") if "reward" in record]
    assert summary.steps == 2 and [record["step"] for record in steps] == [1, 2]
    assert steps[0]["logprob_gap"] < 1e-4   # step 1 drew with the trainer's weights (step 2 one update behind)
