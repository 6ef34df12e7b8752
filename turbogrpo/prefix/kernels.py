"""Attention that also returns its log-sum-exp, and the matching backward.

Merging two partial attentions (over the prompt's keys and over the completion's own keys) needs
each part's log-sum-exp; the backward of the merged result can then be computed part by part with
the *merged* output and log-sum-exp, because ``P_part = exp(S_part - lse_merged)`` is exactly the
slice of the full softmax that the part covers (the flash-attention backward identity).

Shape legend: B batch, H query heads, Hkv key/value heads (H a multiple of Hkv: grouped-query
attention, query head h reads KV head h // (H / Hkv)), Q queries, K keys, D head dim. ``bias`` is an additive float mask
broadcastable to ``[B, H, Q, K]`` (0 or -inf) or None. Row log-sum-exps are ``[B, H, Q]``.
"""

from __future__ import annotations

import torch

_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_cpu_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _cpu_flash is not None


def attention_forward(q, k, v, bias, *, causal: bool, scale: float):
    """Returns ``(out [B, H, Q, D], lse [B, H, Q])``."""
    if _use_cpu_flash(q):
        out, lse = _cpu_flash(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse
    num_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(num_rep, 1), v.repeat_interleave(num_rep, 1)
    scores = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


def attention_backward(grad_out, q, k, v, out, lse, bias, *, causal: bool, scale: float):
    """Gradients ``(dq, dk, dv)`` of one attention part given the merged ``out`` and ``lse``."""
    if _use_cpu_flash(q):
        return _cpu_flash_backward(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    num_kv, num_rep = k.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(num_rep, 1), v.repeat_interleave(num_rep, 1)
    probs = torch.exp(_scores(q, k, bias, causal, scale) - lse[..., None]).to(q.dtype)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_probs = torch.matmul(grad_out, v.transpose(-1, -2))
    row_dot = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_dot) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)

    def per_kv_head(g):  # sum the gradients of the query heads that shared each KV head
        return g.unflatten(1, (num_kv, num_rep)).sum(2)
    return torch.matmul(grad_scores, k), per_kv_head(grad_k), per_kv_head(grad_v)


def _scores(q, k, bias, causal, scale):
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if bias is not None:
        scores = scores + bias
    if causal:
        num_q, num_k = scores.shape[-2:]
        keep = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions over disjoint key sets into one (same shapes as inputs)."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse)[..., None].to(out_a.dtype)
    weight_b = torch.exp(lse_b - lse)[..., None].to(out_b.dtype)
    return out_a * weight_a + out_b * weight_b, lse
