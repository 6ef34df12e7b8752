"""The engine seam without vLLM: rollout.engine's names and refusals, "auto", the native engine as
``generate`` itself, the weights a separate engine is sent (LoRA merged, whole fused groups), and the
request seeds."""

import copy
import importlib.util
import logging

import pytest
import torch

from tests.conftest import REPO
from tests.rollout.conftest import build_model, random_prompts
from turbogrpo.config import ConfigError, load_config
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.engines import AUTO_ENGINES, ENGINE_NAMES, build_engine, resolve_engine
from turbogrpo.engines.weights import checkpoint_weights, trainable_modules

REAL_FIND_SPEC = importlib.util.find_spec
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # vLLM's Qwen2


def test_engine_names_and_refusals():
    assert load_config(None, ["rollout.engine=vllm"]).rollout.engine == "vllm"
    assert set(ENGINE_NAMES) == {"auto", "native", "vllm"}
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, ["rollout.engine=sglang"])
    # Speculation on vLLM runs vLLM's EAGLE drafter: not on the CPU build (its sampled drafts are not exact), and
    # elsewhere with a draft of layout "eagle", without history drafts.
    with pytest.raises(ConfigError, match=r"rollout.speculation.*_expand_kernel_impl"):
        load_config(None, ["rollout.engine=vllm", "rollout.speculation=fixed", "model.device=cpu", "draft.layout=eagle"])
    gpu = ["rollout.engine=vllm", "model.device=cuda"]
    with pytest.raises(ConfigError, match="draft.layout"):
        load_config(None, [*gpu, "rollout.speculation=fixed"])
    assert load_config(None, [*gpu, "rollout.speculation=fixed", "draft.layout=eagle"]).draft.layout == "eagle"
    with pytest.raises(ConfigError, match="draft.history"):
        load_config(None, [*gpu, "rollout.speculation=cost", "draft.layout=eagle", "draft.history=true"])
    with pytest.raises(ConfigError, match="draft.layout"):
        load_config(None, ["draft.layout=medusa"])
    # Conversations run on vLLM, branching too.
    assert load_config(REPO / "configs" / "demo_multiturn.toml", ["rollout.engine=vllm", "rollout.branching=[2, 4]"]
                       ).rollout.engine == "vllm"


def test_a_saved_draft_runs_on_vllm_only_in_the_eagle_layout(tmp_path):
    from turbogrpo.speculative.draft import DraftHead
    model = build_model("qwen2")
    for layout in ("turbogrpo", "eagle"):
        DraftHead(model, layout=layout).save(tmp_path / layout)
    overrides = ["rollout.engine=vllm", "model.device=cuda", "rollout.speculation=fixed", "draft.learn=false"]
    with pytest.raises(ConfigError, match="draft.path.*this one's is 'turbogrpo'"):
        load_config(None, [*overrides, f"draft.path={tmp_path / 'turbogrpo'}"])
    assert load_config(None, [*overrides, f"draft.path={tmp_path / 'eagle'}"]).rollout.engine == "vllm"


def test_native_is_generate():
    model = build_model("qwen2")
    engine = build_engine("native", torch.device("cpu"), schedule=None, dtype=torch.float32)
    assert not engine.holds_weights
    prompts = random_prompts([5, 7])
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
    ours = engine.sample(model, prompts, num_samples=3, sampling=sampling, seed=4)
    theirs = generate(model, prompts, num_samples=3, sampling=sampling, seed=4)
    assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in theirs.tokens]
    assert all(torch.equal(a, b) for a, b in zip(ours.logprobs, theirs.logprobs))


def test_auto_takes_a_cpu_kinds_measured_engine_and_its_runner_for_a_plain_run_only(monkeypatch):
    """Where a CPU kind measured the native engine's compiled step faster (``AUTO_CPU_KINDS``), "auto" is that engine
    with that runner for single-turn runs that need nothing more (what was measured); a run with needs, conversations,
    other CPU kinds and other devices keep the rest of the rules, and a runner the run names wins over the choice's."""
    import dataclasses

    from turbogrpo import engines
    from turbogrpo.cpu_capability import cpu_capability
    from turbogrpo.engines import AUTO_CPU_KINDS, AutoChoice, resolve_choice
    monkeypatch.setattr(engines, "_vllm_import_error", lambda: "")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else REAL_FIND_SPEC(name, *a))
    real = cpu_capability()
    cpu = torch.device("cpu")
    assert all(choice.engine in ENGINE_NAMES and choice.engine != "auto" for choice in AUTO_CPU_KINDS.values())
    monkeypatch.setitem(AUTO_CPU_KINDS, ("completions", "avx512"), AutoChoice("native", "compiled-onednn"))
    monkeypatch.setitem(AUTO_ENGINES, ("cpu", "completions"), "vllm")
    for level, expected in [("avx512", AutoChoice("native", "compiled-onednn")), ("amx", AutoChoice("vllm")),
                            ("avx2", AutoChoice("vllm")), ("none", AutoChoice("vllm"))]:
        monkeypatch.setattr(engines, "cpu_capability", lambda level=level: dataclasses.replace(real, level=level))
        assert resolve_choice("auto", cpu) == expected, level
        assert resolve_engine("auto", cpu) == expected.engine
    # On the measured kind: a run that needs more than sampling gets the engine without the runner.
    assert resolve_choice("auto", cpu, needs=("tree_speculation",)) == AutoChoice("native")
    assert resolve_choice("auto", cpu, conversations=True) == AutoChoice(AUTO_ENGINES["cpu", "conversations"])
    assert resolve_choice("auto", torch.device("cuda")) == AutoChoice(AUTO_ENGINES["cuda", "completions"])
    assert resolve_choice("native", cpu) == AutoChoice("native") and resolve_choice("vllm", cpu) == AutoChoice("vllm")
    # The runner a run gets: the choice's where rollout.step_runner is left at its default, else the setting.
    measured = AutoChoice("native", "compiled-onednn")
    assert measured.runner_for("eager") == "compiled-onednn" and measured.runner_for("compiled") == "compiled"
    assert measured.runner_for("eager", lora=True) == "eager"  # LoRA adapters: not what was measured
    assert AutoChoice("native").runner_for("eager") == "eager" and AutoChoice("vllm").runner_for("auto") == "auto"


def test_auto_follows_the_measurements_but_takes_native_where_the_run_needs_it_or_vllm_is_missing(monkeypatch):
    """"auto" is AUTO_ENGINES's engine per (device type, workload); where that is vLLM, a run using what only the
    native engine runs (named by the config) or a machine without the vllm package still samples on native."""
    import importlib.util

    from turbogrpo import engines
    cpu = torch.device("cpu")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(engines, "_vllm_import_error", lambda: "")   # an installed vllm imports (tried below)

    def vllm_installed(installed: bool):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if installed else None) if name == "vllm" else real_find_spec(name, *a))

    vllm_installed(True)
    monkeypatch.setattr(engines, "AUTO_CPU_KINDS", {})  # this CPU kind measured nothing else (tested below)
    assert {(d, w) for d in ("cpu", "cuda") for w in ("completions", "conversations")} <= set(AUTO_ENGINES)
    assert set(AUTO_ENGINES.values()) <= set(ENGINE_NAMES) - {"auto"}
    assert resolve_engine("auto", cpu) == AUTO_ENGINES["cpu", "completions"]
    assert resolve_engine("auto", cpu, conversations=True) == AUTO_ENGINES["cpu", "conversations"]
    monkeypatch.setitem(AUTO_ENGINES, ("cpu", "completions"), "vllm")
    assert resolve_engine("auto", cpu) == "vllm"
    assert resolve_engine("auto", cpu, needs=("tree_speculation",)) == "native"
    assert resolve_engine("auto", cpu, needs=("conversations", "partial_rollouts")) == "vllm"  # (both run these)
    assert resolve_engine("native", cpu) == "native"
    assert resolve_engine("vllm", cpu, needs=("sharded_weights",)) == "vllm"  # (a named engine: the config refuses)
    vllm_installed(False)
    assert resolve_engine("auto", cpu) == "native"
    assert build_engine("auto", cpu, schedule=None, dtype=torch.float32).holds_weights is False  # the native one
    # What a config needs of its engine.
    assert load_config(None, []).engine_needs() == ()
    assert load_config(None, ["rollout.speculation=fixed"]).engine_needs() == ("tree_speculation",)
    assert load_config(None, ["train.max_staleness=1", "algo.tis_cap=2", "train.partial_rollouts=1",
                              "rollout.speculation=fixed"]).engine_needs() == (
        "tree_speculation", "trainer_taught_drafts", "partial_rollouts")
    assert load_config(None, ["distributed.strategy=fsdp2"]).engine_needs() == ("sharded_weights",)


def test_every_engine_declares_its_capabilities_and_the_default_has_them_all():
    """Capabilities are data (``CAPABILITIES``): "auto", the config's checks and the worker read them; nothing
    outside the engine layer compares engine names (the check below reads the package's source)."""
    import ast
    import dataclasses
    from pathlib import Path

    import turbogrpo
    from turbogrpo.engines import CAPABILITIES, DEFAULT_ENGINE, ENGINES, capable_engines, missing_capability
    assert set(CAPABILITIES) == set(ENGINES)
    assert all(dataclasses.asdict(CAPABILITIES[DEFAULT_ENGINE]).values())
    assert missing_capability("vllm", ["conversations", "sharded_weights"]) == "sharded_weights"
    assert missing_capability("auto", ["sharded_weights"]) == ""
    assert capable_engines("trainer_taught_drafts") == ["native"]
    package = Path(turbogrpo.__file__).parent
    compared = []
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "engines":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Constant) and side.value in ENGINES for side in (node.left, *node.comparators)):
                compared.append(f"{path.relative_to(package)}:{node.lineno}")
    assert compared == []


def test_auto_takes_native_with_a_warning_where_an_installed_vllm_fails_to_import(tmp_path, monkeypatch, caplog):
    """An installed vllm whose import fails (here a package named vllm that raises like a build for another torch)
    does not stop an "auto" run: the import is tried in a child process and the run samples on native, saying why."""
    from turbogrpo import engines
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))          # find_spec sees the broken package, as it would a real one
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))     # and the child process imports it
    monkeypatch.setitem(AUTO_ENGINES, ("cpu", "completions"), "vllm")
    monkeypatch.setattr(engines, "AUTO_CPU_KINDS", {})  # whatever this CPU kind measured
    engines._vllm_import_error.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=engines.__name__):
            assert resolve_engine("auto", torch.device("cpu")) == "native"
        assert "vllm is installed but does not import (ImportError: libcudart.so.12: cannot open shared object file)" \
            in caplog.text
        assert resolve_engine("vllm", torch.device("cpu")) == "vllm"   # a named engine is the user's choice
    finally:
        engines._vllm_import_error.cache_clear()


def test_lora_weights_are_merged_and_sent_by_whole_fused_groups():
    from peft import LoraConfig, get_peft_model
    base = build_model("qwen2")
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_()
    modules = trainable_modules(lora, FUSED)
    assert modules == {f"model.layers.{i}.{m}" for i in range(2) for m in
                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    sent = checkpoint_weights(lora, modules)
    merged = copy.deepcopy(lora).merge_and_unload().state_dict()
    assert set(sent) == {f"{m}.{leaf}" for m in modules for leaf in ("weight", "bias") if f"{m}.{leaf}" in merged}
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name])
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    everything = checkpoint_weights(lora)
    assert set(everything) == set(base.state_dict()) and not any("lora" in n for n in everything)


def test_full_fine_tune_sends_every_module():
    model = build_model("qwen2")
    assert checkpoint_weights(model, trainable_modules(model, FUSED)).keys() == dict(model.named_parameters()).keys()


def test_request_seeds_are_distinct_over_steps_ranks_and_groups():
    from turbogrpo.engines.vllm import request_seed  # the module imports without vllm
    from turbogrpo.train.loop import rollout_seed
    steps = [rollout_seed(0, step, rank) for step in range(5) for rank in range(2)]  # neighbours differ by 1
    seeds = {request_seed(seed, group) + i for seed in steps for group in range(16) for i in range(8)}
    assert len(seeds) == 10 * 16 * 8 and all(0 <= s < 2**63 for s in seeds)


def test_a_vllm_cpu_build_before_0_32_is_named_slow_for_seeded_requests():
    from turbogrpo.engines.vllm import seeded_sampling_warning  # the module imports without vllm
    assert "1.6x slower" in seeded_sampling_warning("0.31.0", "cpu")
    assert "0.32.0" in seeded_sampling_warning("0.31.0+cpu", "cpu")
    assert seeded_sampling_warning("0.32.0", "cpu") is None and seeded_sampling_warning("0.33.1", "cpu") is None
    assert seeded_sampling_warning("0.31.0", "cuda") is None
