"""The chunked LM head + target log-prob against plain autograd of log_softmax, and by hand."""

import math

import pytest
import torch
from torch import nn

from turbogrpo.prefix import lm_head
from turbogrpo.prefix.lm_head import TargetLogprobs, lm_head_logprobs


def test_two_token_vocabulary_by_hand():
    # logits (0, ln 3) at temperature 1: p = (1/4, 3/4); entropy = -(1/4 ln 1/4 + 3/4 ln 3/4).
    logits = torch.tensor([[0.0, math.log(3)]], dtype=torch.float64, requires_grad=True)
    logp, entropy = TargetLogprobs.apply(logits, torch.tensor([1]), 1.0, True)
    assert logp.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    logp.sum().backward()
    # d log p_1 / d z = onehot(1) - p
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.25]], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [3, 1000], ids=["chunked", "one-chunk"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed-logits", "kept-logits"])
def test_values_and_gradients_equal_autograd_of_log_softmax(monkeypatch, temperature, chunk_rows, recompute):
    torch.manual_seed(0)
    vocab, hidden_size, num_tokens = 11, 6, 10
    monkeypatch.setattr(lm_head, "logit_chunk_rows", lambda *args: chunk_rows)
    monkeypatch.setattr(lm_head, "recomputes_logits", lambda *args: recompute)
    head = nn.Linear(hidden_size, vocab, bias=False).double()
    hidden = torch.randn(num_tokens, hidden_size, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(vocab, (num_tokens,))
    weights = torch.rand(num_tokens, dtype=torch.float64)  # uneven token weights

    logp, entropy = lm_head_logprobs(hidden, head, targets, temperature)
    (logp * weights).sum().backward()
    ours = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    log_softmax = (head(hidden) / temperature).log_softmax(-1)
    expected = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    (expected * weights).sum().backward()
    torch.testing.assert_close(logp, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1).detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(ours[0], hidden.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(ours[1], head.weight.grad, atol=1e-12, rtol=0)


def test_entropy_is_skipped_when_not_asked():
    head = nn.Linear(4, 7, bias=False)
    logp, entropy = lm_head_logprobs(torch.randn(5, 4), head, torch.zeros(5, dtype=torch.long), with_entropy=False)
    assert logp.shape == (5,) and entropy is None


def test_bfloat16_logits_give_float32_logprobs_and_bfloat16_gradients():
    head = nn.Linear(4, 7, bias=False).to(torch.bfloat16)
    hidden = torch.randn(5, 4, dtype=torch.bfloat16, requires_grad=True)
    logp, _ = lm_head_logprobs(hidden, head, torch.arange(5))
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and torch.isfinite(hidden.grad.float()).all()


def test_the_old_name_is_a_deprecated_alias():
    import turbogrpo.prefix
    with pytest.warns(DeprecationWarning, match="lm_head_logprobs"):
        assert turbogrpo.prefix.token_logprobs is lm_head_logprobs
