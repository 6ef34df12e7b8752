"""How a decoding step runs: eagerly, or compiled whole by ``torch.compile`` (``DecodeSchedule.runner``
for the plain step, ``Speculation.runner`` for the two device parts of the speculative tree step).

``plain_step`` has no host sync and no untraceable object, so dynamo captures it as one graph
(``fullgraph=True``); the attention then reads a static number of KV slots (``static_slots``).

* ``eager``: the default.
* ``compiled``: inductor, fusing each layer's norms, rotary, activations, the sampler's processing and
  the KV writes around the weight products. The plain step is compiled with static shapes
  (``dynamic=False``): one graph per bucket of the live batch, never a dynamic-batch graph, whose
  kernels were slower (below). The cache sizes its stacked query block by the batch alone
  (``GroupedKVCache``: min(G, B) groups x min(S, B) rows, whichever groups are still live), and the
  prompt width P and the generated slots read (the slots in use rounded up to ``SLOT_BLOCK``) are the
  graph's dynamic sizes (``GroupedKVCache.dynamic_dims``), so a rollout of new prompts, and each step of a
  rollout, reuses the graphs (a second graph per bucket where prompts of unequal length meet one that fills
  P). Use it with ``buckets="step8"`` (``decode.COMPILED_BUCKETS``): at most N / 8 + 3 buckets per rollout, at most
  7 finished rows carried (``pow2`` carries up to half the batch).
* ``compiled-pinned``: ``compiled`` with torch's OpenMP threads pinned one per physical core for
  the whole rollout, as vLLM's CPU worker pins its threads (``pinned_threads``, entered once by ``runner_scope``).
* ``compiled-onednn``: ``compiled`` with the graph's weight products as the rollout's packed oneDNN products
  (``turbogrpo.graph_linears``: an opaque op per input, q/k/v and gate/up stacked, a post-grad pass puts them
  in), where ``DecodeSchedule.linears`` packs them ("auto": where oneDNN is faster here, by measurement), and the
  products of a one-row bucket as inductor's own vectorised loop where that measured faster than oneDNN here
  (``graph_linears.reduction_is_faster``); ``compiled`` runs aten's ``mm``, MKL's sgemm in float32, which on the
  AMD EPYC reads the weights at under half the packed product's speed (``bench/gemv_kernels.py``).
* ``dynamo``: dynamo only, no code generation (``backend="eager"``): the same graph capture and
  recompilation behaviour at no compile cost, for tests and for finding graph breaks.
* ``auto`` (``resolve_runner``): per device type, ``AUTO_RUNNERS``; on the CPU, eager or compiled by a
  measurement on this machine's CPU kind and the model's shape, taken once (``cache.measured_once``); the
  compiled runner timed is ``compiled-onednn`` where the eager step runs packed oneDNN products here
  (``compiled_candidate``), else ``compiled``.

Compilation is paid once per model shape and machine: inductor's caches (its FX graphs, and
AOTAutograd's) are kept in turbogrpo's cache folder (``use_compile_cache``; where a vLLM build pointed inductor at its
own per-model folder, only during the compiled step's calls), so a later process
only traces the step again (dynamo) and loads the compiled kernels. Each new graph shows a progress
line ("compiling the decoding step for bucket B ..."), and its time is kept
(``CompiledStep.compile_seconds``) for benchmarks. SmolLM2-135M in float32 on the 2-core AMD EPYC,
loaded (load average 6-7, the benchmark at nice 5; ``bench/compiled_step.py --quick``): 208-230 s a
bucket cold, 23-25 s warm (dynamo's trace of 30 layers: dynamo's own on-disk cache,
``torch._dynamo.config.caching_precompile``, fails on this step in torch 2.13 with "check_fn.guards_state
must not be None", so every process traces its buckets again).

Before this (a one-off script: SmolLM2-135M, 4 GSM8K prompts x 8 samples x 128 tokens, 2-core Xeon,
float32, kept heap): eager 16-22 s per rollout; compiled with static shapes 16.7-17.2 s after an 18 s
compile, with the dynamic shapes that other prompt lengths and live batches brought 22.6 s after
60-190 s of compiling per new shape family. ``bench/compiled_step.py`` measures the static per-bucket
step against eager (float32 and bf16, live batches 1, 4, 16, 64, against the weight-read floor and the
GEMM rate).

The tree step's parts and a speculative rollout's plain steps (``RUNNERS``) compile with dynamo's automatic dynamic
shapes: a speculative step reads the slots in use, which grow every step (no static slots there yet).

On CUDA, two opt-in runners replay the plain step from CUDA graphs (``GraphReplay``): ``cudagraph``
(the eager step, captured) and ``compiled-cudagraph`` (the inductor-compiled step, captured). Not
measured yet: no GPU was at hand when they were written. ``bench/gpu_rollout.py`` times them against
``eager`` and ``compiled`` (a whole rollout and one step at B=64), so that the next GPU session sets
``DEFAULT_SCHEDULES["cuda"].runner`` from that measurement.

A graph is recorded per bucket of the live batch and per rollout (the step's buffers -- KV cache, rows,
outputs -- are allocated per rollout, so their addresses change between rollouts); use them with
``buckets="pow2"`` (at most log2(N) + 1 recordings per rollout). Not done: a buffer pool per bucket
kept across rollouts, which would let one recording serve every rollout of a run, and
``torch.compile(mode="reduce-overhead")``: inductor skips its CUDA graphs when a graph mutates inputs
at non-static addresses (the KV cache, the outputs), and marking them static
(``torch._dynamo.mark_static_address``) recompiles for every bucket of every rollout, past dynamo's
recompile limit -- both need that pool.

Where weights move or are rebuilt inside a rollout (FSDP resharding: its all-gathers allocate and
communicate inside the forward, which a graph cannot hold), run ``eager`` or ``compiled``. Weights
updated in place between rollouts (the optimizer step) or merged/unmerged LoRA adapters between
rollouts are fine for these runners (a rollout records its own graphs), but not for code compiled
with guards on the module structure, which recompiles after a LoRA merge changes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch._dynamo
from torch import nn

from turbogrpo.cache import cache_root, measured_once
from turbogrpo.graph_linears import STACKED_LINEAR_PASS
from turbogrpo.linears import onednn_is_faster
from turbogrpo.progress import ticking
from turbogrpo.rollout.step import DecodeState

Step = TypeVar("Step", bound=Callable)

COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
RECOMPILE_LIMIT = 64
"""Graphs dynamo keeps per step function: buckets x group layouts (the default 8 would fall back to
running the step uncompiled once a long run has seen more)."""


def compile_cache_folder() -> Path:
    """Where inductor keeps its compiled graphs for turbogrpo: under ``cache_root()``, per torch version."""
    return cache_root() / "torch-compile" / f"torch-{torch.__version__}"


USER_COMPILE_CACHE = os.environ.get(COMPILE_CACHE_ENV)
"""``TORCHINDUCTOR_CACHE_DIR`` as this process was started with, read when turbogrpo's rollout is imported:
building vLLM later points the variable at vLLM's own per-model folder (``vllm.compilation``), which is not a
choice of the user's and must not receive turbogrpo's graphs."""


def use_compile_cache() -> Path:
    """The folder inductor's on-disk caches (FX graphs, AOTAutograd's) hold turbogrpo's compiled steps in:
    ``compile_cache_folder()`` unless the user chose one (``USER_COMPILE_CACHE``, or the variable set now where
    no vLLM build has changed it since); keeps both caches on, and points the variable at it where nothing else
    set it (where vLLM did, ``CompiledStep`` switches for its own calls: ``compiling_into``). Their keys hold the
    CPU's vector ISA and the torch build, so one folder serves several machines."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get(COMPILE_CACHE_ENV) if USER_COMPILE_CACHE is None else USER_COMPILE_CACHE
    if chosen is not None and chosen_by_vllm(chosen):
        chosen = None
    unset = chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir())
    folder = compile_cache_folder() if unset else Path(chosen)
    folder.mkdir(parents=True, exist_ok=True)
    if os.environ.get(COMPILE_CACHE_ENV) is None or unset and not chosen_by_vllm(os.environ[COMPILE_CACHE_ENV]):
        os.environ[COMPILE_CACHE_ENV] = str(folder)  # nothing else reads it: every compile of the process lands here
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return folder


def chosen_by_vllm(folder: str) -> bool:
    """Whether ``folder`` is one vLLM's compiler set for its own graphs (``<VLLM_CACHE_ROOT>/torch_compile_cache/
    <hash>/.../inductor_cache``, per model and config: a later vLLM config, or none, never reads it again)."""
    return "torch_compile_cache" in Path(folder).parts


def compiling_into(folder: str) -> contextlib.AbstractContextManager:
    """For the block (a call that may compile), inductor reads and writes ``folder``; after it, the variable holds
    what it held before (vLLM reads its own folder from it for its compiles). torch's own ``temporary_cache_dir``
    also clears inductor's in-memory caches of the folder on the way in and out; nothing where the variable already
    names ``folder`` (no vLLM built in this process)."""
    if os.environ.get(COMPILE_CACHE_ENV) == folder:
        return contextlib.nullcontext()
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    return temporary_cache_dir(folder)


def bucket_of(state: DecodeState) -> tuple:
    """What the plain step's static graph is specialised on: the rows of the batch, the query block's groups and
    rows per group (functions of the rows under static slots), whether it is dense, whether the live prompts fill P,
    and the model's dtype (a model cast to another dtype compiles its own graphs, which must show and be kept)."""
    layout = state.cache.layout
    return (state.next_B.shape[0], layout.num_groups, layout.max_per_group, layout.dense,
            state.cache.prompts_fill_width, next(state.model.parameters()).dtype)


class CompiledStep:
    """``function(state, *rest)`` compiled by ``torch.compile`` (``backend``), built once per process.

    ``static``: one graph per ``bucket_of(state)`` (``dynamic=False``, the prompt width marked dynamic);
    else dynamo's automatic dynamic shapes (the tree step's parts). A call that meets a new bucket shows
    a progress line while it compiles and keeps the seconds it took in ``compile_seconds``."""

    def __init__(self, function: Step, backend: str, static: bool, products: str = "aten"):
        self.cache_folder = str(use_compile_cache())
        self.function, self.backend, self.static = function, backend, static
        self.compiled = torch.compile(function, fullgraph=True, backend=backend, dynamic=False if static else None,
                                      options=GRAPH_PRODUCTS[products])
        self.compile_seconds: dict[tuple, float] = {}
        """Bucket (``bucket_of``; the function's name when not static) -> seconds of its first call."""
        self.step_seconds: dict[tuple, list[float]] | None = None
        """Off (None), or bucket -> the seconds of each later call (``timing_steps``: where a rollout's time goes,
        bucket by bucket). Host time: on the CPU a step's whole work, on a GPU only its launches."""
        self._guarded_rollout: weakref.ref | None = None
        self._guarded: set[tuple] = set()

    def __call__(self, state: DecodeState, *rest):
        sizes = mark_dynamic_sizes(state) if self.static else ()
        bucket = bucket_of(state) if self.static else (self.function.__name__,)
        if bucket in self.compile_seconds:  # a call may still compile (a tree part's new shapes): into our folder
            with compiling_into(self.cache_folder), self.guards_for(state, (bucket, sizes)):
                if self.step_seconds is None:
                    return self.compiled(state, *rest)
                start = time.perf_counter()
                out = self.compiled(state, *rest)
                self.step_seconds.setdefault(bucket, []).append(time.perf_counter() - start)
                return out
        what = "the decoding step" if self.static else f"the tree step's {self.function.__name__}"
        where = f" for bucket B={bucket[0]} ({bucket[1]} groups)" if self.static else ""
        start = time.perf_counter()
        with ticking(f"compiling {what}{where} with {self.backend} (once per machine; cached after)"), \
                compiling_into(self.cache_folder):
            out = self.compiled(state, *rest)
        self.compile_seconds[bucket] = time.perf_counter() - start
        return out

    def guards_for(self, state: DecodeState, signature: tuple) -> contextlib.AbstractContextManager:
        """How dynamo checks its guards for this call of a static step: in full on the first call of a rollout with
        ``signature`` (bucket and dynamic sizes), after it only the guards that told its graphs apart
        (``skip_guard_eval_unsafe``: the ones that failed when a graph was compiled). A rollout's model, dtype and
        modules do not change inside it, and the first call of each signature checked them all (and compiled if
        needed); the full check cost ~2 ms a step for SmolLM2's 30 layers, ~10% of a one-row bf16 step on the
        2-core AMD EPYC (a one-off A/B). A rollout is one KV cache; nothing changes where the user set another stance."""
        if not self.static or torch._dynamo.eval_frame._stance.stance != "default":
            return contextlib.nullcontext()
        if self._guarded_rollout is None or self._guarded_rollout() is not state.cache:
            self._guarded_rollout, self._guarded = weakref.ref(state.cache), set()
        if signature in self._guarded:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        self._guarded.add(signature)
        return contextlib.nullcontext()


@contextlib.contextmanager
def timing_steps(step: CompiledStep) -> Iterator[dict[tuple, list[float]]]:
    """Keep the seconds of each warm call of ``step`` by bucket for as long as the block runs (the dict yielded;
    a call that compiles counts in ``compile_seconds`` only)."""
    step.step_seconds = {}
    try:
        yield step.step_seconds
    finally:
        step.step_seconds = None


def mark_dynamic_sizes(state: DecodeState) -> tuple[int, ...]:
    """Mark the prompt width P and the generated slots read dynamic on each tensor that has them
    (``GroupedKVCache.dynamic_dims``), once per tensor: ``mark_dynamic`` does Python work
    at every call (SmolLM2 has 61 such tensors), and the tensors live for a whole rollout; a tensor made anew (rows
    retired, a new rollout) carries no mark and gets one. Returns the sizes marked (P, then the slots read; one size
    where they are equal)."""
    sizes = {}
    for tensor, dim in state.cache.dynamic_dims():
        if dim not in getattr(tensor, "_dynamo_dynamic_indices", ()):  # where mark_dynamic records its marks
            torch._dynamo.mark_dynamic(tensor, dim)
        sizes[tensor.shape[dim]] = None  # a dict keeps their order
    return tuple(sizes)


GRAPH_PRODUCTS: dict[str, dict | None] = {
    "aten": None,
    "stacked": {"post_grad_custom_pre_pass": STACKED_LINEAR_PASS},
}
"""How an inductor graph multiplies by the weights -> its inductor options: aten's ``mm`` on the weights as they are,
or ``graph_linears.stacked_linear`` (one opaque op per input, packed oneDNN products in the rollout's scope)."""


@functools.cache
def _compiled(function: Step, backend: str, static: bool = False, products: str = "aten") -> CompiledStep:
    return CompiledStep(function, backend, static, products)


# --- threads pinned as vLLM's CPU worker pins them ----------------------------------------------------------

def physical_cores(cpus: list[int]) -> list[int]:
    """One logical CPU per physical core among ``cpus`` (the last of each core's SMT siblings, as vLLM's automatic
    binding picks on x86); ``cpus`` as they are where the topology cannot be read."""
    chosen = {}
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            return cpus
        chosen[siblings] = cpu  # cpus are increasing: the last sibling wins
    return sorted(chosen.values())


@functools.cache
def _openmp_runtime() -> ctypes.CDLL:
    """The OpenMP runtime torch's threads run on (libgomp; Intel's libiomp5 exports the same entry points)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp5" in line})
    except OSError:
        paths = []
    if not paths:
        raise ValueError("runner 'compiled-pinned' pins torch's OpenMP threads, and this torch build runs none "
                         "(no libgomp / libiomp5 in the process); use runner 'compiled'")
    return ctypes.CDLL(paths[0])


_TEAM_CALL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _on_every_thread(affinity: Callable[[int], set[int]]) -> None:
    """Set the CPU affinity of each of torch's OpenMP threads (thread i gets ``affinity(i)``), from inside one
    parallel region of ``torch.get_num_threads()`` threads: the team torch's own parallel loops run on, as vLLM's
    ``init_cpu_threads_env`` does (``#pragma omp parallel`` + ``sched_setaffinity``)."""
    runtime = _openmp_runtime()
    callback = _TEAM_CALL(lambda _: os.sched_setaffinity(0, affinity(runtime.omp_get_thread_num())))
    runtime.GOMP_parallel.argtypes = [_TEAM_CALL, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    runtime.GOMP_parallel(callback, None, torch.get_num_threads(), 0)


class pinned_threads:
    """For the ``with`` block, torch's OpenMP thread i runs on physical core i only (of the CPUs this process
    may use); after it, every thread may run anywhere it could before (children started later, which inherit
    the main thread's affinity, are not pinned)."""

    def __enter__(self):
        self.allowed = os.sched_getaffinity(0)
        cores = physical_cores(sorted(self.allowed))
        _on_every_thread(lambda i: {cores[i % len(cores)]})
        return self

    def __exit__(self, *exc) -> None:
        _on_every_thread(lambda i: self.allowed)


RUNNER_SCOPES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {"compiled-pinned": pinned_threads}
"""Runners that hold a setting over a whole rollout, entered once around it (``runner_scope``): pinning the
threads at every step would cost two OpenMP parallel regions and a system call per thread each step."""


def runner_scope(runner: str) -> contextlib.AbstractContextManager:
    """The context a rollout with ``runner`` runs in (``RUNNER_SCOPES``; nothing for most runners)."""
    return RUNNER_SCOPES.get(runner, contextlib.nullcontext)()


RUNNERS: dict[str, Callable[[Step], Step]] = {
    "eager": lambda function: function,
    "compiled": lambda function: _compiled(function, "inductor"),
    "compiled-onednn": lambda function: _compiled(function, "inductor", products="stacked"),
    "dynamo": lambda function: _compiled(function, "eager"),
}
"""Name -> how to run a part of the tree step, and a speculative rollout's plain steps: the function itself, or its
compiled version (built once per process and function, kept by ``_compiled``; dynamo's automatic dynamic shapes);
``compiled-onednn`` multiplies by the weights through ``graph_linears.stacked_linear``, as the plain runner of that
name does (``STACKED_PRODUCT_RUNNERS``)."""

class GraphReplay:
    """Runs ``function(state)`` (a plain step) by CUDA-graph replay, one graph per bucket of the batch.

    The first step of a bucket runs ``function`` as is, on a side stream (the warm-up CUDA graphs need:
    it also compiles a compiled ``function``), the second records it into a graph and replays it, later
    ones only replay. A new bucket shows as a new ``state.next_B`` tensor (``DecodeState.keep`` rebuilds
    the rows' tensors; within a bucket every buffer the step touches stays where it is, and the uniform
    numbers are refilled in place before each step). If recording fails (an operation a graph cannot
    hold), it warns once and runs ``function`` as is for the rest of the rollout.
    """

    def __init__(self, function: Callable[[DecodeState], None]):
        self.function = function
        self.graph: torch.cuda.CUDAGraph | None = None
        self._recorded_for: weakref.ref | None = None
        self.fallback_reason: str | None = None

    def __call__(self, state: DecodeState) -> None:
        if state.next_B.device.type != "cuda":
            raise ValueError("DecodeSchedule.runner='cudagraph'/'compiled-cudagraph' replays CUDA graphs and "
                             f"needs a model on a CUDA device (this one is on {state.next_B.device}); use "
                             "runner='eager' or 'compiled'")
        if self.fallback_reason is not None:
            self.function(state)
            return
        if self._recorded_for is None or self._recorded_for() is not state.next_B:
            self.graph, self._recorded_for = None, weakref.ref(state.next_B)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.function(state)
            torch.cuda.current_stream().wait_stream(side)
            return
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.function(state)  # recorded, not run: the replay below runs it
            except RuntimeError as error:
                self.fallback_reason = f"{type(error).__name__}: {error}"
                warnings.warn(f"the plain step could not be recorded as a CUDA graph; running it without one "
                              f"for this rollout ({self.fallback_reason[:200]})", stacklevel=2)
                self.function(state)
                return
            self.graph = graph
        self.graph.replay()


PLAIN_RUNNERS: dict[str, Callable[[Callable[[DecodeState], None]], Callable[[DecodeState], None]]] = {
    "eager": lambda function: function,
    "compiled": lambda function: _compiled(function, "inductor", static=True),
    "compiled-pinned": lambda function: _compiled(function, "inductor", static=True),  # + RUNNER_SCOPES
    "compiled-onednn": lambda function: _compiled(function, "inductor", static=True, products="stacked"),
    "dynamo": lambda function: _compiled(function, "eager", static=True),
    "cudagraph": GraphReplay,
    "compiled-cudagraph": lambda function: GraphReplay(_compiled(function, "inductor", static=True)),
}
"""Name -> how ``plain_step`` runs: as ``RUNNERS``, but compiled with one static graph per bucket, plus the
pinned and CUDA-graph runners (called once per rollout: a ``GraphReplay`` keeps that rollout's graphs), and
``compiled-onednn``, whose graphs multiply by the weights through ``graph_linears.stacked_linear`` (packed oneDNN
products where ``DecodeSchedule.linears`` packs them: ``STACKED_PRODUCT_RUNNERS``)."""

CAPTURED_RUNNERS = frozenset({"cudagraph", "compiled-cudagraph"})
"""Plain runners that replay recorded buffers: their steps read every KV slot of the rollout's capacity, since
a recorded graph's shapes hold for the whole rollout; the other compiled runners read the slots in use rounded
up to ``SLOT_BLOCK`` (a dynamic size of one graph)."""

SLOT_BLOCK = 16
"""Generated KV slots a compiled plain step's read grows by (``GroupedKVCache.slot_block``): at most 15 slots
read past the ones in use; 16 also keeps the dynamic size off 0 and 1, which dynamo would specialise."""

STACKED_PRODUCT_RUNNERS = frozenset({"compiled-onednn"})
"""Plain runners whose graphs call ``graph_linears.stacked_linear``: a rollout with one runs in the scope
``graph_linears.GRAPH_LINEAR_KERNELS`` gives its ``DecodeSchedule.linears``."""

# --- "auto": eager or compiled, by measurement ------------------------------------------------------------

MEASURE = "measure"
AUTO_RUNNERS: dict[str, str] = {
    # CPU: chosen per CPU kind, model shape, dtype and thread count by timing both once on this machine
    # (``measured_runner``): compiling paid on neither 2-core machine in the one-off script above, and what it
    # gains depends on how much of a step is small-operator overhead (few live rows, small models).
    "cpu": MEASURE,
    # GPU: not yet measured (bench/gpu.py times eager against compiled on the next lent GPU).
    "cuda": "eager",
}
"""``DecodeSchedule.runner = "auto"`` per device type: a runner of ``PLAIN_RUNNERS``, or ``MEASURE``."""

RUNNER_NAMES = ("auto", *PLAIN_RUNNERS)
MEASURED_MARGIN = 1.05
"""Compiled must beat eager by this factor to be chosen (timing noise, and the compile it costs once)."""


def resolve_runner(name: str, model: nn.Module, rollout: Callable[[str], object]) -> str:
    """``name``, or for "auto" the runner ``AUTO_RUNNERS`` gives ``model``'s device (measured where it says so, by
    timing ``rollout(runner)``: a short rollout of ``model`` with that runner, ``decode.resolved_runner``'s)."""
    if name != "auto":
        return name
    device = next(model.parameters()).device
    chosen = AUTO_RUNNERS.get(device.type, "eager")
    return measured_runner(model, rollout) if chosen == MEASURE else chosen


def measured_runner(model: nn.Module, rollout: Callable[[str], object]) -> str:
    """"compiled" or "eager": whichever ran ``rollout`` faster here, timed once per CPU kind, torch build, model
    shape, dtype and thread count (``cache.measured_once``; every process of the machine then makes the same
    choice, so the rollouts of a resumed run round as the first run's did)."""
    from turbogrpo.linears import machine_key  # the key every timed choice of this machine uses
    config = getattr(model, "config", None)
    shape = config.to_diff_dict() if hasattr(config, "to_diff_dict") else {"class": type(model).__name__}
    compiled = compiled_candidate(model)
    key = machine_key(choice="plain_step_runner", model={k: v for k, v in shape.items() if k != "_name_or_path"},
                       dtype=str(next(model.parameters()).dtype), num_threads=torch.get_num_threads(),
                       candidates=["eager", compiled])
    return measured_once("plain_step_runner", key, functools.partial(_timed_runner, rollout, compiled))


def compiled_candidate(model: nn.Module) -> str:
    """The compiled runner "auto" times against eager: ``compiled-onednn`` where this machine measured oneDNN's packed
    product faster than ``F.linear`` in the dtype of ``model``'s weights (``linears.onednn_is_faster``: the eager step
    then runs packed products, and a compiled step on aten's would start behind it), else ``compiled``."""
    weight = next(model.parameters())
    packs = weight.device.type == "cpu" and onednn_is_faster(weight.dtype, torch.get_num_threads())
    return "compiled-onednn" if packs else "compiled"


def _timed_runner(rollout: Callable[[str], object], compiled: str = "compiled", repeats: int = 3) -> str:
    """Time ``rollout`` eager and with the runner ``compiled``, alternated, after one untimed call each (the compile)."""
    times: dict[str, list[float]] = {"eager": [], compiled: []}
    for repeat in range(repeats + 1):
        for runner, taken in times.items():
            start = time.perf_counter()
            rollout(runner)
            if repeat:
                taken.append(time.perf_counter() - start)
    return compiled if statistics.median(times[compiled]) * MEASURED_MARGIN < statistics.median(times["eager"]) else "eager"
