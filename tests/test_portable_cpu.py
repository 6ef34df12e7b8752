"""The CPU-sensitive tests pass on an AVX2-only CPU, whatever CPU runs the suite.

An AVX-512 or AMX machine becomes an AVX2-only one for a child process: ``ONEDNN_MAX_CPU_ISA`` keeps
oneDNN to its AVX2 kernels (it then refuses to pack bf16 weights, as on a Zen 2/3 EPYC, and
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` says False), ``ATEN_CPU_CAPABILITY`` does the same for
torch's own kernels and ``MKL_ENABLE_INSTRUCTIONS`` for MKL's sgemm. The child runs the tests that
failed on such a CPU before ``turbogrpo.cpu_capability`` existed (bf16 rollouts, bf16 training, kernel
choices, bf16 tolerances). On an AVX2 machine the variables change nothing and the child runs them again.
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""Environment that makes oneDNN, ATen and MKL run as on a CPU with AVX2 and no AVX-512."""

CPU_SENSITIVE_TESTS = (
    "tests/test_linears.py",
    "tests/test_cpu_capability.py",
    "tests/rollout/test_plans.py::test_the_own_part_gives_the_same_hidden_states_by_flash_or_by_matmuls",
    "tests/rollout/test_engine.py::test_bfloat16_models_run_with_float32_logprobs",
    "tests/train/test_precision.py",
    "tests/train/test_resume.py::test_sigkill_then_resume_equals_uninterrupted_run[grpo_bf16_mixed]",
)
"""What an AVX2-only EPYC failed before (issue 32), less the distributed module, whose bf16 run crashed
in the same packed bf16 product as the resume test's."""

PROBE = """
import torch
from turbogrpo.cpu_capability import cpu_capability
capability = cpu_capability()
try:
    torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16))
    packs = True
except RuntimeError:
    packs = False
print(capability.level, capability.native_bf16, packs)
"""


def run_avx2_only(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, **AVX2_ONLY, "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("TURBOGRPO_CPU_CAPABILITY", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the AVX2 environment variables are x86's")


def test_the_child_process_really_is_an_avx2_only_cpu():
    probe = run_avx2_only(["-c", PROBE], timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    # oneDNN itself refuses bf16 weights there, as it does on a Zen 2/3 EPYC, and the capability says so
    assert probe.stdout.split() == ["avx2", "False", "False"], probe.stdout


def test_the_cpu_sensitive_tests_pass_on_an_avx2_only_cpu():
    result = run_avx2_only(["-m", "pytest", "-q", "-p", "no:cacheprovider", *CPU_SENSITIVE_TESTS], timeout=900)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"under {AVX2_ONLY}:\n{tail}"
    assert " passed" in tail and " failed" not in tail
