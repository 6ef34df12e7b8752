"""Building a run's prompts: the model's own position limit applies at load, like data.max_prompt_tokens."""

import json

import pytest

from turbogrpo.config import ConfigError, load_config
from turbogrpo.data.prompt_sets import load_train_prompts
from turbogrpo.models import tiny_model
from turbogrpo.train import setup
from turbogrpo.train.precision import run_precision

from .tiny_run import char_tokenizer


def train_prompts(config, tokenizer, max_positions=None):
    """The run's training prompts, as ``build_run`` loads them from the config's sections."""
    return load_train_prompts(config.data, tokenizer, seed=config.train.seed,
                              max_new_tokens=config.rollout.max_new_tokens, max_positions=max_positions)


def test_prompts_are_checked_against_the_models_positions_at_load(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (4, 10, 20)))
    config = load_config(None, ["data.kind=rows", f"data.path=\"{rows}\"", "rollout.max_new_tokens=6"])
    tokenizer = char_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tokenizer), hidden=16, layers=1, heads=2, kv_heads=1)
    assert setup.position_limit(model) == model.config.max_position_embeddings

    prompts = train_prompts(config, tokenizer, max_positions=16)  # 4 + 6 and 10 + 6 fit, 20 + 6 not
    assert [e.token_ids.numel() for e in prompts.examples] == [4, 10] and prompts.num_too_long == 1
    strict = load_config(None, ["data.kind=rows", f"data.path=\"{rows}\"", "rollout.max_new_tokens=6",
                                "data.on_overlong=error"])
    with pytest.raises(ValueError, match=r"row 2: prompt has 20 tokens, which with max_new_tokens=6 is more than the "
                                         r"model's 16 positions"):
        train_prompts(strict, tokenizer, max_positions=16)
    with pytest.raises(ConfigError, match=r"config key 'rollout.max_new_tokens': 6 leaves no room for a prompt within "
                                          r"the model's 6 positions"):
        train_prompts(config, tokenizer, max_positions=6)


def test_a_hybrid_policy_loads_and_only_the_native_engine_is_picked_for_it(tmp_path):
    """Its training forwards run shared (tests/mixers) and the native engine samples it (tests/rollout/test_hybrid.py):
    the policy loads; "auto" keeps to the native engine, and vLLM (which cannot load Qwen3.5 here) is one line."""
    import torch

    from tests.mixers.conftest import build_hybrid
    from turbogrpo.config import LoraConfig, ModelConfig
    from turbogrpo.engines import resolve_engine
    tokenizer = char_tokenizer()
    build_hybrid("qwen3_5_text", torch.float32, vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    device = torch.device("cpu")
    policy, _ = setup.load_policy(ModelConfig(path=str(tmp_path)), LoraConfig(), device,
                                  run_precision("float32", False, device))
    model_type = policy.config.model_type
    assert resolve_engine("auto", device, model_type=model_type) == resolve_engine("native", device,
                                                                                     model_type=model_type) == "native"
    with pytest.raises(ValueError, match=r"^rollout.engine = \"vllm\" cannot sample model type 'qwen3_5_text' \(a "
                                         r"hybrid: .*; use rollout.engine = \"native\" or \"auto\"$"):
        resolve_engine("vllm", device, model_type=model_type)
