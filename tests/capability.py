"""CPU capability answers for tests: each kind of CPU the library must run on, so that any machine
checks every path (an AVX-512 one also checks what an AVX2-only one does)."""

from __future__ import annotations

import pytest

from turbogrpo import cpu_capability as capability_module
from turbogrpo.cpu_capability import CpuCapability

ANSWERS = {
    # arm64 (Apple, Graviton) or an x86 CPU without AVX2: oneDNN's linear ops are not used.
    "none": CpuCapability(level="none", torch_capability="DEFAULT", onednn=False, native_bf16=False,
                          native_fp16=False, amx=False),
    # Zen 2/3 EPYC, older Xeons: oneDNN float32, no bf16 kernels.
    "avx2": CpuCapability(level="avx2", torch_capability="AVX2", onednn=True, native_bf16=False,
                          native_fp16=False, amx=False),
    # Zen 4 EPYC: AVX-512 with bf16, no AMX.
    "avx512": CpuCapability(level="avx512", torch_capability="AVX512", onednn=True, native_bf16=True,
                            native_fp16=False, amx=False),
    # Sapphire Rapids and later Xeons.
    "amx": CpuCapability(level="amx", torch_capability="AVX512", onednn=True, native_bf16=True,
                         native_fp16=True, amx=True),
}


@pytest.fixture(params=list(ANSWERS))
def cpu_answer(request, monkeypatch) -> CpuCapability:
    """``cpu_capability()`` answers each of ``ANSWERS`` in turn (a subset: ``parametrize("cpu_answer",
    [...], indirect=True)``): the probe is swapped and the cache cleared, before and after."""
    answer = ANSWERS[request.param]
    monkeypatch.delenv(capability_module.CAPABILITY_ENV, raising=False)
    monkeypatch.setattr(capability_module, "_probe", lambda: answer)
    capability_module.cpu_capability.cache_clear()
    yield answer
    monkeypatch.undo()
    capability_module.cpu_capability.cache_clear()
