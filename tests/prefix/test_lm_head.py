"""LM-head chunking by a device memory budget, and the compiled chunk kernels against eager
(the eager math itself is checked against autograd in test_lm_head_logprobs.py)."""

import types

import pytest
import torch

from turbogrpo.prefix import lm_head


def test_cpu_chunks_hold_the_tuned_budget_by_hand():
    cpu = torch.device("cpu")
    # 192 MiB / (16384 * (4 + 8) bytes) = 1024 rows: 2**24 float32 logits, the CPU bench's tuned size.
    assert lm_head.logit_chunk_rows(10_000, 16384, torch.float32, cpu) == 1024
    # bf16 at Qwen2's vocabulary the budget gives 201326592 // (151936 * 10) = 132 rows; CPU chunks keep
    # at least 256 rows (skinny GEMMs run far below the matmul rate), as at Gemma 3's 262k vocabulary.
    assert lm_head.logit_chunk_rows(10_000, 151936, torch.bfloat16, cpu) == 256
    assert lm_head.logit_chunk_rows(10_000, 262144, torch.float32, cpu) == 256
    assert lm_head.logit_chunk_rows(7, 16384, torch.float32, cpu) == 7          # never more than there are
    assert lm_head.logit_chunk_rows(10, 2 ** 40, torch.float32, cpu) == 1      # never fewer than one


def test_cuda_chunks_scale_with_device_memory(monkeypatch):
    h200 = types.SimpleNamespace(total_memory=150_000_000_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    # Uncached, so the stand-in device's memory does not stay in the process-wide cache.
    monkeypatch.setattr(lm_head, "_device_memory_bytes", lm_head._device_memory_bytes.__wrapped__)
    budget = lm_head._chunk_budget_bytes.__wrapped__(torch.device("cuda", 0))
    assert budget == 150_000_000_000 // 64
    monkeypatch.setattr(lm_head, "_chunk_budget_bytes", lambda device: budget)
    # 2343750000 // (151936 * 10) = 1542 rows of bf16 logits: ~2**27.8 elements per chunk.
    assert lm_head.logit_chunk_rows(10_000, 151936, torch.bfloat16, torch.device("cuda", 0)) == 1542


def test_logits_are_kept_for_the_backward_up_to_a_sixteenth_of_device_memory(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(lm_head, "_device_memory_bytes", lambda device: 24 * 2 ** 30)
    # 24 GiB / 16 = 1.5 GiB: 8192 float32 rows at vocab 49152 are 1.5 GiB exactly (kept), one more is not.
    assert not lm_head.recomputes_logits(8192, 49152, torch.float32, cpu)
    assert lm_head.recomputes_logits(8193, 49152, torch.float32, cpu)
    assert not lm_head.recomputes_logits(16384, 49152, torch.bfloat16, cpu)   # half the bytes per logit


def test_kept_logits_skip_the_recomputing_matmul(monkeypatch):
    calls = []
    head = torch.nn.Linear(4, 9, bias=False)
    head.register_forward_hook(lambda *args: calls.append(1))
    hidden = torch.randn(6, 4, requires_grad=True)
    for recompute, expected_calls in ((True, 2), (False, 1)):
        calls.clear()
        monkeypatch.setattr(lm_head, "recomputes_logits", lambda *args, value=recompute: value)
        logps, _ = lm_head.lm_head_logprobs(hidden, head, torch.randint(9, (6,)))
        logps.sum().backward()
        assert len(calls) == expected_calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk kernels are used on CUDA only")
def test_compiled_cuda_kernels_match_eager():
    torch.manual_seed(0)
    kernels = lm_head.logprob_kernels("cuda")
    grads = torch.randn(2, 37, device="cuda")
    for rows in (37, 5):   # a full and a ragged last chunk: one dynamic graph
        logits = torch.randn(rows, 1000, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, 1000, (rows,), device="cuda")
        got = kernels.forward(logits, targets, 0.7, True)
        want = lm_head.logprobs_forward(logits, targets, 0.7, True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        torch.testing.assert_close(kernels.backward(logits, targets, got[1], grads[0, :rows], 0.7),
                                   lm_head.logprobs_backward(logits, targets, want[1], grads[0, :rows], 0.7))
