"""Every CPU kernel choice asks ``turbogrpo.cpu_capability``, under each answer a CPU can give (AVX2 only,
AVX-512 without AMX, AMX, no AVX2 at all): where a kernel cannot run, the path falls back to ``F.linear``
and gives the ``module`` kernel's numbers exactly; an explicit "onednn" that cannot run is refused in one
line. oneDNN's kernels are replaced by ``F.linear`` stand-ins in the choice tests, so that every answer
is checked on any machine (the real kernels under an AVX2 CPU's oneDNN: test_portable_cpu.py)."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.capability import ANSWERS, cpu_answer  # noqa: F401 (the fixture)
from tests.rollout.conftest import build_model, random_prompts
from turbogrpo import cpu_capability as capability_module
from turbogrpo import linears
from turbogrpo.config import ConfigError, ModelConfig
from turbogrpo.cpu_capability import CAPABILITY_ENV, cpu_capability
from turbogrpo.linears import LINEAR_KERNELS, TRAINING_LINEAR_KERNELS
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.decode import DecodeSchedule
from turbogrpo.train.precision import run_precision

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = SamplingConfig(max_new_tokens=6, stop_token_ids=(0,))


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """oneDNN's packing and products replaced by exact stand-ins that record the dtypes packed and the
    products run; the timing that "auto" does once per process made to pick oneDNN from 1 row."""
    calls = {"packed": [], "products": 0}

    def pack(weight, dtype=None):
        calls["packed"].append(dtype or weight.dtype)
        return weight.detach().to(dtype or weight.dtype)

    def product(input, weight, bias=None):
        calls["products"] += 1
        return nn.functional.linear(input, weight, bias)

    monkeypatch.setattr(linears, "pack_weight", pack)
    monkeypatch.setattr(linears, "onednn_product", product)
    monkeypatch.setattr(linears, "_timed_min_rows", lambda *args: 1)
    monkeypatch.setattr(linears, "_timed_trains_faster", lambda *args: 1)
    # (the stand-in timings, not a choice this machine measured and kept earlier in the session)
    monkeypatch.setattr(linears, "measured_once", lambda name, key, measure: measure())
    return calls


def rollout(model, linears_kernel: str, autocast_dtype: torch.dtype | None):
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        return generate(model, random_prompts([5, 3]), num_samples=2, sampling=SAMPLING, seed=3,
                        schedule=DecodeSchedule(linears=linears_kernel))


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_auto_packs_only_what_the_cpu_runs_and_otherwise_equals_the_module_kernel(cpu_answer, stand_in_kernels,
                                                                                   compute):
    model = build_model("llama", seed=5)
    autocast = compute if compute != torch.float32 else None
    ours = rollout(model, "auto", autocast)
    packs = cpu_answer.packs(compute)
    assert set(stand_in_kernels["packed"]) == ({compute} if packs else set())
    assert (stand_in_kernels["products"] > 0) == packs
    reference = rollout(model, "module", autocast)
    assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in reference.tokens]
    if not packs:  # the very same F.linear calls: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(ours.logprobs, reference.logprobs))


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_an_explicit_onednn_rollout_runs_where_the_cpu_can_and_is_refused_in_one_line_elsewhere(
        cpu_answer, stand_in_kernels, compute):
    model = build_model("qwen2", seed=1)
    autocast = compute if compute != torch.float32 else None
    if cpu_answer.packs(compute):
        rollout(model, "onednn", autocast)
        assert stand_in_kernels["packed"] and set(stand_in_kernels["packed"]) == {compute}
        return
    with pytest.raises(ValueError) as refused:
        rollout(model, "onednn", autocast)
    message = str(refused.value)
    assert "\n" not in message and cpu_answer.describe() in message and "model.linear_kernel" in message
    assert stand_in_kernels["packed"] == [] and stand_in_kernels["products"] == 0  # refused before anything ran
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_training_kernels_follow_the_cpu(cpu_answer, stand_in_kernels):
    model = build_model("llama", seed=2).train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))

    def gradients(kernel):
        model.zero_grad()
        with TRAINING_LINEAR_KERNELS[kernel]([model]):
            model(ids).logits.float().logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = gradients("module")
    ours = gradients("auto")
    assert (stand_in_kernels["products"] > 0) == cpu_answer.trains(torch.float32)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(ours, reference))
    if cpu_answer.onednn:
        gradients("onednn")
    else:
        with pytest.raises(ValueError, match="linear kernel \"onednn\" cannot run float32 products on this CPU"):
            gradients("onednn")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_the_config_refuses_an_onednn_kernel_the_cpu_cannot_run(cpu_answer, dtype):
    config = ModelConfig(dtype=dtype, linear_kernel="onednn", device="cpu")
    runs = cpu_answer.packs(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    if runs:
        config.check("model")
    else:
        with pytest.raises(ConfigError, match=r"model\.linear_kernel.*" + re.escape(cpu_answer.describe())):
            config.check("model")
    ModelConfig(dtype=dtype, linear_kernel="auto", device="cpu").check("model")  # auto: always allowed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_warns_once_where_the_cpu_emulates_it(cpu_answer, dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precision = run_precision(dtype, device="cpu")
    emulated = [w for w in caught if "emulated" in str(w.message)]
    assert precision.compute_dtype == getattr(torch, dtype) and precision.param_dtype == torch.float32
    assert len(emulated) == (0 if cpu_answer.native(precision.compute_dtype) else 1)
    if emulated:
        assert cpu_answer.describe() in str(emulated[0].message)


def test_auto_precision_is_float32_without_amx_and_never_emulated(cpu_answer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" never picks what this CPU emulates
        precision = run_precision("auto", device="cpu")
    assert precision.param_dtype == torch.float32
    assert precision.compute_dtype == (torch.bfloat16 if cpu_answer.amx else torch.float32)


@pytest.mark.parametrize("cpu_answer", ["amx"], indirect=True)
@pytest.mark.parametrize("wanted, level", [("avx2", "avx2"), ("avx512", "avx512"), ("amx", "amx"), ("none", "none")])
def test_the_environment_forces_a_lower_capability(cpu_answer, monkeypatch, wanted, level):
    monkeypatch.setenv(CAPABILITY_ENV, wanted.upper())
    capability_module.cpu_capability.cache_clear()
    forced = cpu_capability()
    assert forced.level == level and forced.forced
    assert forced.native_bf16 == (level in ("avx512", "amx")) and forced.amx == (level == "amx")
    assert forced.onednn == (level != "none")
    assert "forced by " + CAPABILITY_ENV in forced.describe()


@pytest.mark.parametrize("cpu_answer", ["avx2"], indirect=True)
@pytest.mark.parametrize("wanted", ["amx", "avx512", "sse4"])
def test_forcing_more_than_the_cpu_has_is_refused_in_one_line(cpu_answer, monkeypatch, wanted):
    monkeypatch.setenv(CAPABILITY_ENV, wanted)
    capability_module.cpu_capability.cache_clear()
    with pytest.raises(ValueError) as refused:
        cpu_capability()
    message = str(refused.value)
    assert "\n" not in message and CAPABILITY_ENV in message and "AVX2" in message
    assert "none, avx2" in message  # what may be set instead


def test_the_real_probe_agrees_with_torch():
    capability_module.cpu_capability.cache_clear()
    real = capability_module._probe()
    assert real.torch_capability == torch.backends.cpu.get_cpu_capability()
    if real.onednn:
        assert real.native_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert real.level in capability_module.LEVELS
    record = real.record()
    assert record["level"] == real.level and record["description"] == real.describe()


def test_every_answer_is_a_distinct_kind():
    assert len({(a.level, a.native_bf16, a.amx, a.onednn) for a in ANSWERS.values()}) == len(ANSWERS)
    assert set(LINEAR_KERNELS) == set(TRAINING_LINEAR_KERNELS) == {"auto", "module", "onednn"}


def test_a_run_with_a_capability_this_cpu_lacks_stops_in_one_line_before_loading(tmp_path):
    real = capability_module._probe()
    above = capability_module.LEVELS[capability_module.LEVELS.index(real.level) + 1:]
    if not above:
        pytest.skip("this CPU has every level")
    env = {**os.environ, CAPABILITY_ENV: above[0]}
    result = subprocess.run([sys.executable, "-m", "turbogrpo", "train", str(ROOT / "configs" / "demo.toml"), "--set",
                             f"train.output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                            timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-2000:]
    assert CAPABILITY_ENV in lines[0] and "asks for more than this CPU has" in lines[0]
    assert not (tmp_path / "run" / "machine.jsonl").exists()
