"""What build_run checks before any step: enough usable prompts, bad rows named with their file."""

import pytest
import torch

from turbogrpo.config import load_config
from turbogrpo.data import PromptExample
from turbogrpo.data.prompts import PromptSet
from turbogrpo.data.prompt_sets import check_prompt_count, load_eval_prompts, load_train_prompts


def prompt_set(num_usable, num_too_long=0, num_empty=0):
    examples = [PromptExample(f"p{i}", torch.tensor([1, 2])) for i in range(num_usable)]
    return PromptSet(examples, num_too_long, num_empty)


def test_more_prompts_per_step_than_usable_prompts_names_the_key_and_the_data():
    config = load_config(None, ["data.kind=rows", 'data.path="rows.jsonl"', "train.prompts_per_step=16"])
    with pytest.raises(ValueError, match=r"config key 'train.prompts_per_step': 16 is more than the 10 usable prompts "
                                         r"of data.path 'rows.jsonl' \(3 skipped as too long for "
                                         r"data.max_prompt_tokens=1024 or the model, 0 as empty\); use at most 10"):
        check_prompt_count(config.data, config.train.prompts_per_step, prompt_set(10, num_too_long=3))
    check_prompt_count(config.data, config.train.prompts_per_step, prompt_set(16))


def test_no_usable_prompt_names_the_data():
    config = load_config(None, ["data.kind=rows", 'data.path="rows.jsonl"'])
    with pytest.raises(ValueError, match=r"data.path 'rows.jsonl' has no usable prompts \(0 skipped as too long .*, "
                                         r"4 as empty\)"):
        check_prompt_count(config.data, config.train.prompts_per_step, prompt_set(0, num_empty=4))
    with pytest.raises(ValueError, match=r"the built-in arithmetic task has no usable prompts"):
        check_prompt_count(load_config(None, []).data, 8, prompt_set(0))


def test_a_bad_row_is_named_with_the_data_file_it_is_in(tmp_path):
    from turbogrpo.models import load_demo_model
    good, bad = tmp_path / "rows.jsonl", tmp_path / "held_out.jsonl"
    good.write_text('{"prompt": "1+1", "answer": "2"}\n')
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": 5, "answer": "2"}\n')
    config = load_config(None, ["data.kind=rows", f'data.path="{good}"', f'data.eval_path="{bad}"'])
    tokenizer = load_demo_model()[1]
    max_new_tokens = config.rollout.max_new_tokens
    assert len(load_train_prompts(config.data, tokenizer, seed=0, max_new_tokens=max_new_tokens).examples) == 1
    with pytest.raises(ValueError, match=rf"^data.eval_path '{bad}' row 1: prompt column 'prompt' must be"):
        load_eval_prompts(config.data, tokenizer, max_new_tokens=max_new_tokens)
    config = load_config(None, ["data.kind=rows", f'data.path="{bad}"'])
    with pytest.raises(ValueError, match=rf"^data.path '{bad}' row 1:"):
        load_train_prompts(config.data, tokenizer, seed=0, max_new_tokens=max_new_tokens)

@pytest.mark.parametrize("sets, engine, tis_cap, runner", [
    ([], "NativeEngine", 0.0, "eager"),                                           # on-policy, native: no correction
    (["train.max_staleness=1", 'rollout.engine="vllm"'], "NativeEngine", 2.0, "eager"),  # the worker samples, stale
    (["algo.tis_cap=3", "train.max_staleness=1"], "NativeEngine", 3.0, "eager"),  # a number is kept
    (['rollout.step_runner="compiled-onednn"'], "NativeEngine", 0.0, "compiled-onednn"),  # the engine's plain step
])
def test_the_run_resolves_its_engine_and_correction(tmp_path, sets, engine, tis_cap, runner):
    """algo.tis_cap "auto" becomes a number when the run is built; at k > 0 the trainer keeps the native engine
    (the rollout worker samples with the configured one), so a vLLM run's trainer never imports vllm for it.
    rollout.step_runner reaches the native engine's schedule."""
    from tests.conftest import REPO
    from turbogrpo.rewards import build_rewards
    from turbogrpo.placement import join_job
    from turbogrpo.train.run import build_run
    from turbogrpo.train.output_dir import run_record
    config = load_config(REPO / "configs" / "demo.toml", [*sets, f'train.output_dir="{tmp_path}"',
                                                          "data.num_eval_problems=2"])
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    assert type(run.engine).__name__ == engine and run.algo.tis_cap == tis_cap
    assert run.engine.schedule.runner == run.decode_schedule.runner == runner


@pytest.mark.parametrize("sets, runner", [
    (['rollout.engine="auto"'], "compiled-onednn"),                                  # the pair measured here
    (['rollout.engine="auto"', 'rollout.step_runner="compiled"'], "compiled"),       # a runner the run names
    (['rollout.engine="native"'], "eager"),                                          # a named engine: the setting's
    (['rollout.engine="auto"', "lora.enabled=true"], "eager"),                       # adapters: not what was measured
])
def test_auto_on_a_cpu_kind_that_measured_native_faster_runs_the_runner_it_measured(tmp_path, monkeypatch, sets,
                                                                                    runner):
    """On a CPU kind where AUTO_CPU_KINDS chose the native engine with a compiled runner, a plain "auto" run builds
    that engine with that runner (nothing compiles until its first rollout)."""
    import dataclasses

    from tests.conftest import REPO
    from turbogrpo import engines
    from turbogrpo.cpu_capability import cpu_capability
    from turbogrpo.placement import join_job
    from turbogrpo.rewards import build_rewards
    from turbogrpo.train.output_dir import run_record
    from turbogrpo.train.run import build_run
    monkeypatch.setattr(engines, "cpu_capability", lambda: dataclasses.replace(cpu_capability(), level="avx512"))
    monkeypatch.setitem(engines.AUTO_CPU_KINDS, ("completions", "avx512"),
                        engines.AutoChoice("native", "compiled-onednn"))
    config = load_config(REPO / "configs" / "demo.toml", [*sets, f'train.output_dir="{tmp_path}"',
                                                          "data.num_eval_problems=2"])
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    assert type(run.engine).__name__ == "NativeEngine"
    assert run.engine.schedule.runner == run.decode_schedule.runner == runner
