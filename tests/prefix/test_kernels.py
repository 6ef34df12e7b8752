"""Partial attention with log-sum-exp, its merge and backward, against plain softmax by hand."""

import math

import pytest
import torch

from turbogrpo.prefix import kernels


def test_merge_of_two_halves_equals_full_attention_by_hand():
    # One query, keys split {k0} | {k1}; scores 0 and ln 3 -> weights 1/4 and 3/4.
    q = torch.tensor([[[[1.0]]]], dtype=torch.float64)
    k_a, k_b = torch.tensor([[[[0.0]]]], dtype=torch.float64), torch.tensor([[[[math.log(3)]]]], dtype=torch.float64)
    v_a, v_b = torch.tensor([[[[4.0]]]], dtype=torch.float64), torch.tensor([[[[8.0]]]], dtype=torch.float64)
    out_a, lse_a = kernels.attention_forward(q, k_a, v_a, None, causal=False, scale=1.0)
    out_b, lse_b = kernels.attention_forward(q, k_b, v_b, None, causal=False, scale=1.0)
    out, lse = kernels.merge_partials(out_a, lse_a, out_b, lse_b)
    assert out.item() == pytest.approx(0.25 * 4 + 0.75 * 8)
    assert lse.item() == pytest.approx(math.log(1 + 3))


@pytest.mark.parametrize("use_cpu_flash", [True, False], ids=["cpu-flash", "math"])
@pytest.mark.parametrize("causal", [False, True])
def test_split_backward_equals_autograd_of_full_softmax(monkeypatch, use_cpu_flash, causal):
    monkeypatch.setattr(kernels, "_use_cpu_flash", lambda q: use_cpu_flash)
    torch.manual_seed(0)
    # 6 query heads over 3 KV heads (grouped-query attention).
    q = torch.randn(2, 6, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(2, 1, 1, 5, dtype=torch.float64)
    bias[1, ..., 3:] = float("-inf")
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5 + bias
    if causal:
        scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)

    with torch.no_grad():
        out, lse = kernels.attention_forward(q, k, v, bias, causal=causal, scale=0.5)
        dq, dk, dv = kernels.attention_backward(grad_out, q, k, v, out, lse, bias, causal=causal, scale=0.5)
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).detach())
    for got, ref in [(dq, q.grad), (dk, k.grad), (dv, v.grad)]:
        torch.testing.assert_close(got, ref)


def _cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _dense_segment_attention(q, k, v, cu_q, cu_k, causal, scale):
    """Plain masked softmax over packed tokens: query i sees key j iff both are in the same segment
    (and, if causal, j's offset in its segment is <= i's). Returns ``(out [Tq, H, D], lse [Tq, H])``."""
    def segment_and_offset(cu):
        lengths = torch.diff(cu).long()
        segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        return segment, torch.arange(int(cu[-1])) - cu[:-1].long()[segment]
    seg_q, off_q = segment_and_offset(cu_q)
    seg_k, off_k = segment_and_offset(cu_k)
    allowed = seg_q[:, None] == seg_k[None, :]
    if causal:
        allowed &= off_k[None, :] <= off_q[:, None]
    num_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(num_rep, 1), v.repeat_interleave(num_rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1).t()


@pytest.mark.parametrize("use_cpu_flash", [True, False], ids=["cpu-flash", "math"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_equals_autograd_of_dense_masked_softmax(monkeypatch, use_cpu_flash, causal):
    monkeypatch.setattr(kernels, "_use_cpu_flash", lambda q: use_cpu_flash)
    torch.manual_seed(0)
    # Three segments; causal parts pair equal query/key segments, the non-causal one (like a group's
    # completions against its prompt) pairs different lengths. 6 query heads over 3 KV heads.
    q_lengths, k_lengths = ([3, 1, 5], [3, 1, 5]) if causal else ([3, 1, 5], [2, 4, 1])
    cu_q, cu_k = _cu_seqlens(q_lengths), _cu_seqlens(k_lengths)
    q = torch.randn(sum(q_lengths), 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(k_lengths), 3, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(k_lengths), 3, 4, dtype=torch.float64, requires_grad=True)
    expected, expected_lse = _dense_segment_attention(q, k, v, cu_q, cu_k, causal, scale=0.5)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)

    with torch.no_grad():
        segments = (cu_q, cu_k, max(q_lengths), max(k_lengths))
        out, lse = kernels.varlen_forward(q, k, v, *segments, causal=causal, scale=0.5)
        dq, dk, dv = kernels.varlen_backward(grad_out, q, k, v, out, lse, *segments, causal=causal, scale=0.5)
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(lse, expected_lse.detach())
    for got, ref in [(dq, q.grad), (dk, k.grad), (dv, v.grad)]:
        torch.testing.assert_close(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash-attention varlen kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_flash_call_matches_cpu_reference(dtype, causal):
    """The CUDA call itself (argument order, window sizes, lse layout, GQA) against the segment loop."""
    torch.manual_seed(0)
    q_lengths, k_lengths = ([37, 1, 130], [37, 1, 130]) if causal else ([37, 1, 130], [64, 9, 3])
    cu_q, cu_k = _cu_seqlens(q_lengths), _cu_seqlens(k_lengths)
    q = torch.randn(sum(q_lengths), 8, 64, dtype=torch.float64)
    k, v = torch.randn(2, sum(k_lengths), 2, 64, dtype=torch.float64)
    grad_out = torch.randn_like(q)
    max_lengths = (max(q_lengths), max(k_lengths))
    ref_out, ref_lse = kernels.varlen_forward(q, k, v, cu_q, cu_k, *max_lengths, causal=causal, scale=0.125)
    ref_grads = kernels.varlen_backward(grad_out, q, k, v, ref_out, ref_lse, cu_q, cu_k, *max_lengths,
                                        causal=causal, scale=0.125)

    q_c, k_c, v_c, grad_out_c = (x.to("cuda", dtype) for x in (q, k, v, grad_out))
    cu_q_c, cu_k_c = cu_q.cuda(), cu_k.cuda()
    out, lse = kernels.varlen_forward(q_c, k_c, v_c, cu_q_c, cu_k_c, *max_lengths, causal=causal, scale=0.125)
    grads = kernels.varlen_backward(grad_out_c, q_c, k_c, v_c, out, lse, cu_q_c, cu_k_c, *max_lengths,
                                    causal=causal, scale=0.125)
    assert lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=0, atol=5e-2)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=0, atol=5e-2)
    for got, ref in zip(grads, ref_grads):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.double().cpu(), ref, rtol=0, atol=5e-2 * float(ref.abs().max()))
