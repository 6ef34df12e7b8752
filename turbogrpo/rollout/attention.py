"""Attention over part of the keys, with its log-sum-exp, and the merge of two such parts ("cascade").

Softmax attention over keys ``A ∪ B`` equals the partial attentions over ``A`` and over ``B`` mixed
with weight ``exp(lse_A) / (exp(lse_A) + exp(lse_B)) = sigmoid(lse_A - lse_B)``. The decode plan uses
it to attend to a group's shared prompt K/V and a sequence's own generated K/V without ever laying
them side by side. Written with as few kernels as possible: decoding runs these once per layer and
step, and small steps (the long tail of a rollout) are bound by per-kernel overhead.

Shapes: ``...`` batch dimensions, ``M`` queries, ``L`` keys, ``D`` head dim.
"""

from __future__ import annotations

import torch


def partial_attention(scaled_query: torch.Tensor, key_DL: torch.Tensor, value: torch.Tensor,
                      bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``scaled_query [..., M, D]`` (already multiplied by the softmax scale)
    over keys ``key_DL [..., D, L]`` (transposed: a contiguous ``[D, L]`` block makes the product a
    plain GEMM) and values ``[..., L, D]``.

    ``bias`` (float32, 0 or ``-inf``, broadcastable to ``[..., M, L]``) hides keys. Returns the output
    ``[..., M, D]`` and the log-sum-exp of the scores ``[..., M, 1]``, both float32. A row that sees
    no key gets output 0 and the lowest finite lse, so that it drops out of a merge.
    """
    scores = torch.matmul(scaled_query, key_DL).float()
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    weights = torch.exp(scores - lse)
    return torch.matmul(weights.to(value.dtype), value).float(), lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from the parts' outputs ``[..., M, D]`` and
    log-sum-exps ``[..., M, 1]``."""
    return torch.lerp(out_b, out_a, torch.sigmoid(lse_a - lse_b))
