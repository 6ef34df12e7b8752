"""What this CPU can run, asked once per process: the one place every CPU kernel choice consults.

The project's machines (and users' laptops and cloud VMs) differ: an AVX2-only AMD EPYC (Zen 2/3), an
AVX-512 EPYC (Zen 4), an AMX Xeon, arm64. What differs for turbogrpo:

* **packed oneDNN products** (``turbogrpo.linears``'s rollout kernel): float32 runs on any x86 CPU with
  AVX2; bfloat16 needs oneDNN's bf16 kernels (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512
  BW/VL/DQ or AVX-NE-CONVERT), otherwise oneDNN refuses to reorder a bf16 weight;
* **oneDNN training products** (float32, unpacked): any x86 CPU with AVX2;
* **native bf16 / fp16** matmuls: without them a bf16 product is emulated, and slower than float32;
* **AMX** tiles: bf16 products several times float32's rate (recorded; no kernel choice needs it yet).

``TURBOGRPO_CPU_CAPABILITY`` forces a lower answer than the CPU's (``avx2``, ``avx512``; ``amx`` only where
the CPU has it): the portable path for users, and for tests that check an AVX-512 machine also behaves as
an AVX2 one would. Asking for more than the CPU has is refused in one line.

Tests swap the probe (``_probe``) and clear the cache (``cpu_capability.cache_clear()``).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass

import torch

CAPABILITY_ENV = "TURBOGRPO_CPU_CAPABILITY"
"""Environment variable that forces a capability level (one of ``LEVELS``, at most the CPU's own)."""

LEVELS = ("none", "avx2", "avx512", "amx")
"""x86 vector levels, lowest first: "none" is anything without AVX2 (arm64, old x86), where oneDNN's
linear ops are not used."""

_TORCH_LEVELS = {"AVX2": "avx2", "AVX512": "avx512"}
"""``torch.backends.cpu.get_cpu_capability()`` -> level (it honours ``ATEN_CPU_CAPABILITY``; others: "none")."""


@dataclass(frozen=True)
class CpuCapability:
    """What this process's CPU runs. ``level``: one of ``LEVELS``; ``forced``: set by ``CAPABILITY_ENV``."""

    level: str
    torch_capability: str
    """``torch.backends.cpu.get_cpu_capability()`` as torch reports it ("AVX2", "AVX512", "DEFAULT", ...)."""
    onednn: bool
    """oneDNN's linear ops are built into torch and run here (x86 with AVX2 or more)."""
    native_bf16: bool
    """oneDNN has bf16 kernels here (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``)."""
    native_fp16: bool
    """oneDNN has fp16 kernels here (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``)."""
    amx: bool
    """AMX tiles (bf16 products at several times float32's rate)."""
    forced: bool = False

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's packed rollout product runs in ``dtype`` here."""
        return self.onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and self.native_bf16))

    def trains(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's training products (forward and both backward products) run in ``dtype`` here."""
        return self.onednn and dtype == torch.float32

    def native(self, dtype: torch.dtype) -> bool:
        """Whether matmuls in ``dtype`` run natively here (float32 always; bf16 / fp16 by the CPU)."""
        return {torch.bfloat16: self.native_bf16, torch.float16: self.native_fp16}.get(dtype, True)

    def describe(self) -> str:
        """One line for logs and errors, e.g. "AVX2 (no AVX-512; bf16 emulated)"."""
        name = {"none": f"{platform.machine()} without AVX2", "avx2": "AVX2 (no AVX-512)", "avx512": "AVX-512",
                "amx": "AVX-512 + AMX"}[self.level]
        extras = ["bf16 native" if self.native_bf16 else "bf16 emulated"]
        if self.forced:
            extras.append(f"forced by {CAPABILITY_ENV}")
        return f"{name}; {', '.join(extras)}"

    def record(self) -> dict:
        """The fields every benchmark JSON and run record carry."""
        return {**asdict(self), "description": self.describe()}


def _mkldnn_answer(name: str) -> bool:
    probe = getattr(torch.ops.mkldnn, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:  # a torch build without oneDNN
        return False


def _probe() -> CpuCapability:
    """The CPU's own answer, from torch's capability calls."""
    torch_capability = torch.backends.cpu.get_cpu_capability()
    level = _TORCH_LEVELS.get(torch_capability, "none")
    amx = level == "avx512" and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    onednn = (level != "none" and torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return CpuCapability(level="amx" if amx else level, torch_capability=torch_capability, onednn=onednn,
                         native_bf16=onednn and _mkldnn_answer("_is_mkldnn_bf16_supported"),
                         native_fp16=onednn and _mkldnn_answer("_is_mkldnn_fp16_supported"), amx=amx)


def _forced(real: CpuCapability, wanted: str) -> CpuCapability:
    """``real`` lowered to level ``wanted`` (refused where ``wanted`` is above the CPU's level)."""
    allowed = [level for level in LEVELS if LEVELS.index(level) <= LEVELS.index(real.level)]
    if wanted not in LEVELS or wanted not in allowed:
        what = "is not a level" if wanted not in LEVELS else "asks for more than this CPU has"
        raise ValueError(f"{CAPABILITY_ENV}={wanted!r} {what}: this CPU is {real.describe()} "
                         f"(torch.backends.cpu.get_cpu_capability() = {real.torch_capability!r}); unset it or "
                         f"set one of {', '.join(allowed)}")
    rank = LEVELS.index(wanted)
    # Below AVX-512, the common case (Zen 2/3, older Xeons) has no bf16 kernels: the forced path is theirs.
    return CpuCapability(level=wanted, torch_capability=real.torch_capability,
                         onednn=real.onednn and rank >= LEVELS.index("avx2"),
                         native_bf16=real.native_bf16 and rank >= LEVELS.index("avx512"),
                         native_fp16=real.native_fp16 and rank >= LEVELS.index("avx512"),
                         amx=real.amx and wanted == "amx", forced=True)


@functools.cache
def cpu_capability() -> CpuCapability:
    """This process's CPU capability (``_probe``, lowered by ``CAPABILITY_ENV`` where set); cached."""
    real = _probe()
    wanted = os.environ.get(CAPABILITY_ENV, "").strip().lower()
    return _forced(real, wanted) if wanted else real
