"""How a decoding step runs: eagerly, or compiled whole by ``torch.compile`` (``DecodeSchedule.runner``
for the plain step, ``Speculation.runner`` for the two device parts of the speculative tree step).

``plain_step`` has no host sync and no untraceable object, so dynamo captures it as one graph
(``fullgraph=True``); the attention then reads a static number of KV slots (``static_slots``), so the
graph holds from step to step within a bucket of the live batch and is compiled again only when the
batch is retired to a smaller bucket (and, after one such change, with dynamic sizes). Compiled
functions are built once per process and reused by every rollout.

* ``eager``: the default. On the CPU compiling does not pay for itself: SmolLM2-135M, 4 GSM8K
  prompts x 8 samples x 128 tokens, 2-core Xeon, float32, kept heap, a one-off script: eager
  16-22 s per rollout; compiled with static shapes 16.7-17.2 s after a 18 s compile, with the dynamic
  shapes that other prompt lengths and live batches bring 22.6 s after 60-190 s of compiling per
  new shape family. The step's matrix products are 70% of its time either way.
* ``compiled``: inductor, fusing each layer's elementwise work into few kernels (CUDA).
* ``dynamo``: dynamo only, no code generation (``backend="eager"``): the same graph capture and
  recompilation behaviour at no compile cost, for tests and for finding graph breaks.

On CUDA, two opt-in runners replay the plain step from CUDA graphs (``GraphReplay``): ``cudagraph``
(the eager step, captured) and ``compiled-cudagraph`` (the inductor-compiled step, captured). Not
measured yet: no GPU was at hand when they were written. ``bench/gpu_rollout.py`` times them against
``eager`` and ``compiled`` (a whole rollout and one step at B=64), so that the next GPU session sets
``DEFAULT_SCHEDULES["cuda"].runner`` from that measurement. The CPU default stays ``eager``.

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

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from turbogrpo.rollout.step import DecodeState



Step = TypeVar("Step", bound=Callable)


@functools.cache
def _compiled(function: Step, backend: str) -> Step:
    return torch.compile(function, fullgraph=True, backend=backend)


RUNNERS: dict[str, Callable[[Step], Step]] = {
    "eager": lambda function: function,
    "compiled": lambda function: _compiled(function, "inductor"),
    "dynamo": lambda function: _compiled(function, "eager"),
}
"""Name -> how to run a step function (``plain_step``; the tree step's parts): the function itself, or
its compiled version (built once per process and function, kept by ``_compiled``)."""


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
    **RUNNERS,
    "cudagraph": GraphReplay,
    "compiled-cudagraph": lambda function: GraphReplay(_compiled(function, "inductor")),
}
"""``RUNNERS`` plus the CUDA-graph runners, for ``plain_step`` only (called once per rollout: a
``GraphReplay`` keeps that rollout's graphs)."""
