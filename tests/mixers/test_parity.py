"""Hybrid models in the shared-prefix and trie forwards against the model's own forward of each sequence alone:
log-probs and every parameter gradient, in float64 to 1e-10 (the kernels and norms run in float64, see
conftest.py), with activation checkpointing, and in float32 as shipped."""

import warnings

import pytest
import torch

from tests.mixers.conftest import FAMILIES, build_hybrid, random_groups
from tests.prefix.conftest import PACKS
from tests.tree.conftest import TRIE_SHAPES, per_sequence_truth, random_masks_and_weights, random_sequences
from turbogrpo.models import enable_activation_checkpointing
from turbogrpo.prefix import completion_logprobs
from turbogrpo.tree import build_trie, tree_logprobs

EXACT = 1e-10
AS_SHIPPED = 2e-4   # float32 log-probs, the kernels computing in float32 as transformers ships them


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def gradients(model, logps, weights):
    """Every trainable parameter's gradient of ``sum(weights * logps)`` (each must get one)."""
    model.zero_grad(set_to_none=True)
    (logps * weights.to(logps.dtype)).sum().backward()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in trainable.values()), [n for n, p in trainable.items() if p.grad is None]
    return {name: p.grad.clone() for name, p in trainable.items()}


def own_forward_logps(model, prompts, completions):
    """``[Nq]`` from the model's own forward of each prompt + completion alone (flat, group by group)."""
    sequences = [torch.cat([p, c]) for p, cs in zip(prompts, completions) for c in cs]
    masks = [torch.arange(s.numel()) >= p.numel() for s, p in
             zip(sequences, (p for p, cs in zip(prompts, completions) for _ in cs))]
    return per_sequence_truth(model, sequences, masks)


def errors(model, truth, got, weights, truth_grads=None):
    """(max |log-prob error|, max over parameters of max |gradient error|); every parameter gets a gradient.
    ``truth_grads``: the truth's gradients when already taken (else from ``truth``'s graph)."""
    truth_grads = truth_grads or gradients(model, truth, weights)
    got_grads = gradients(model, got, weights)
    assert got.shape == truth.shape and got.isfinite().all()
    return ((got - truth).abs().max().item(),
            max((got_grads[n] - ref).abs().max().item() for n, ref in truth_grads.items()))


def prefix_weights(num_tokens: int) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, num_tokens, dtype=torch.float64)   # uneven: a misrouted gradient shows


def prefix_errors(model, pack, truth=None, **kwargs):
    """``truth``: ``(log-probs, gradients)`` of the model's own forward, when this model and pack already gave it."""
    prompts, completions = random_groups(*PACKS[pack])
    logps = truth[0] if truth else own_forward_logps(model, prompts, completions)
    weights = prefix_weights(logps.numel())
    got = torch.cat([t for group in completion_logprobs(model, prompts, completions, **kwargs) for t in group])
    return errors(model, logps, got, weights, truth[1] if truth else None)


TRUTHS: dict[tuple[str, str], tuple[dict, torch.Tensor, dict]] = {}
"""(family, pack) -> (the model's parameters, its own forward's log-probs and gradients): taken once for the five
backend cases of one model and pack (the model is built from the same seed each time, in float64 throughout)."""


def own_forward_truth(model, family: str, pack: str) -> tuple[torch.Tensor, dict]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    if (family, pack) not in TRUTHS:
        prompts, completions = random_groups(*PACKS[pack])
        logps = own_forward_logps(model, prompts, completions)
        TRUTHS[family, pack] = ({n: p.clone() for n, p in params.items()}, logps.detach(),
                                gradients(model, logps, prefix_weights(logps.numel())))
    made_with, logps, grads = TRUTHS[family, pack]
    assert made_with.keys() == params.keys() and all(torch.equal(made_with[n], p) for n, p in params.items())
    return logps, grads


def tree_errors(model, shape, seed=0, **kwargs):
    sequences = random_sequences(**TRIE_SHAPES[shape], seed=seed)
    masks, weights = random_masks_and_weights(sequences, seed)
    truth = per_sequence_truth(model, sequences, masks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback to one row per sequence
        result = tree_logprobs(model, build_trie(sequences, masks), **kwargs)
    assert result.layout == "tree"
    return errors(model, truth, result.logps, torch.cat([w[m] for w, m in zip(weights, masks)]))


@pytest.mark.parametrize("share_prefix, backend", [(True, "auto"), (True, "cascade"), (True, "reference"),
                                                   (True, "varlen"), (False, "auto")])
@pytest.mark.parametrize("pack", sorted(PACKS))
def test_shared_prefix_is_the_models_own_forward(float64_throughout, family, pack, share_prefix, backend):
    model = build_hybrid(family)
    truth = own_forward_truth(model, family, pack)
    logp_error, grad_error = prefix_errors(model, pack, truth, share_prefix=share_prefix, backend=backend)
    assert logp_error <= EXACT and grad_error <= EXACT, (logp_error, grad_error)


@pytest.mark.parametrize("shape", sorted(TRIE_SHAPES))
def test_tree_is_the_models_own_forward(float64_throughout, family, shape):
    """Deep tries, one-token nodes (a convolution's taps cross several nodes), a 200-token root (several chunks
    of the delta rule before the first branch)."""
    model = build_hybrid(family)
    logp_error, grad_error = tree_errors(model, shape, backend="cascade")
    assert logp_error <= EXACT and grad_error <= EXACT, (logp_error, grad_error)


def test_activation_checkpointing_recomputes_the_same_numbers(float64_throughout, family):
    """The plan rides on the mask into every layer, also when checkpointing recomputes it in the backward."""
    model = build_hybrid(family)
    enable_activation_checkpointing(model)
    model.train()
    for logp_error, grad_error in (prefix_errors(model, "mixed", backend="cascade"),
                                   tree_errors(model, "deep-narrow", backend="cascade")):
        assert logp_error <= EXACT and grad_error <= EXACT, (logp_error, grad_error)


def test_float32_as_shipped(family):
    """The kernels and norms as transformers ships them (float32 inside): shared within the dtype's rounding."""
    model = build_hybrid(family, torch.float32)
    logp_error, _ = prefix_errors(model, "mixed", backend="cascade")
    assert logp_error <= AS_SHIPPED
    logp_error, _ = tree_errors(model, "long-shared", backend="cascade")
    assert logp_error <= AS_SHIPPED


@pytest.mark.parametrize("model_type, targets", [("qwen3_5_text", ["in_proj_qkv", "in_proj_a", "out_proj", "q_proj"]),
                                                 ("nemotron_h", ["in_proj", "q_proj"])])
def test_lora_adapters_on_the_mixers(float64_throughout, model_type, targets):
    """PEFT wraps the mixers' projections: the units call them as modules, so the adapters apply (and train)."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(build_hybrid(model_type), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                init_lora_weights=False))
    for logp_error, grad_error in (prefix_errors(model, "mixed", backend="cascade"),
                                   tree_errors(model, "deep-narrow", backend="cascade")):
        assert logp_error <= EXACT and grad_error <= EXACT, (logp_error, grad_error)


# (PEFT itself refuses a Mamba-2's conv1d.) A pattern: LFM2's mixer module is named "conv" too.
@pytest.mark.parametrize("model_type, convolutions", [("qwen3_5_text", r".*\.conv1d"), ("lfm2", r".*\.conv\.conv")])
def test_an_adapter_on_a_mixers_convolution_is_refused_in_one_line(model_type, convolutions):
    """PEFT takes a LoRA on a depthwise convolution whose channels divide the rank; the units read the convolution's
    own weights, so they would skip it: refused, where our forward would otherwise differ from the model's own."""
    from peft import LoraConfig, get_peft_model
    model = build_hybrid(model_type, torch.float32)
    channels = next(m for m in model.modules() if isinstance(m, torch.nn.Conv1d)).out_channels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT: "Merging is not supported" for a grouped convolution
        model = get_peft_model(model, LoraConfig(r=channels, lora_alpha=channels, target_modules=convolutions,
                                                 init_lora_weights=False))
    with pytest.raises(ValueError, match=r"^a hybrid's depthwise convolution is wrapped by peft\..*lora\.target_modules"):
        prefix_errors(model, "mixed", backend="cascade")
