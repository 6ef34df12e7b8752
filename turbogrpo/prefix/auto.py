"""``backend="auto"``: the layout and attention backend that measured fastest for the device and pack.

A rule per device type, written down from measurements:

* whether to share at all: sharing pays once the pack's FLOP ratio (standard / shared forward work,
  :mod:`turbogrpo.prefix.cost`) is high enough to beat the shared path's fixed costs (index
  tensors, more and smaller kernels). Below the threshold the standard layout runs; the results are
  the same either way, so this is a speed choice only.

  - CPU (bench/prefix.py, 2-core EPYC, float32): sharing paid at every measured ratio, down to
    1.16x faster at ratio 1.15 (128/512/8); threshold 1.1, i.e. share unless G is ~1.
  - CUDA (H200, bf16, issue 10, before the host-sync work): at ratio 1.15 (0.5B, 256/1024/8) the
    standard layout was 1.25x faster than the best shared backend; from ratio ~3.3 up the shared
    path tied or won (0.94x-2.7x). Threshold 2.0, between the two measured points; re-measure
    with bench/gpu.py (part "prefix").

* a model whose sliding window is shorter than the pack's longest sequence runs a backend that
  applies the window ("cascade", "flex", "reference"; not "varlen").

* which backend: the first of the device's list that can run the pack. CUDA: "varlen" (flash
  varlen, half precision; fastest of our backends at every shape of the issue-10 table), then
  "flex" (float32 too), then "cascade". CPU: "cascade" (fastest on the CPU bench; flex has no
  CPU backward, varlen's CPU form is a per-segment loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbogrpo.prefix.backends import BACKENDS
from turbogrpo.prefix.cost import ModelDims, layout_flops

STANDARD = "standard"   # the unshared layout: every completion with its own prompt copy


@dataclass(frozen=True)
class AutoRule:
    min_flop_ratio: float          # share only if standard/shared forward FLOPs reach this
    backends: tuple[str, ...]      # shared backends, fastest first
    half_precision_only: frozenset[str] = frozenset()   # backends that are fast only in f16/bf16


AUTO_RULES: dict[str, AutoRule] = {
    "cuda": AutoRule(2.0, ("varlen", "flex", "cascade"), half_precision_only=frozenset({"varlen"})),
    "cpu": AutoRule(1.1, ("cascade",)),
}
_OTHER_DEVICES = AutoRule(1.1, ("cascade",))


def choose_auto(model, prompt_lengths, completion_lengths, device: torch.device, dtype: torch.dtype,
                requires_grad: bool) -> str:
    """``STANDARD`` or the name of the shared-prefix backend to run (lengths are host ints)."""
    rule = AUTO_RULES.get(device.type, _OTHER_DEVICES)
    longest = max(p + max(ss) for p, ss in zip(prompt_lengths, completion_lengths))
    if layout_flops(ModelDims.of(model), prompt_lengths, completion_lengths).ratio < rule.min_flop_ratio:
        return STANDARD
    return fastest_shared_backend(device, dtype, requires_grad,
                                  sliding_window=sliding_window_applies(model.config, longest))


def fastest_shared_backend(device: torch.device, dtype: torch.dtype, requires_grad: bool, *,
                           sliding_window: bool = False) -> str:
    """The device rule's fastest shared-prefix backend that can run here (for callers that need the
    shared layout itself, such as the draft's packed training batches); with ``sliding_window``, the
    fastest that applies a window."""
    rule = AUTO_RULES.get(device.type, _OTHER_DEVICES)
    for name in rule.backends:
        if name in rule.half_precision_only and dtype not in (torch.float16, torch.bfloat16):
            continue
        if sliding_window and not BACKENDS[name].supports_sliding_window:
            continue
        if BACKENDS[name].available(device, requires_grad):
            return name
    return "cascade"


def sliding_window_applies(config, longest: int) -> bool:
    """Whether some layer of the model restricts attention to a window shorter than ``longest``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or longest <= window:
        return False
    return "sliding_attention" in layer_types if layer_types else getattr(config, "use_sliding_window", True)
