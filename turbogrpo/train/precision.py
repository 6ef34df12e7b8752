"""The numeric precision of a run: what the parameters and AdamW state are stored in, what computes.

Mixed precision, as the field does it: float32 master weights and optimizer state, low-precision compute.

    model.dtype = "float32"                     float32 storage, float32 compute.
    model.dtype = "bfloat16" (or "float16")     float32 masters + AdamW state; every forward (rollout,
                                                 training, scoring, evaluation) runs under
                                                 ``torch.autocast(dtype)``; gradients are float32.
    model.dtype = "bfloat16", pure_bf16 = true  bfloat16 parameters and AdamW state (opt-in, warns):
                                                 an update smaller than half of bf16's spacing at a
                                                 weight (about 1.5e-4 at 0.02) rounds away, so GRPO's
                                                 usual learning rates barely move the model.
    model.dtype = "auto"                        the fastest of the above that this machine runs
                                                 natively and fast (``AUTO_DTYPES``): float32 on CPUs
                                                 without AMX, bfloat16 on AMX and on GPUs that have it.

On a CPU without native bf16 (``turbogrpo.cpu_capability``: an AVX2-only EPYC, most laptops) a bf16
or fp16 run still works, every weight product by ``F.linear`` (oneDNN's packed bf16 product is not
used there), but it is emulated and slower than float32, so such a run warns once.

Why autocast over a bfloat16 compute copy refreshed after each step: both hold float32 masters, and
bench/gpu_precision.py (``--device cpu`` too) measures them side by side. On the CPU (results/
precision_cpu.json) autocast was as fast or faster (update 4.48 s vs 4.63 s, rollout 3.84 s vs 3.95 s)
and holds 16 bytes per parameter against the copy's 18. Autocast keeps the gradients
float32 where they accumulate over micro-batches and are averaged by DDP, and needs no second module;
the rollout, run under the same autocast, samples from exactly the bf16 values the training forward
uses (the rounded masters) with the same float32 residual stream, so the sampler-vs-trainer gap stays
the one of two kernels, not of two models.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

from turbogrpo.cpu_capability import cpu_capability
from turbogrpo.models import resolve_dtype

PURE_BF16_WARNING = (
    "model.pure_bf16 = true: parameters and AdamW state are stored in bfloat16 (no float32 masters). "
    "An update smaller than half of bf16's spacing at a weight rounds away (lr 1e-6 changes under 1% of "
    "the weights of the demo model in 3 steps, float32 masters change 99.9%), so small learning rates "
    "barely train. Unset it to train with float32 masters and bf16 compute (model.dtype = \"bfloat16\").")


@dataclass(frozen=True)
class Precision:
    """param_dtype: storage of the trainable parameters, their gradients and the AdamW state (the
    masters); compute_dtype: the dtype matrix multiplications run in."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    device_type: str = "cpu"
    """Where the forwards run ("cpu", "cuda"): autocast is per device type."""

    @property
    def mixed(self) -> bool:
        return self.param_dtype != self.compute_dtype

    def autocast(self):
        """The context every forward of the run goes under (a no-op when storage == compute)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def computing(self, fn):
        """``fn`` with each call under :meth:`autocast` (its backward runs in the dtypes the forward chose)."""
        @functools.wraps(fn)
        def under_autocast(*args, **kwargs):
            with self.autocast():
                return fn(*args, **kwargs)
        return under_autocast


CPU_AUTO_DTYPES = {
    # No native bf16: emulated, slower than float32 (bench/results/precision_cpu.json, a real AVX2-only EPYC,
    # and precision_cpu_avx2_emulated.json: the update 4-5x float32's time, the rollout about 1.5x).
    "none": "float32",
    "avx2": "float32",
    # Native bf16 without AMX: neither the update nor the rollout faster than float32 on the tiny model of
    # precision_cpu_avx512_bf16.json; float32 is exact, so it stays.
    "avx512": "float32",
    # AMX tiles multiply bf16 at several times float32's rate (not measured by a whole step here yet).
    "amx": "bfloat16",
}
"""CPU capability level (``turbogrpo.cpu_capability``) -> the compute dtype of ``model.dtype = "auto"``."""

AUTO_DTYPES = {
    "cpu": lambda: CPU_AUTO_DTYPES[cpu_capability().level],
    # bf16 where the GPU has it (Ampere and later); float16 has no loss scaling here, so not that.
    "cuda": lambda: "bfloat16" if torch.cuda.is_bf16_supported() else "float32",
}
"""Device type -> the compute dtype that ``model.dtype = "auto"`` picks there (float32 elsewhere)."""


def resolved_dtype_name(dtype: str, device: torch.device | str = "cpu") -> str:
    """``model.dtype`` with "auto" resolved for ``device`` (``AUTO_DTYPES``)."""
    if dtype != "auto":
        return dtype
    return AUTO_DTYPES.get(torch.device(device).type, lambda: "float32")()


def emulated_precision_warning(compute: torch.dtype, device_type: str) -> str | None:
    """The warning for low-precision compute on a CPU that emulates it (None where it is native)."""
    capability = cpu_capability()
    if device_type != "cpu" or capability.native(compute):
        return None
    name = str(compute).removeprefix("torch.")
    return (f"model.dtype = \"{name}\" on this CPU ({capability.describe()}): {name} products are emulated "
            f"here and run slower than float32; \"float32\" (or \"auto\") is faster and exact on this machine")


def run_precision(dtype: str, pure_bf16: bool = False, device: torch.device | str = "cpu") -> Precision:
    """The precision of ``model.dtype`` (+ ``model.pure_bf16``) on ``device``; warns once where the CPU
    emulates the compute dtype (``emulated_precision_warning``)."""
    name = resolved_dtype_name(dtype, device)
    compute = resolve_dtype(name)
    device_type = torch.device(device).type
    warning = emulated_precision_warning(compute, device_type)
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=2)
    if pure_bf16:
        return Precision(compute, compute, device_type)
    return Precision(torch.float32 if compute.itemsize < 4 else compute, compute, device_type)
