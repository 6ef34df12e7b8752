"""How the plain step runs: eagerly, or compiled whole by ``torch.compile`` (``DecodeSchedule.runner``).

``plain_step`` has no host sync and no untraceable object, so dynamo captures it as one graph
(``fullgraph=True``); the attention then reads a static number of KV slots (``static_slots``), so the
graph holds from step to step within a bucket of the live batch and is compiled again only when the
batch is retired to a smaller bucket (and, after one such change, with dynamic sizes). Compiled
functions are built once per process and reused by every rollout.

* ``eager``: the default. On the CPU compiling does not pay for itself per rollout (measured in
  ``bench/rollout.py`` is the eager path; the compile time alone exceeds a small rollout).
* ``compiled``: inductor, fusing each layer's elementwise work into few kernels (CUDA).
* ``dynamo``: dynamo only, no code generation (``backend="eager"``): the same graph capture and
  recompilation behaviour at no compile cost, for tests and for finding graph breaks.

Not done: CUDA-graph replay (``mode="reduce-overhead"``) needs the step's buffers (KV cache, rows,
outputs) at fixed addresses across rollouts, i.e. a buffer pool per bucket; today they are allocated
per rollout, and a captured graph would be re-recorded for each. Where weights move or are rebuilt
between rollouts (FSDP resharding, LoRA merge/unmerge), graphs and compiled code guarded on them
would be invalid too: run ``eager`` there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from turbogrpo.rollout.step import DecodeState, plain_step


@functools.cache
def _compiled(backend: str) -> Callable[[DecodeState], None]:
    return torch.compile(plain_step, fullgraph=True, backend=backend)


RUNNERS: dict[str, Callable[[], Callable[[DecodeState], None]]] = {
    "eager": lambda: plain_step,
    "compiled": lambda: _compiled("inductor"),
    "dynamo": lambda: _compiled("eager"),
}
"""Name -> a function returning the callable that runs one plain step."""
