"""One tiny model of every class of turbogrpo.architectures: what the table (and docs/guide/architectures.md)
says each runs, it runs, with the model's own forward's numbers in float64."""

import warnings

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, MambaConfig, MambaForCausalLM, StableLmConfig,
                          StableLmForCausalLM)

from tests.prefix.conftest import build_gpt2, build_model, full_precision_norms
from tests.test_output_head import TRANSFORMED, build, own_logprobs
from turbogrpo import architectures
from turbogrpo.hook import check_supported
from turbogrpo.models import enable_activation_checkpointing
from turbogrpo.prefix import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.tree import build_trie, tree_logprobs

VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def stablelm(dtype=torch.float64):
    """Partial rotary (a quarter of each head), per-head q/k LayerNorms, parallel residual."""
    torch.manual_seed(0)
    config = StableLmConfig(**SIZES, qk_layernorm=True, use_parallel_residual=True, hidden_dropout=0.0)
    return StableLmForCausalLM(config).to(dtype).eval()


def gemma2():
    torch.manual_seed(0)
    config = Gemma2Config(**{**SIZES, "hidden_size": 32}, head_dim=16, attn_logit_softcapping=20.0,
                          final_logit_softcapping=5.0, sliding_window=4)
    model = Gemma2ForCausalLM(config).double().eval()
    full_precision_norms(model)
    return model


def mamba():
    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1)).double().eval()


# One builder per model type of architectures.VERIFIED_SHARED (a test keeps the two lists equal).
SHARED = {
    "llama": lambda: build_model("llama", torch.float64),
    "qwen2": lambda: build_model("qwen2", torch.float64),
    "qwen3": lambda: build_model("qwen3", torch.float64),
    "mistral": lambda: build_model("mistral", torch.float64, sliding_window=5),
    "gemma3_text": lambda: build_model("gemma3", torch.float64, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention"],
                                       final_logit_softcapping=3.0),
    "stablelm": stablelm,
    "gpt2": lambda: build_gpt2(torch.float64, vocab=VOCAB),
    "granite": lambda: build(TRANSFORMED["granite"]),
    "cohere": lambda: build(TRANSFORMED["cohere"]),
}


def groups(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 4)]
    completions = [[torch.randint(3, VOCAB, (n,), generator=g) for n in ns] for ns in ([3, 6, 1], [7, 2])]
    return prompts, completions


def sequences_and_masks():
    prompts, completions = groups()
    sequences = [torch.cat([p, c]) for p, cs in zip(prompts, completions) for c in cs]
    return sequences, [torch.arange(s.numel()) >= 4 for s in sequences]


def truth_of(model, sequences):
    return torch.cat([own_logprobs(model, s, 4) for s in sequences])


def test_the_table_lists_what_this_file_verifies():
    assert set(SHARED) == set(architectures.VERIFIED_SHARED)


@pytest.mark.parametrize("model_type", sorted(SHARED))
def test_a_shared_model_type_runs_shared_with_its_own_forwards_numbers(model_type):
    model = SHARED[model_type]()
    assert model.config.model_type == model_type
    prompts, completions = groups()
    shared = completion_logprobs(model, prompts, completions, backend="cascade")
    for prompt, group, group_logps in zip(prompts, completions, shared):
        for completion, logps in zip(group, group_logps):
            truth = own_logprobs(model, torch.cat([prompt, completion]), prompt.numel())
            torch.testing.assert_close(logps, truth, rtol=0, atol=1e-11)
    sequences, masks = sequences_and_masks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback warning
        tree = tree_logprobs(model, build_trie(sequences, masks))
    assert tree.layout == "tree"
    torch.testing.assert_close(tree.logps, truth_of(model, sequences), rtol=0, atol=1e-11)


def grads(model, logps_fn):
    model.zero_grad()
    logps = torch.cat([lp for group in logps_fn() for lp in group])
    (logps * torch.linspace(-1, 1, logps.numel(), dtype=logps.dtype)).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_stablelm_gradients_are_exact_shared_and_under_activation_checkpointing():
    """StableLM's decoder layers drop extra keywords before their attention: the plan reaches it on the mask,
    also when activation checkpointing recomputes a layer in the backward."""
    model = stablelm().train()
    prompts, completions = groups()
    unshared = grads(model, lambda: completion_logprobs(model, prompts, completions, share_prefix=False))
    shared = grads(model, lambda: completion_logprobs(model, prompts, completions, backend="cascade"))
    enable_activation_checkpointing(model)
    recomputed = grads(model, lambda: completion_logprobs(model, prompts, completions, backend="cascade"))
    for name, truth in unshared.items():
        assert truth.abs().max() > 0, name
        torch.testing.assert_close(shared[name], truth, rtol=0, atol=1e-10, msg=name)
        torch.testing.assert_close(recomputed[name], truth, rtol=0, atol=1e-10, msg=name)


def test_stablelm_samples_with_its_own_logprobs():
    model = stablelm(torch.float32)
    prompts = groups()[0]
    rollout = generate(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=5), seed=0)
    for index, (tokens, logps) in enumerate(zip(rollout.tokens, rollout.logprobs)):
        prompt = prompts[index // 2]
        torch.testing.assert_close(logps, own_logprobs(model, torch.cat([prompt, tokens]), prompt.numel()),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("make_model, model_type, what", [
    (gemma2, "gemma2", "soft-caps its attention logits"),
    (mamba, "mamba", "mixes tokens with recurrent/convolutional/linear-attention layers"),
])
def test_a_tree_fallback_type_is_refused_shared_and_scored_one_row_per_sequence(make_model, model_type, what):
    """The shared-prefix forward and the rollout refuse it in one line (before touching the model), and
    tree_logprobs then still runs it through its own attention, with its own forward's numbers."""
    model = make_model()
    implementation = model.config._attn_implementation
    prompts, completions = groups()
    refusal = f"^model type '{model_type}' {what}; turbogrpo's attention plans"
    with pytest.raises(ValueError, match=refusal):
        completion_logprobs(model, prompts, completions)
    with pytest.raises(ValueError, match=refusal):
        completion_logprobs(model, prompts, completions, share_prefix=False)
    with pytest.raises(ValueError, match=refusal):
        generate(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=3))
    from turbogrpo.engines.vllm import VllmEngine
    with pytest.raises(ValueError, match=refusal):   # before vllm is imported: runs without it too
        VllmEngine(torch.float32, torch.device("cpu")).build(model)
    assert model.config._attn_implementation == implementation   # the hook was not installed
    sequences, masks = sequences_and_masks()
    with pytest.warns(UserWarning, match=f"model type '{model_type}' {what}; falling back to one row per sequence"):
        result = tree_logprobs(model, build_trie(sequences, masks))
    assert result.layout == "per_sequence"
    # Mamba's own forward rounds its logits to float32.
    torch.testing.assert_close(result.logps, truth_of(model, sequences).double(), rtol=0,
                               atol=1e-11 if model_type == "gemma2" else 1e-6)


def test_the_table_of_hybrids_lists_what_tests_mixers_verifies():
    from tests.mixers.conftest import FAMILIES
    assert set(FAMILIES) == set(architectures.SHARED_IN_TRAINING)


def test_a_hybrid_runs_shared_in_training_and_in_the_native_rollout_and_vllm_refuses_it_in_one_line():
    """The shared-prefix and trie forwards run it (tests/mixers checks the numbers), the native engine samples it with
    its state cache (tests/rollout/test_hybrid.py); the vLLM engine's check (no state cache there yet) refuses it,
    naming what runs it."""
    from tests.mixers.conftest import build_hybrid
    model = build_hybrid("qwen3_5_text", torch.float32)
    prompts, completions = groups()
    completion_logprobs(model, prompts, completions, backend="cascade")
    sequences, masks = sequences_and_masks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback warning
        assert tree_logprobs(model, build_trie(sequences, masks)).layout == "tree"
    generate(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=3))
    refusal = ("^model type 'qwen3_5_text' has layer types \\['linear_attention'\\]; turbogrpo's training "
               "forwards and native rollout engine run it .*the vLLM engine serves only some hybrids")
    with pytest.raises(ValueError, match=refusal):
        check_supported(model)


def test_every_token_mixing_rule_refuses_its_known_types():
    for rule in architectures.TOKEN_MIXING_RULES:
        for model_type in rule.known_model_types:
            config = type("Config", (), {"model_type": model_type, "attn_logit_softcapping": 50.0
                                         if "soft-capping" in rule.summary else None})()
            assert rule.does(config) is not None, (rule.summary, model_type)
