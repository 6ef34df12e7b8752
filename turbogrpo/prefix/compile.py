"""Optional regional ``torch.compile`` of a model's decoder layers, for the training forward.

Each decoder layer is compiled on its own (regional compilation: the layers share one graph, so
compile time does not grow with depth), with dynamic shapes. Attention plans are not traced:
:func:`eager_plan` makes them a graph break, so the compiled regions are the per-token parts around
attention (norms, projections, rotary embedding, MLP, residuals) and packs of any shape reuse the
same graphs.

Off by default (a setting for the trainer to expose, e.g. ``model.compile_layers``). Measured on the
CPU (bench model, 1024/128/8, forward + backward, shared layout, one thread on a loaded 2-core
machine): 1.19x per step once compiled, after a first call of 465 s of compiling. The standard
layout and GPU speed are unmeasured; the launch-bound GPU forward is where it is expected to pay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from turbogrpo.hook import decoder_of


def compile_decoder_layers(model: nn.Module, *, compiler: str | Callable = "inductor") -> nn.Module:
    """Compile every decoder layer of ``model`` in place (``nn.Module.compile``) and return it.

    The log-probs and gradients are those of the uncompiled model (up to the compiler's
    floating-point reassociation).
    """
    for layer in decoder_of(model).layers:
        layer.compile(backend=compiler, dynamic=True)
    return model


def eager_plan(call: Callable) -> Callable:
    """Decorator for an attention plan's ``__call__``: never traced by a compiled layer (its host ints
    would otherwise specialise the graph on every pack's lengths)."""
    return torch.compiler.disable(call, recursive=True)
