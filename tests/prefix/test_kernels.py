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
