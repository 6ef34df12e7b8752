"""Attention over part of the keys, with its log-sum-exp, and the merge of such parts ("cascade").

Softmax attention over keys ``A ∪ B`` equals the two partial attentions over ``A`` and over ``B``
combined with weights ``exp(lse_A - lse)`` and ``exp(lse_B - lse)``, ``lse = logaddexp(lse_A, lse_B)``.
The decode plan uses it to attend to a group's shared prompt K/V and a sequence's own generated K/V
without ever laying them side by side.

Shapes: ``...`` batch dimensions, ``M`` queries, ``L`` keys, ``D`` head dim.
"""

from __future__ import annotations

import torch


def partial_attention(query: torch.Tensor, key_DL: torch.Tensor, value: torch.Tensor,
                      visible: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query [..., M, D]`` over keys ``key_DL [..., D, L]`` (transposed: a
    contiguous ``[D, L]`` block makes the product a plain GEMM) and values ``[..., L, D]``.

    ``visible`` (bool, broadcastable to ``[..., M, L]``) hides keys where False. Returns the output
    ``[..., M, D]`` and the log-sum-exp of the scaled scores ``[..., M]``, both float32; a row that
    sees no key gets output 0 and lse ``-inf``, so that it drops out of a merge.
    """
    scores = torch.matmul(query, key_DL).float() * scaling
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights.to(value.dtype), value).float() / total.clamp_min(torch.finfo(total.dtype).tiny)
    lse = (row_max + total.log()).squeeze(-1)
    return out, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the parts' outputs ``[..., M, D]`` and
    log-sum-exps ``[..., M]`` (at least one part per row must see a key)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1)
            + out_b * torch.exp(lse_b - lse).unsqueeze(-1))
