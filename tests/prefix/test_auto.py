"""backend="auto": the measured rule, by hand, and exact results whichever layout it picks."""

import pytest
import torch

import turbogrpo
from tests.prefix.conftest import build_model, random_groups
from turbogrpo.prefix import auto, backend_names, logprobs
from turbogrpo.prefix.cost import ModelDims, layout_flops

# 1 layer, 1 head of dim 2, hidden 2, intermediate 1, vocab 10: linear work per token
# 2 * (2*2 + 2*2*2 + 2*2 + 3*2*1) = 44, attention work per visible pair 4 * 2 = 8.
TINY = ModelDims(hidden=2, intermediate=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, vocab=10)


def test_layout_flops_by_hand():
    # One group, P=2, completions of 1 and 3 tokens.
    flops = layout_flops(TINY, [2], [[1, 3]])
    lm_head = 2 * 2 * 10 * 4
    # standard: tokens 3 + 5 = 8, pairs 3*4/2 + 5*6/2 = 21
    assert flops.standard == 8 * 44 + 21 * 8 + lm_head
    # shared: tokens 2 + 4 = 6, pairs 2*3/2 + (1*2 + 1) + (3*2 + 6) = 3 + 3 + 12 = 18
    assert flops.shared == 6 * 44 + 18 * 8 + lm_head
    assert flops.ratio == pytest.approx(flops.standard / flops.shared)


def test_rule_shares_long_prompts_and_not_short_ones():
    model = build_model("qwen2")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    long_prompt, short_prompt = ([200], [[8] * 8]), ([4], [[200] * 2])
    assert auto.choose_auto(model, *long_prompt, cpu, torch.float32, True) == "cascade"
    assert auto.choose_auto(model, *short_prompt, cpu, torch.float32, True) == auto.STANDARD
    # CUDA (rule only; availability of flash varlen depends on the torch build).
    cuda_choice = auto.choose_auto(model, *long_prompt, cuda, torch.bfloat16, True)
    assert cuda_choice in ("varlen", "flex")
    assert auto.choose_auto(model, *long_prompt, cuda, torch.float32, True) != "varlen"  # flash is half only
    assert auto.choose_auto(model, *short_prompt, cuda, torch.bfloat16, True) == auto.STANDARD


def test_every_rule_names_registered_backends():
    for rule in auto.AUTO_RULES.values():
        assert set(rule.backends) <= set(backend_names()) - {"auto"}
    assert backend_names()[0] == "auto" and {"cascade", "varlen", "flex", "reference"} <= set(backend_names())


@pytest.mark.parametrize("lengths, layout", [(([30], [[3, 4, 2, 5]]), "shared"), (([2], [[40, 35]]), "standard")])
def test_auto_is_exact_whichever_layout_it_runs(monkeypatch, lengths, layout):
    model = build_model("qwen2", torch.float64)
    prompts, completions = random_groups(*lengths)
    ran = []
    for name in ("_shared_prefix_hidden", "_standard_hidden"):
        original = getattr(logprobs, name)
        monkeypatch.setattr(logprobs, name, lambda *a, _f=original, _n=name: ran.append(_n) or _f(*a))
    got = turbogrpo.completion_logprobs(model, prompts, completions)
    assert ran == ["_shared_prefix_hidden" if layout == "shared" else "_standard_hidden"]
    expected = turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=False)
    for g, e in zip(sum(got, []), sum(expected, [])):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)
