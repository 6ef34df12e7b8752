"""Token mixers other than attention, one registered unit per layer family, in one table.

transformers runs a hybrid model's attention layers through the attention interface (where turbogrpo's
plans take over, ``turbogrpo.hook``) but calls its other token mixers (a gated DeltaNet, a Mamba-2 mixer, a
short convolution) as plain modules. A :class:`MixerUnit` says how one such module class runs over a
:class:`TokenLayout`: the training forwards' :class:`~turbogrpo.mixers.forest.SegmentForest` (every shared
segment, a prompt or a trie node, once, its children from its final state) or the rollout engine's state cache
(``turbogrpo.rollout.states``: a prompt's states computed once per group, then each sample's new tokens from its
own row of states). ``turbogrpo.hook`` routes a registered module's calls to its unit when the call carries a
plan with a layout.

A unit mirrors its module's own forward (transformers 5.19) with the token mixing run over the forest; the
per-token parts (projections, gates, norms) use the module's own submodules and parameters, and the
chunked kernels are looked up in the module's own modeling file at every call (so the optimized kernels
transformers picked, flash-linear-attention's or mamba-ssm's where installed, and any patch of them, apply to
both). The short convolutions run as one gather over the whole forest (``forest.path_conv``), not through
causal-conv1d: a child's first taps read its parent's last inputs, which a per-row kernel cannot.

Shape legend: N flat tokens, Hd hidden size, C a convolution's channels, K its width.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from torch import nn

from turbogrpo.mixers.forest import Step   # a recurrence over padded rows (forest.scan_levels)

MIXERS: dict[str, MixerUnit] = {}   # module class name -> its unit

class TokenLayout(Protocol):
    """Where a unit's flat tokens sit and which state each continues from: the two operations that mix them."""

    def conv(self, module: nn.Module, x_NC: torch.Tensor, weight_CK: torch.Tensor,
             bias_C: torch.Tensor | None) -> torch.Tensor:
        """``[N, C]``: ``module``'s causal depthwise convolution of ``x_NC`` along each token's sequence."""

    def scan(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], *, chunked: Step,
             recurrent: Step) -> torch.Tensor:
        """``[N, ...]``: ``module``'s recurrence over per-token ``inputs`` ``[N, ...]``, run by ``chunked`` (the
        chunked algorithm, for many tokens a row) or ``recurrent`` (token by token, for decoding); both take and
        return the same arguments and give the same numbers up to rounding."""


def register_mixer(*class_names: str) -> Callable[[type], type]:
    """Class decorator: one instance of the unit runs every module class named in ``class_names``."""
    def register(cls: type) -> type:
        unit = cls()
        for name in class_names:
            MIXERS[name] = unit
        return cls
    return register


class MixerUnit:
    """How one family of stateful token mixers runs over a segment forest."""

    what: ClassVar[str]   # the layer in a few words, for messages and the docs

    def forward(self, module: nn.Module, hidden: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """``[..., Hd]`` -> ``[..., Hd]``: the module's output for the layout's tokens (``hidden``'s leading
        dimensions flattened, ``[1, N]`` for a forest, ``[B, n]`` rows of a rollout)."""
        raise NotImplementedError

    def padding_reaches_state(self, module: nn.Module) -> bool:
        """Whether the module's own forward of a left-padded row carries the padding into its real tokens.
        transformers zeroes a pad's hidden state before the module's input projection, so a bias on that
        projection still writes the pad into the state (or a convolution's window); then a left-padded row's
        numbers differ from the unpadded sequence's, which the shared forward computes."""
        return False


def mixer_of(module: nn.Module) -> MixerUnit | None:
    return MIXERS.get(type(module).__name__)


def padding_reaches_state(model: nn.Module) -> bool:
    """Whether any of ``model``'s registered mixers carries a row's left padding into its state (see
    :meth:`MixerUnit.padding_reaches_state`)."""
    return any(unit.padding_reaches_state(module) for module in model.modules() if (unit := mixer_of(module)))


def modeling_function(module: nn.Module, name: str) -> Callable:
    """The function ``name`` of the modeling file that defines ``module``'s class, looked up at the call."""
    return getattr(sys.modules[type(module).__module__], name)


def depthwise_conv(conv: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [C, K], bias [C] or None)`` of a mixer's causal depthwise convolution, which the units run
    themselves (``TokenLayout.conv``). A convolution wrapped by another module (peft's LoRA, which accepts one whose
    rank the channels divide) is refused in one line: reading its base weight would skip the adapter silently."""
    if not isinstance(conv, nn.Conv1d):
        raise ValueError(f"a hybrid's depthwise convolution is wrapped by {type(conv).__module__}.{type(conv).__name__} "
                         "(an adapter?); turbogrpo runs it from its own weights and would leave the wrapper out: leave "
                         "the convolutions (conv1d, conv) out of lora.target_modules")
    return conv.weight[:, 0], conv.bias


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or wider: what a module's ``.float()`` guards against (a half-precision ``exp`` overflowing)
    without rounding a float64 model's parameters to float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
