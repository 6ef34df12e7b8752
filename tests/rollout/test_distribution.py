"""Statistical test of the sampler: the joint distribution of the first two generated tokens.

For each prompt the exact distribution ``p(t1) * p(t2 | t1)`` is computed from the model's own
logits, warped with Hugging Face's warpers (independent of ours). A chi-square test compares it with
many samples from ``generate``. A sampler with a known bug (one first token shared by a group, the
wrong temperature) must fail the same test, so the test has the power to catch real mistakes.
"""

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import turbogrpo.rollout.step as step_module
from tests.rollout.conftest import build_model, random_prompts
from turbogrpo.rollout import SamplingConfig, generate

VOCAB = 16
NUM_SAMPLES = 5000  # per prompt
P_VALUE_FLOOR = 1e-3  # a correct sampler fails one run in a thousand; the seed is fixed anyway
CONFIGS = {
    "temperature 1": SamplingConfig(max_new_tokens=2, temperature=1.0),
    "temperature 0.7, top-p 0.9": SamplingConfig(max_new_tokens=2, temperature=0.7, top_p=0.9),
    "top-k 5": SamplingConfig(max_new_tokens=2, top_k=5),
}


@pytest.fixture(scope="module")
def small_vocab_model():
    return build_model("qwen2", vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([4, 7], vocab_size=VOCAB, seed=5)


def hf_warped_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers(None, logits.double()).softmax(-1)


@torch.no_grad()
def exact_joint(model, prompt: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``[V, V]``: probability that the first two tokens are (t1, t2)."""
    first = hf_warped_probs(model(prompt[None]).logits[:, -1], sampling)[0]
    extended = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
    second = hf_warped_probs(model(extended).logits[:, -1], sampling)
    return first[:, None] * second


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom); cells expecting < 5 samples are pooled into one bin, and a
    sample in a zero-probability cell makes the statistic infinite."""
    if counts[probs == 0].sum() > 0:
        return float("inf"), 1
    expected = probs * counts.sum()
    large = expected >= 5
    observed_bins = torch.cat([counts[large], counts[~large].sum()[None]])
    expected_bins = torch.cat([expected[large], expected[~large].sum()[None]])
    keep = expected_bins > 0
    statistic = ((observed_bins - expected_bins) ** 2 / expected_bins)[keep].sum()
    return float(statistic), int(keep.sum()) - 1


def sampler_p_value(model, prompts, sampling: SamplingConfig) -> float:
    rollout = generate(model, prompts, num_samples=NUM_SAMPLES, sampling=sampling, seed=1234)
    total_statistic, total_dof = 0.0, 0
    for prompt, completions in zip(prompts, rollout.tokens_per_group()):
        pairs = torch.stack(completions)
        counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()
        statistic, dof = chi_square(counts, exact_joint(model, prompt, sampling).flatten())
        total_statistic += statistic
        total_dof += dof
    return float(torch.special.gammaincc(torch.tensor(total_dof / 2, dtype=torch.float64),
                                         torch.tensor(total_statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_first_two_tokens_follow_the_exact_distribution(small_vocab_model, prompts, name):
    assert sampler_p_value(small_vocab_model, prompts, CONFIGS[name]) > P_VALUE_FLOOR


def test_a_group_sharing_its_first_token_fails(small_vocab_model, prompts, monkeypatch):
    """The FastGRPO reference's bug: one first token per prompt, copied to the whole group."""
    draw = step_module.sample_with_logprobs
    calls = []

    def shared_first_token(logits, sampling, generator=None, uniform=None):
        calls.append(1)
        if len(calls) > 1:
            return draw(logits, sampling, generator, uniform)
        tokens, logprobs = draw(logits[::NUM_SAMPLES], sampling, generator, uniform[::NUM_SAMPLES])
        return tokens.repeat_interleave(NUM_SAMPLES), logprobs.repeat_interleave(NUM_SAMPLES)

    monkeypatch.setattr(step_module, "sample_with_logprobs", shared_first_token)
    assert sampler_p_value(small_vocab_model, prompts, CONFIGS["temperature 1"]) < 1e-9


def test_a_wrong_temperature_fails(small_vocab_model, prompts, monkeypatch):
    draw = step_module.sample_with_logprobs

    def temperature_one(logits, sampling, generator=None, uniform=None):
        return draw(logits, dataclasses.replace(sampling, temperature=1.0), generator, uniform)

    monkeypatch.setattr(step_module, "sample_with_logprobs", temperature_one)
    assert sampler_p_value(small_vocab_model, prompts, CONFIGS["temperature 0.7, top-p 0.9"]) < 1e-9
