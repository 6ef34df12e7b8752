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


def _float32_on_cpu(*tensors):
    """Half-precision inputs on the CPU are computed in float32. A part's output is merged with
    another part's before the single rounding to the model's dtype, so rounding each part first
    would round twice: in bfloat16 that made the shared path's error 2.6x the standard path's
    (test_precision.py). CPU half precision is for tests and small runs, where float32 costs little."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.float16, torch.bfloat16):
        return tuple(t if t is None else t.float() for t in tensors)
    return tensors


def attention_forward(q, k, v, bias, *, causal: bool, scale: float):
    """Returns ``(out [B, H, Q, D], lse [B, H, Q])`` (float32 for half-precision CPU inputs)."""
    q, k, v, bias = _float32_on_cpu(q, k, v, bias)
    if _use_cpu_flash(q):
        out, lse = _cpu_flash(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse
    num_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(num_rep, 1), v.repeat_interleave(num_rep, 1)
    scores = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    # A row whose keys are all masked (a sliding window) gets output 0 and log-sum-exp -inf, not NaN.
    finite_lse = lse.masked_fill(lse == float("-inf"), 0.0)
    out = torch.matmul(torch.exp(scores - finite_lse[..., None]).to(v.dtype), v)
    return out, lse


def attention_backward(grad_out, q, k, v, out, lse, bias, *, causal: bool, scale: float):
    """Gradients ``(dq, dk, dv)`` of one attention part given the merged ``out`` and ``lse``."""
    grad_out, q, k, v, out, bias = _float32_on_cpu(grad_out, q, k, v, out, bias)
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


# ---- variable-length packed segments (cu_seqlens), the layout of flash-attention's varlen kernels ----
#
# Shape legend here: Tq / Tk total query / key tokens of all segments, n segments. Segment i is
# queries ``q[cu_q[i]:cu_q[i+1]]`` against keys ``k[cu_k[i]:cu_k[i+1]]``; the key segments
# partition ``k``, so no key is shared between segments and dk/dv need no accumulation across them.
# Log-sum-exps are ``[Tq, H]`` (indexed like ``out``'s leading dims, so `merge_partials` takes them
# as they are); flash's native ``[H, Tq]`` is converted at the CUDA call.

_flash_varlen_forward = getattr(torch.ops.aten, "_flash_attention_forward", None)
_flash_varlen_backward = getattr(torch.ops.aten, "_flash_attention_backward", None)


def flash_varlen_available() -> bool:
    """Whether this torch build has the flash-attention varlen ops (they only run on CUDA)."""
    return _flash_varlen_forward is not None and _flash_varlen_backward is not None


def _use_flash_varlen(q: torch.Tensor) -> bool:
    # Flash attention only computes in half precision; float32/float64 on CUDA take the reference loop.
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_varlen_available()


def _flash_window(causal: bool) -> tuple[int, int]:
    # As torch.nn.attention.varlen passes them: (-1, 0) is causal, (-1, -1) unrestricted. Flash's
    # varlen causal mask is bottom-right aligned when a query segment is shorter than its key
    # segment; our causal calls always have equal query and key segments (prompt vs itself,
    # completion vs itself) and the only unequal pairing (group completions vs prompt) is
    # non-causal, so the alignment never matters.
    return (-1, 0) if causal else (-1, -1)


def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float,
                   lengths_q=None, lengths_k=None):
    """Attention of packed variable-length segments, without padding.

    ``q [Tq, H, D]``, ``k, v [Tk, Hkv, D]`` (grouped-query attention as above), ``cu_q, cu_k [n + 1]``
    int32 on q's device, ``max_q, max_k`` the longest query / key segment. Returns
    ``(out [Tq, H, D], lse [Tq, H])`` (lse float32 on the flash path, the computation dtype otherwise).

    On CUDA in float16/bfloat16 this is one call of torch's flash-attention varlen kernel
    (``aten._flash_attention_forward``, called as ``torch.nn.attention.varlen`` calls it; it takes
    Hkv < H as is). Everywhere else it loops over the segments with :func:`attention_forward`:
    the reference that the CPU test suite checks. The CUDA call itself is not covered by the CPU
    tests. ``lengths_q`` / ``lengths_k``: the segment lengths as host ints, so the loop need not
    read ``cu_q`` / ``cu_k`` back from the device (without them it does: a host sync).
    """
    if _use_flash_varlen(q):
        left, right = _flash_window(causal)
        out, lse, _rng_state, _unused, _debug = _flash_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, return_debug_mask=False, scale=scale,
            window_size_left=left, window_size_right=right)
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"flash varlen returned a log-sum-exp of shape {tuple(lse.shape)}; expected "
                               f"[H, Tq] = {[q.shape[1], q.shape[0]]}")
        return out, lse.t()
    outs, lses = [], []
    for q_i, k_i, v_i in zip(_split(q, cu_q, lengths_q), _split(k, cu_k, lengths_k), _split(v, cu_k, lengths_k)):
        out, lse = attention_forward(*(_as_batch(x) for x in (q_i, k_i, v_i)), None, causal=causal, scale=scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].t())
    return torch.cat(outs), torch.cat(lses)


def varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool,
                    scale: float, lengths_q=None, lengths_k=None):
    """Gradients ``(dq [Tq, H, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` of :func:`varlen_forward`.

    ``grad_out, out [Tq, H, D]``, ``lse [Tq, H]``: as in :func:`attention_backward`, ``out`` and
    ``lse`` may be the merged ones of several parts, which yields this part's share of the gradients.
    Same dispatch as :func:`varlen_forward` (flash on CUDA in half precision, segment loop elsewhere).
    """
    if _use_flash_varlen(q):
        left, right = _flash_window(causal)
        # Dropout is 0, so the RNG state is unused; torch.nn.attention.varlen passes these placeholders.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        return _flash_varlen_backward(
            grad_out.contiguous(), q, k, v, out.contiguous(), lse.t().contiguous(), cu_q, cu_k,
            max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
            window_size_left=left, window_size_right=right)
    grads = [[], [], []]
    per_segment = zip(*(_split(x, cu_q, lengths_q) for x in (grad_out, q)),
                      *(_split(x, cu_k, lengths_k) for x in (k, v)),
                      *(_split(x, cu_q, lengths_q) for x in (out, lse)))
    for g_i, q_i, k_i, v_i, out_i, lse_i in per_segment:
        dq, dk, dv = attention_backward(*(_as_batch(x) for x in (g_i, q_i, k_i, v_i, out_i)),
                                        lse_i.t()[None], None, causal=causal, scale=scale)
        for acc, grad in zip(grads, (dq, dk, dv)):
            acc.append(grad[0].transpose(0, 1))
    return tuple(torch.cat(acc) for acc in grads)


def _split(x: torch.Tensor, cu_seqlens: torch.Tensor, lengths) -> tuple[torch.Tensor, ...]:
    """``[T, ...]`` -> one ``[L_i, ...]`` view per segment."""
    if lengths is None:
        lengths = torch.diff(cu_seqlens).tolist()  # host sync: reads cu_seqlens back (callers without host lengths)
    return x.split(list(lengths))


def _as_batch(x_LHD: torch.Tensor) -> torch.Tensor:
    """``[L, H, D]`` segment -> ``[1, H, L, D]``, the layout :func:`attention_forward` takes."""
    return x_LHD.transpose(0, 1)[None]
