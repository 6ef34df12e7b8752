"""How a rollout's weight matmuls run: each ``nn.Linear`` as it is, or on a oneDNN-packed copy of its
weight (CPU).

A rollout multiplies few rows (the live batch, a tree's nodes, a prefill's prompt tokens) by every
weight of the model, with weights that stay fixed for the whole rollout. On the CPU, torch's float32
``F.linear`` runs MKL's sgemm, whose speed depends on the CPU: on this project's 2-core AMD EPYC
(AVX-512, no AMX) it took 86-100 ms for SmolLM2-135M's 211 weight matmuls at 32 rows, against 33 ms
through oneDNN with each weight reordered once into oneDNN's blocked layout (1 row: 38 against 17 ms;
2,048 rows: 3.2 against 1.3 s; a 2048^3 product 175 against 417 GFLOP/s; ``python bench/decode_ops.py
--parts linears``). oneDNN computes in IEEE float32 here too (no bf16 or TF32 shortcut:
``tests/rollout/test_linears.py`` checks it); its sums round in another order, as any two GEMM kernels
do (about 1e-6 relative).

Kernels (``LINEAR_KERNELS``, chosen by ``DecodeSchedule.linears``):

* ``module``: every module as it is (any device, dtype, adapter or hook).
* ``onednn``: for the rollout's duration, every plain ``nn.Linear`` with a float32 or bfloat16 CPU
  weight multiplies by a packed copy of its weight (``torch.ops.mkldnn``), in the dtype ``F.linear``
  computes in there (under bf16 autocast, as the trainer's bf16 mode runs rollouts: the bf16 weight
  that autocast would cast at every call, cast once). The copies are made when the
  rollout starts (about 0.2 s for SmolLM2's 538 MB, like one copy of the weights) and freed when it
  ends, so the weights an optimizer step just wrote are the ones used, and nothing is held between
  rollouts. Modules it does not know how to run exactly are left as they are: subclasses that override
  ``forward`` (quantized layers), modules with their own ``forward`` attribute (accelerate's offload
  hooks), weights that are not plain CPU tensors (FSDP's DTensors, meta), float64.
* ``auto`` (the default): ``onednn`` where it is faster on this machine, measured once per process and
  dtype (``onednn_is_faster``), else ``module``. Only for the eager plain and tree steps; compiled and
  graph runners trace the modules as they are.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` whose forward is ``F.linear`` of a plain float32/bf16 CPU weight."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and "forward" not in module.__dict__ and type(weight) in (nn.Parameter, torch.Tensor)
            and weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES and weight.layout == torch.strided
            and (module.bias is None or module.bias.dtype == weight.dtype))


def pack_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight [out, in]`` (cast to ``dtype``, if given) reordered into oneDNN's blocked layout (an opaque
    tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype or weight.dtype))


def packed_linear(packed: torch.Tensor, bias: torch.Tensor | None, input: torch.Tensor) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` by oneDNN, from ``packed = pack_weight(weight)``: ``input``
    ``[..., in]`` -> ``[..., out]``, in the packed weight's dtype (``bias`` already in it)."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` of ``weight`` computes in here: autocast's, where it is on for the CPU."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weight.dtype


class _PackedForward:
    """A module's forward for the rollout: ``F.linear`` on a packed copy of its weight in the dtype
    ``F.linear`` would compute in (under bf16 autocast: the bf16 weight autocast would cast at every call,
    cast once). Inputs arrive in any dtype and are cast as autocast would."""

    def __init__(self, module: nn.Linear):
        self.dtype = _compute_dtype(module.weight)
        self.packed = pack_weight(module.weight, self.dtype)
        self.bias = None if module.bias is None else module.bias.detach().to(self.dtype)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return packed_linear(self.packed, self.bias, input.to(self.dtype))


@contextlib.contextmanager
def module_linears(roots: Iterable[nn.Module]) -> Iterator[int]:
    """Every module as it is (yields 0 modules changed)."""
    yield 0


@contextlib.contextmanager
def onednn_linears(roots: Iterable[nn.Module]) -> Iterator[int]:
    """For the ``with`` block, every packable ``nn.Linear`` under ``roots`` runs ``packed_linear`` on a
    packed copy of its weight as it is now, in the dtype it would compute in (yields how many modules run
    so). The block must not change the weights, need gradients through them, or change autocast (a
    rollout runs under ``no_grad`` and one autocast state)."""
    changed: list[nn.Module] = []
    seen: set[int] = set()
    try:
        for root in roots:
            for module in root.modules():
                if id(module) in seen or not _packable(module) or _compute_dtype(module.weight) not in PACKABLE_DTYPES:
                    continue
                seen.add(id(module))
                # An instance attribute: nn.Module.__call__ runs self.forward, so hooks still fire.
                module.forward = _PackedForward(module)
                changed.append(module)
        yield len(changed)
    finally:
        for module in changed:
            del module.forward


def _median_seconds(function: Callable[[], object], repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.cache
def onednn_is_faster(dtype: torch.dtype, num_threads: int, margin: float = 1.1) -> bool:
    """Whether oneDNN's packed product beats ``F.linear`` by ``margin`` on this CPU in ``dtype``, timed
    once per process, dtype and thread count at a decoding step's shape (32 rows of a 576 x 1536 weight
    and back, SmolLM2's MLP; about 30 ms)."""
    if not onednn_available() or dtype not in PACKABLE_DTYPES:
        return False
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=generator).to(dtype), torch.randn(576, 1536, generator=generator).to(dtype)]
    inputs = [torch.randn(32, 576, generator=generator).to(dtype), torch.randn(32, 1536, generator=generator).to(dtype)]
    packed = [pack_weight(w) for w in weights]
    with torch.no_grad():
        dense_s = _median_seconds(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(inputs, weights)], 15)
        packed_s = _median_seconds(lambda: [packed_linear(p, None, x) for x, p in zip(inputs, packed)], 15)
    return dense_s > margin * packed_s


def _auto_linears(roots: Iterable[nn.Module]) -> contextlib.AbstractContextManager[int]:
    roots = list(roots)
    weight = next((p for root in roots for p in root.parameters()), None)
    if weight is None or weight.device.type != "cpu" or not onednn_is_faster(weight.dtype, torch.get_num_threads()):
        return module_linears(roots)
    return onednn_linears(roots)


LINEAR_KERNELS: dict[str, Callable[[Iterable[nn.Module]], contextlib.AbstractContextManager[int]]] = {
    "auto": _auto_linears,
    "module": module_linears,
    "onednn": onednn_linears,
}
"""Name -> a context manager over the rollout's modules (see the module docstring)."""
