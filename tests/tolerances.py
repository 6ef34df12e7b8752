"""Tolerances from the arithmetic, not from one machine's kernels."""

from __future__ import annotations

import torch

BF16_EPS = torch.finfo(torch.bfloat16).eps
"""bf16's spacing at 1.0 (2^-7): 8 significand bits."""


def assert_within_bf16_rounding(ours: torch.Tensor, truth: torch.Tensor, *, ulps: float = 4.0) -> None:
    """``ours`` (a bf16 computation, any dtype) within ``ulps`` bf16 spacings of the largest magnitude in
    each row (the last dim) of ``truth``, the same computation in float32 on the same bf16-rounded
    inputs. A bf16 forward's error against float32 is a few spacings of the values it sums, whatever
    kernel runs it: oneDNN's native bf16 and an AVX2 CPU's emulation round differently, both within it."""
    truth = truth.float()
    allowed = ulps * BF16_EPS * truth.abs().amax(-1, keepdim=True)
    error = (ours.float() - truth).abs()
    worst = (error / allowed).max().item()
    assert worst <= 1.0, (f"bf16 result is {worst * ulps:.2f} bf16 spacings of its row's magnitude from the "
                          f"float32 truth (allowed {ulps})")
