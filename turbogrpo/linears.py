"""How the weight matmuls run on the CPU: each ``nn.Linear`` as it is, or by oneDNN (a rollout on packed
copies of the weights; the training forward and backward on the weights themselves).

A rollout multiplies few rows (the live batch, a tree's nodes, a prefill's prompt tokens) by every
weight of the model, with weights that stay fixed for the whole rollout. On the CPU, torch's float32
``F.linear`` runs MKL's sgemm, whose speed depends on the CPU: on this project's 2-core AMD EPYC
(AVX-512, no AMX) it took 96 ms for SmolLM2-135M's 211 weight matmuls at 32 rows, against 34 ms
through oneDNN with each weight reordered once into oneDNN's blocked layout (1 row: 36 against 19 ms;
2,048 rows: 3.2 against 1.3 s; a 2048^3 product 195 against 442 GFLOP/s; ``python bench/decode_ops.py
--threads 2 --parts linears --calls 1``). oneDNN computes in IEEE float32 here too (no bf16 or TF32
shortcut: ``tests/test_linears.py`` checks it); its sums round in another order, as any two GEMM kernels
do (about 1e-6 relative).

Kernels (``LINEAR_KERNELS``, chosen by ``DecodeSchedule.linears``):

* ``module``: every module as it is (any device, dtype, adapter or hook).
* ``onednn``: for the rollout's duration, every plain ``nn.Linear`` with a float32 or bfloat16 CPU
  weight multiplies by a packed copy of its weight (``torch.ops.mkldnn``), in the dtype ``F.linear``
  computes in there (under bf16 autocast, as the trainer's bf16 mode runs rollouts: the bf16 weight
  that autocast would cast at every call, cast once). Each copy is made at its module's first packed
  call of the rollout (about 0.2 s for SmolLM2's 538 MB in all, like one copy of the weights) and freed
  when the rollout ends, so the weights an optimizer step just wrote are the ones used, and nothing is
  held between rollouts. Modules it does not know how to run exactly are left as they are: subclasses
  that override ``forward`` (quantized layers), modules with their own ``forward`` attribute
  (accelerate's offload hooks), weights that are not plain CPU tensors (FSDP's DTensors, meta), float64.
  A layer's q/k/v and its gate/up (``FUSED_SIBLINGS``) share one packed copy of their stacked weights and
  one product per input.
* ``auto`` (the default): ``onednn`` from the row count where it is faster on this machine, with
  ``F.linear`` below it, measured once per process and dtype with weights streamed from memory
  (``onednn_min_rows``); ``module`` where oneDNN is not 1.1x faster at 32 rows. On the 2-core Xeon
  (AMX) it is not (all 211 weights at 1 / 4 / 32 rows: oneDNN 0.77x / 1.23x / 1.05x MKL's speed, ``python
  bench/decode_ops.py --threads 2 --parts linears --calls 1 --out decode_ops_linears_xeon``), so "auto"
  runs ``module`` there; on the AMD EPYC oneDNN (2.87x at 32 rows). Only for the eager plain and tree
  steps; compiled and graph runners trace the modules as they are, except ``compiled-onednn``, whose graphs
  call the same packed products through one opaque op (``turbogrpo.graph_linears``).

Training (``TRAINING_LINEAR_KERNELS``, chosen by ``model.linear_kernel``) has the same three names
("auto" decides by timing a training-sized forward and backward, ``onednn_trains_faster``). Its
``onednn`` runs each plain float32 ``nn.Linear``'s forward and both backward products (``grad_input =
grad_output @ W``, ``grad_W = grad_output^T @ input``) through oneDNN on the tensors as they are, no
packing (the weights change at every optimizer step): SmolLM2's forward + backward of 8 zero-shot
groups took 44.3 s by MKL and 26.7 s by oneDNN on this machine (``python bench/update.py --parts
kernels``). Gradients flow to the
parameters as ``F.linear``'s do (DDP's hooks, gradient accumulation, checkpointed recomputation); under
autocast or for other dtypes a call runs ``F.linear`` as is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from turbogrpo.cache import measured_once
from turbogrpo.cpu_capability import cpu_capability

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes oneDNN's packed product can compute in, on a CPU that runs them (``CpuCapability.packs``)."""


def onednn_available() -> bool:
    """oneDNN's linear ops run on this CPU (``turbogrpo.cpu_capability``)."""
    return cpu_capability().onednn


class KernelUnavailable(ValueError):
    """An explicit "onednn" kernel asked for on a CPU (or in a dtype) where oneDNN cannot run it."""


def require_onednn(dtype: torch.dtype, *, training: bool = False) -> None:
    """Refuse, in one line naming the CPU and the setting to change, a oneDNN kernel this CPU cannot run
    in ``dtype`` (the dtype the products compute in)."""
    capability = cpu_capability()
    runs = capability.trains(dtype) if training else capability.packs(dtype)
    if runs:
        return
    why = ("oneDNN's linear ops do not run here" if not capability.onednn else
           "oneDNN's bf16 kernels need AVX-512 BW/VL/DQ or AVX-NE-CONVERT" if dtype == torch.bfloat16 else
           f"oneDNN's packed product runs {', '.join(str(d).removeprefix('torch.') for d in PACKABLE_DTYPES)} only")
    raise KernelUnavailable(
        f"linear kernel \"onednn\" cannot run {str(dtype).removeprefix('torch.')} products on this CPU "
        f"({capability.describe()}): {why}; set model.linear_kernel (DecodeSchedule.linears) to \"auto\" or "
        f"\"module\"")


def _plain_linear(module: nn.Module) -> bool:
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


def onednn_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` by oneDNN: ``input [..., in]``, ``weight [out, in]`` packed by
    ``pack_weight`` or a strided tensor (views too), ``bias`` in its dtype -> ``[..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` of ``weight`` computes in here: autocast's, where it is on for the CPU."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weight.dtype


def _version(input: torch.Tensor) -> int | None:
    """``input``'s version counter, which moves at every in-place change; None for an inference tensor
    (made under ``torch.inference_mode``), which has none: its siblings then each compute afresh, exact."""
    return None if input.is_inference() else input._version


def num_rows(input: torch.Tensor) -> int:
    """Rows of ``input [..., in]``: the products one weight product makes."""
    return input.numel() // max(input.shape[-1], 1)  # from the shape: no host sync


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling linears that a decoder layer applies to one and the same input (Llama, Qwen, Mistral,
Gemma): the packed rollout multiplies each set by its weights stacked, one oneDNN call where there were
three (or two), which saves the fixed cost per call that a decoding step's few rows do not hide. SmolLM2's
30 layers, 2-core AMD EPYC (``python bench/decode_ops.py --threads 2 --parts sibling_linears``): q/k/v
1.47x at 1 row, 1.34x at 32, 1.17x at 64; gate/up 1.03-1.15x; both together 1.5 of 8.9 ms saved at 1 row,
2.3 of 18.0 ms at 32 rows."""


class _PackedProduct:
    """The rollout's forward of one linear, or of a set of sibling linears that read the same input
    (``FUSED_SIBLINGS``): ``F.linear`` on a packed copy of the weight (of the siblings' weights stacked along
    their output rows) in the dtype ``F.linear`` would compute in (under bf16 autocast: the bf16 weight
    autocast would cast at every call, cast once). Inputs arrive in any dtype and are cast as autocast
    would. Inputs of fewer than ``min_rows`` rows run the module's own ``F.linear`` (where that is faster
    here), unless that would cast the weight at every call; the packed copy is made at the first call
    that uses it, so a rollout that never multiplies ``min_rows`` rows packs nothing.

    Siblings: the first one called with an input computes every sibling's output at once; each other
    sibling called with that very tensor, unchanged since (same object and version), takes its slice. A
    call with any other input, or a second call of the same sibling, computes afresh, so a model that
    feeds the siblings different tensors still gets exact products, only slower. So does an inference
    tensor (``torch.inference_mode``), which has no version to check; ``generate`` runs outside inference
    mode for that reason, so its siblings share."""

    def __init__(self, modules: list[nn.Linear], min_rows: int = 1):
        self.modules, self.min_rows = modules, min_rows
        self.dtype = _compute_dtype(modules[0].weight)
        self.own_dtype = self.dtype == modules[0].weight.dtype
        self.packed: torch.Tensor | None = None
        biases = [m.bias.detach() for m in modules if m.bias is not None]  # siblings: all or none
        self.bias = torch.cat(biases).to(self.dtype) if biases else None
        self.widths = [m.out_features for m in modules]
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._untaken: set[int] = set()

    def forward_of(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(self._call, index)

    def _call(self, index: int, input: torch.Tensor) -> torch.Tensor:
        module = self.modules[index]
        if self.own_dtype and num_rows(input) < self.min_rows:
            return torch.nn.functional.linear(input, module.weight, module.bias)
        if index in self._untaken and input is self._input and _version(input) == self._version:
            self._untaken.discard(index)
            output = self._outputs[index]
            if not self._untaken:
                self._input, self._outputs = None, ()  # drop the references once every slice is out
            return output
        if self.packed is None:
            weights = [m.weight.detach() for m in self.modules]
            self.packed = pack_weight(weights[0] if len(weights) == 1 else torch.cat(weights), self.dtype)
        output = onednn_product(input.to(self.dtype), self.packed, self.bias)
        if len(self.modules) == 1:
            return output
        outputs = output.split(self.widths, dim=-1)
        if _version(input) is not None:
            self._outputs, self._input, self._version = outputs, input, _version(input)
            self._untaken = set(range(len(self.modules))) - {index}
        return outputs[index]


def _sibling_sets(roots: Iterable[nn.Module], accepts: Callable[[nn.Module], bool]) -> Iterator[list[nn.Linear]]:
    """Each set of ``FUSED_SIBLINGS`` under ``roots`` whose members are all packable plain linears that
    ``accepts`` takes, with one input width, weight dtype and device, and biases on all or none."""
    seen: set[int] = set()
    for root in roots:
        for parent in root.modules():
            if id(parent) in seen:
                continue
            seen.add(id(parent))
            for names in FUSED_SIBLINGS:
                members = [getattr(parent, name, None) for name in names]
                if not all(isinstance(m, nn.Module) and _plain_linear(m) and accepts(m) for m in members):
                    continue
                first = members[0].weight
                if len({id(m) for m in members}) == len(members) and all(
                        m.in_features == members[0].in_features and m.weight.dtype == first.dtype
                        and m.weight.device == first.device and (m.bias is None) == (members[0].bias is None)
                        for m in members):
                    yield members


@contextlib.contextmanager
def module_linears(roots: Iterable[nn.Module]) -> Iterator[int]:
    """Every module as it is (yields 0 modules changed)."""
    yield 0


def _packable(module: nn.Module) -> bool:
    return _compute_dtype(module.weight) in PACKABLE_DTYPES


def require_onednn_for(roots: list[nn.Module]) -> None:
    """Refuse (``require_onednn``) where the dtype a plain linear under ``roots`` computes in is packable but
    oneDNN cannot pack it on this CPU."""
    for dtype in {_compute_dtype(m.weight) for root in roots for m in root.modules() if _plain_linear(m)}:
        if dtype in PACKABLE_DTYPES:
            require_onednn(dtype)


@contextlib.contextmanager
def onednn_linears(roots: Iterable[nn.Module], min_rows: int = 1) -> Iterator[int]:
    """For the ``with`` block, every packable ``nn.Linear`` under ``roots`` runs ``onednn_product`` on a
    packed copy of its weight as it is now, in the dtype it would compute in, for inputs of at least
    ``min_rows`` rows (yields how many modules run so); each set of ``FUSED_SIBLINGS`` shares one packed
    product. The block must not change the weights, need gradients through them, or change autocast (a
    rollout runs under ``no_grad`` and one autocast state). Refused (``require_onednn``) where a packable
    module's dtype cannot run on this CPU; "auto" asks the CPU first and keeps the modules instead."""
    roots = list(roots)
    require_onednn_for(roots)
    forwards: dict[nn.Module, Callable] = {}
    for members in _sibling_sets(roots, _packable):
        product = _PackedProduct(members, min_rows)
        forwards.update((module, product.forward_of(index)) for index, module in enumerate(members))
    def forward_for(module: nn.Module) -> Callable:
        return forwards.get(module) or _PackedProduct([module], min_rows).forward_of(0)

    with _replaced_forwards(roots, forward_for, _packable) as num_changed:
        yield num_changed


class OneDnnLinear(torch.autograd.Function):
    """``F.linear(input, weight, bias)`` with the forward and both backward products by oneDNN."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return onednn_product(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [N, out]
        if ctx.needs_input_grad[0]:
            grad_input = onednn_product(grad_output, weight.t())  # [..., out] @ [out, in]
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_product(grad_2d.t(), input.reshape(-1, input.shape[-1]).t())  # [out, N] @ [N, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_input, grad_weight, grad_bias


class _TrainingForward:
    """A module's forward while training: ``OneDnnLinear`` on its current weight (read at each call, so
    it follows the optimizer and any parameter swap), ``F.linear`` for what oneDNN is not used for here."""

    def __init__(self, module: nn.Linear, min_rows: int = 1):
        self.module, self.min_rows = module, min_rows

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if (input.dtype != torch.float32 or weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
                or num_rows(input) < self.min_rows):
            return torch.nn.functional.linear(input, weight, bias)
        return OneDnnLinear.apply(input, weight, bias)


@contextlib.contextmanager
def _replaced_forwards(roots: Iterable[nn.Module], make_forward: Callable[[nn.Linear], Callable],
                       accepts: Callable[[nn.Module], bool]) -> Iterator[int]:
    """For the ``with`` block, every packable module under ``roots`` that ``accepts`` runs
    ``make_forward(module)`` as its forward (an instance attribute: ``nn.Module.__call__`` runs
    ``self.forward``, so hooks still fire); yields how many; restores them all on exit."""
    changed: list[nn.Module] = []
    seen: set[int] = set()
    try:
        for root in roots:
            for module in root.modules():
                if id(module) in seen or not _plain_linear(module) or not accepts(module):
                    continue
                seen.add(id(module))
                module.forward = make_forward(module)
                changed.append(module)
        yield len(changed)
    finally:
        for module in changed:
            del module.forward


def onednn_training_linears(roots: Iterable[nn.Module], min_rows: int = 1) -> contextlib.AbstractContextManager[int]:
    """For the ``with`` block, every plain float32 ``nn.Linear`` under ``roots`` runs ``OneDnnLinear`` for
    inputs of at least ``min_rows`` rows (refused where oneDNN does not run here: ``require_onednn``)."""
    require_onednn(torch.float32, training=True)
    return _replaced_forwards(roots, functools.partial(_TrainingForward, min_rows=min_rows),
                              lambda module: module.weight.dtype == torch.float32)


def speedup(baseline: Callable[[], object], contender: Callable[[], object], repeats: int) -> float:
    """How many times faster ``contender`` runs than ``baseline`` here (the per-machine choices): the median, over
    ``repeats`` pairs of calls alternated after one warm-up call each, of the pair's time ratio. Alternating makes a
    burst of other work on the machine slow both sides of a pair alike; timing all of one, then all of the other, once
    let a burst during one side fix a wrong choice for good (``cache.measured_once`` keeps the first answer)."""
    baseline()
    contender()
    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        baseline()
        middle = time.perf_counter()
        contender()
        ratios.append((middle - start) / (time.perf_counter() - middle))
    return statistics.median(ratios)


ROW_GRID = (1, 2, 4, 8, 16, 32)
"""Rows at which ``onednn_min_rows`` times both kernels."""
NUM_TIMED_LAYERS = 12
"""MLP weight pairs the timing cycles through (84 MB in float32): more than the caches hold, so that
the weights stream from memory as a decoding step's do (with one pair, cache-resident weights favour
MKL at few rows by up to 2x, which a real step does not see)."""


def onednn_min_rows(dtype: torch.dtype, num_threads: int, margin: float = 1.1) -> int | None:
    """The fewest rows from which oneDNN's packed product beats ``F.linear`` here, or None where it
    does not beat it by ``margin`` at 32 rows, or cannot run in ``dtype`` on this CPU (then ``F.linear``
    runs everywhere). Timed once per machine, dtype and thread count (``cache.measured_once``), at SmolLM2's MLP shape (576 x 1536
    and back) for every row count of ``ROW_GRID`` (about half a second): the smallest count at which
    oneDNN is faster there and at every larger one. On the 2-core Xeon (AMX) MKL wins below a handful of
    rows; on the AMD EPYC oneDNN wins at every count."""
    if not cpu_capability().packs(dtype):
        return None
    return measured_once("onednn_min_rows", machine_key(dtype=str(dtype), num_threads=num_threads, margin=margin),
                         functools.partial(_timed_min_rows, dtype, num_threads, margin))


def machine_key(**shape) -> dict:
    """What a timed choice depends on besides ``shape``: the CPU and the torch build (``cache.measured_once``)."""
    return {"cpu": cpu_capability().describe(), "cpu_model": _cpu_model(), "cores": os.cpu_count(),
            "torch": torch.__version__, "timing": TIMING_METHOD, **shape}


TIMING_METHOD = "alternated"
"""How the per-machine choices time their contenders (``speedup``), part of their cache key: a machine re-times the
choices it made with an earlier method (each timed both sides in a block of its own, and one burst of load kept bf16
products unpacked below 8 rows on a machine where oneDNN wins at every row count, 1.4-1.6x)."""


def _cpu_model() -> str:
    """This CPU's model name (a home folder, and the cache in it, may be shared by machines of several kinds)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _timed_min_rows(dtype: torch.dtype, num_threads: int, margin: float) -> int | None:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inner, generator=generator).to(dtype)
               for _ in range(NUM_TIMED_LAYERS) for out, inner in ((1536, 576), (576, 1536))]
    packed = [pack_weight(w) for w in weights]
    speedups = {}  # rows -> F.linear's time over oneDNN's
    with torch.no_grad():
        for rows in ROW_GRID:
            inputs = [torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w in weights]
            speedups[rows] = speedup(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(inputs, weights)],
                                     lambda: [onednn_product(x, p) for x, p in zip(inputs, packed)], 7)
    if speedups[ROW_GRID[-1]] <= margin:
        return None
    min_rows = ROW_GRID[-1]
    for rows in reversed(ROW_GRID):
        if speedups[rows] <= 1.0:
            break
        min_rows = rows
    return min_rows


def onednn_is_faster(dtype: torch.dtype, num_threads: int) -> bool:
    """Whether "auto" runs oneDNN at all here (at some row count; ``onednn_min_rows``)."""
    return onednn_min_rows(dtype, num_threads) is not None


def measured_kernel(kernel: Callable[..., contextlib.AbstractContextManager[int]],
          min_rows_for: Callable[[torch.dtype, int], int | None]):
    """``kernel`` from the row count ``min_rows_for(dtype, threads)`` gives for the dtype the roots'
    weights compute in on the CPU (autocast's, where it is on: a bf16 run's float32 masters multiply in
    bf16), where oneDNN runs faster here, else ``module_linears`` (None: nowhere, or oneDNN cannot run
    that dtype on this CPU)."""
    def choose(roots: Iterable[nn.Module]) -> contextlib.AbstractContextManager[int]:
        roots = list(roots)
        weight = next((p for root in roots for p in root.parameters()), None)
        min_rows = None if weight is None or weight.device.type != "cpu" else min_rows_for(
            _compute_dtype(weight), torch.get_num_threads())
        return module_linears(roots) if min_rows is None else kernel(roots, min_rows=min_rows)
    return choose


def onednn_trains_faster(dtype: torch.dtype, num_threads: int, margin: float = 1.1) -> int | None:
    """1 where ``OneDnnLinear``'s forward and backward beat ``F.linear``'s by ``margin`` here, else None
    (the ``min_rows`` of "auto" training; None too where oneDNN cannot train in ``dtype`` on this CPU).
    Timed once per machine and thread count (``cache.measured_once``) at a training shape, 512 rows through SmolLM2's 576 x 1536
    MLP weight (about half a second): a decoding step's few rows say nothing about it."""
    if not cpu_capability().trains(dtype):
        return None
    return measured_once("onednn_trains_faster", machine_key(num_threads=num_threads, margin=margin),
                         functools.partial(_timed_trains_faster, num_threads, margin))


def _timed_trains_faster(num_threads: int, margin: float) -> int | None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=generator, requires_grad=True)
    input = torch.randn(512, 576, generator=generator, requires_grad=True)
    grad = torch.randn(512, 1536, generator=generator)

    def step(product) -> None:
        torch.autograd.grad(product(input, weight, None), (input, weight), grad)

    return 1 if speedup(lambda: step(torch.nn.functional.linear), lambda: step(OneDnnLinear.apply), 5) > margin else None


LINEAR_KERNELS: dict[str, Callable[[Iterable[nn.Module]], contextlib.AbstractContextManager[int]]] = {
    "auto": measured_kernel(onednn_linears, onednn_min_rows),
    "module": module_linears,
    "onednn": onednn_linears,
}
"""Name -> a context manager over the rollout's modules (see the module docstring)."""

TRAINING_LINEAR_KERNELS: dict[str, Callable[[Iterable[nn.Module]], contextlib.AbstractContextManager[int]]] = {
    "auto": measured_kernel(onednn_training_linears, onednn_trains_faster),
    "module": module_linears,
    "onednn": onednn_training_linears,
}
"""Name -> a context manager over the modules a training forward and backward run (module docstring)."""
