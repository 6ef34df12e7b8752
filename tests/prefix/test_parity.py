"""Shared-prefix vs. standard forward: log-probs and every parameter gradient must agree."""

import pytest
import torch

import turbogrpo
from tests.prefix.conftest import PACKS, build_gpt2, build_model, random_groups
from turbogrpo.models import enable_activation_checkpointing
from turbogrpo.prefix import kernels

BACKENDS = ["reference", "cascade", "varlen"]
TOLERANCES = {torch.float64: dict(logp_abs=1e-9, grad_abs=1e-9), torch.float32: dict(logp_abs=1e-5, grad_rel=1e-4)}


def logps_and_grads(model, prompts, completions, **kwargs):
    model.zero_grad(set_to_none=True)
    per_group = turbogrpo.completion_logprobs(model, prompts, completions, **kwargs)
    flat = torch.cat([t for group in per_group for t in group])
    # Uneven token weights, so a wrong routing of any single token's gradient shows up.
    weights = torch.linspace(-1.0, 2.0, flat.numel(), dtype=flat.dtype, device=flat.device)
    (flat * weights).sum().backward()
    return flat.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pack", sorted(PACKS))
def test_shared_prefix_matches_standard(arch, backend, dtype, pack):
    model = build_model(arch, dtype)
    prompts, completions = random_groups(*PACKS[pack])
    ref_logps, ref_grads = logps_and_grads(model, prompts, completions, share_prefix=False)
    logps, grads = logps_and_grads(model, prompts, completions, share_prefix=True, backend=backend)

    tol = TOLERANCES[dtype]
    assert logps.shape == ref_logps.shape
    assert (logps - ref_logps).abs().max() <= tol["logp_abs"]
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, ref in ref_grads.items():
        diff = (grads[name] - ref).abs().max()
        if "grad_abs" in tol:
            assert diff <= tol["grad_abs"], name
        else:
            assert diff <= tol["grad_rel"] * ref.abs().max().clamp_min(1e-6), name


# Half precision (varlen's flash call, flex with gradients on CUDA) is checked against a float32
# truth in test_precision.py: two half-precision paths compared with each other only measure noise.


def test_temperature_and_hidden_match_standard(arch):
    model = build_model(arch, torch.float64)
    prompts, completions = random_groups(*PACKS["mixed"])
    ref_logps, ref_hidden = turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=False,
                                                          temperature=0.7, return_hidden=True)
    logps, hidden = turbogrpo.completion_logprobs(model, prompts, completions, temperature=0.7,
                                                  return_hidden=True)
    for g, group in enumerate(completions):
        for i, completion in enumerate(group):
            assert logps[g][i].shape == completion.shape
            assert hidden[g][i].shape == (completion.numel(), model.config.hidden_size)
            torch.testing.assert_close(logps[g][i], ref_logps[g][i], rtol=0, atol=1e-10)
            torch.testing.assert_close(hidden[g][i], ref_hidden[g][i], rtol=0, atol=1e-10)


def test_logprobs_equal_model_logits_by_hand():
    """The first completion token is scored from the last prompt position, later ones from the
    previous completion token, at the given temperature."""
    model = build_model("qwen2", torch.float64)
    prompt, completion = torch.tensor([3, 14, 15]), torch.tensor([92, 65])
    logits = model(torch.cat([prompt, completion])[None]).logits[0]
    expected = torch.log_softmax(logits / 2.0, -1)[[2, 3], [92, 65]]
    got = turbogrpo.completion_logprobs(model, [prompt], [[completion]], temperature=2.0)[0][0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_absolute_position_models_run_exactly(backend):
    """GPT-2 adds a learnt embedding of each absolute position: every completion's positions continue
    its prompt's from 0, so the shared forward equals the model's own forward of prompt + completion."""
    model = build_gpt2(torch.float64)
    prompts, completions = random_groups(*PACKS["mixed"], seed=4)
    got = turbogrpo.completion_logprobs(model, prompts, completions, backend=backend)
    for prompt, group, got_group in zip(prompts, completions, got):
        for completion, logps in zip(group, got_group):
            logits = model(torch.cat([prompt, completion])[None]).logits[0]
            expected = torch.log_softmax(logits, -1)[torch.arange(prompt.numel() - 1, logits.shape[0] - 1), completion]
            torch.testing.assert_close(logps, expected, rtol=0, atol=1e-10)


def test_flex_backend_forward_matches_standard():
    model = build_model("qwen2", torch.float64)
    prompts, completions = random_groups(*PACKS["mixed"])
    with torch.no_grad():
        ref = turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=False)
        flex = turbogrpo.completion_logprobs(model, prompts, completions, backend="flex")
    torch.testing.assert_close(torch.cat(sum(flex, [])), torch.cat(sum(ref, [])), rtol=0, atol=1e-10)


def test_flex_backend_refuses_cpu_backward():
    model = build_model("qwen2")
    prompts, completions = random_groups(*PACKS["single"])
    with pytest.raises(ValueError, match="no backward on CPU"):
        turbogrpo.completion_logprobs(model, prompts, completions, backend="flex")


def test_gradient_checkpointing(arch):
    model = build_model(arch, torch.float64)
    prompts, completions = random_groups(*PACKS["mixed"])
    ref_logps, ref_grads = logps_and_grads(model, prompts, completions, share_prefix=False)
    enable_activation_checkpointing(model)
    model.train()
    logps, grads = logps_and_grads(model, prompts, completions, backend="cascade")
    torch.testing.assert_close(logps, ref_logps, rtol=0, atol=1e-10)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=1e-10)


def test_chunked_lm_head_matches_unchunked(monkeypatch):
    from turbogrpo.prefix import lm_head
    model = build_model("llama", torch.float64)
    prompts, completions = random_groups(*PACKS["mixed"])
    ref_logps, ref_grads = logps_and_grads(model, prompts, completions)
    # 3 rows per chunk: many chunks, a ragged last one.
    monkeypatch.setattr(lm_head, "logit_chunk_rows", lambda *args: 3)
    logps, grads = logps_and_grads(model, prompts, completions)
    torch.testing.assert_close(logps, ref_logps, rtol=0, atol=1e-12)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", ["reference", "cascade", "cascade-math"])
@pytest.mark.parametrize("window", [3, 6])
@pytest.mark.parametrize("windowed_arch", ["mistral", "gemma3"])
def test_shared_prefix_under_a_sliding_window_matches_standard(monkeypatch, windowed_arch, window, backend, dtype):
    """Windows shorter than prompts (the prompt part is banded) and than completions (late completion
    tokens see none of the prompt: a part with no visible key must drop out of the merge).
    "cascade-math": the cascade's parts by the matmul kernels that devices without CPU flash run."""
    if backend == "cascade-math":
        monkeypatch.setattr(kernels, "_use_cpu_flash", lambda q: False)
        backend = "cascade"
    model = build_model(windowed_arch, dtype, sliding_window=window,
                        **({"layer_types": ["sliding_attention", "full_attention"]} if windowed_arch == "gemma3" else {}))
    prompts, completions = random_groups(*PACKS["mixed"])
    ref_logps, ref_grads = logps_and_grads(model, prompts, completions, share_prefix=False)
    logps, grads = logps_and_grads(model, prompts, completions, share_prefix=True, backend=backend)
    tol = TOLERANCES[dtype]
    assert logps.isfinite().all() and (logps - ref_logps).abs().max() <= tol["logp_abs"]
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        diff = (grads[name] - ref).abs().max()
        assert grads[name].isfinite().all(), name
        assert diff <= tol.get("grad_abs", tol.get("grad_rel", 0) * ref.abs().max().clamp_min(1e-6)), name


def test_flex_forward_under_a_sliding_window_matches_standard():
    """FlexAttention's windowed rule (forward only: it has no CPU backward)."""
    model = build_model("mistral", torch.float64, sliding_window=3)
    prompts, completions = random_groups(*PACKS["mixed"])
    with torch.no_grad():
        expected = turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=False)
        got = turbogrpo.completion_logprobs(model, prompts, completions, backend="flex")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


def test_standard_layout_with_short_sliding_window_matches_model_logits():
    """The standard path's own attention plan applies a sliding window exactly as transformers does."""
    model = build_model("mistral", torch.float64, sliding_window=4)
    prompt, completions = torch.tensor([3, 14, 15, 9]), [torch.tensor([92, 65, 35, 8]), torch.tensor([7])]
    expected = []
    for completion in completions:
        logits = model(torch.cat([prompt, completion])[None]).logits[0]
        positions = torch.arange(prompt.numel() - 1, prompt.numel() + completion.numel() - 1)
        expected.append(torch.log_softmax(logits, -1)[positions, completion])
    got = turbogrpo.completion_logprobs(model, [prompt], [completions], share_prefix=False)[0]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
