"""The sampler's log-probs and hidden states equal the trainer's (``turbogrpo.completion_logprobs``)."""

import pytest
import torch

from tests.rollout.conftest import random_prompts
from turbogrpo import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate, logprob_gap

CONFIGS = {
    "t1": SamplingConfig(max_new_tokens=10),
    "t0.7-topp-topk-stops": SamplingConfig(max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=20,
                                           stop_token_ids=list(range(6))),
    "greedy": SamplingConfig(max_new_tokens=10, temperature=0),
}


@pytest.mark.parametrize("arch, config", [("qwen2", "t1"), ("qwen2", "t0.7-topp-topk-stops"), ("qwen2", "greedy"),
                                          ("llama", "t0.7-topp-topk-stops")])
def test_sampler_logprobs_and_hidden_equal_the_trainers(arch, config, request):
    model, sampling = request.getfixturevalue(arch), CONFIGS[config]
    rollout = generate(model, random_prompts([3, 9, 6], seed=2), num_samples=3, sampling=sampling, seed=7,
                       return_hidden=True)
    with torch.no_grad():
        trainer_logps, trainer_hidden = completion_logprobs(
            model, rollout.prompts, rollout.tokens_per_group(), temperature=sampling.logprob_temperature,
            return_hidden=True)
    for ours, theirs in zip(rollout.logprobs_per_group(), trainer_logps):
        torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), atol=1e-4, rtol=0)
    for ours, theirs in zip(rollout.hidden_per_group(), trainer_hidden):
        torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), atol=1e-4, rtol=1e-4)
    assert logprob_gap(rollout, trainer_logps) < 1e-5


def test_logprob_gap_is_the_mean_absolute_difference(qwen2):
    rollout = generate(qwen2, random_prompts([4]), num_samples=2, sampling=SamplingConfig(max_new_tokens=3), seed=0)
    shifted = [[lp + 0.5 for lp in group] for group in rollout.logprobs_per_group()]
    assert logprob_gap(rollout, rollout.logprobs_per_group()) == 0.0
    assert logprob_gap(rollout, shifted) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one list per prompt"):
        logprob_gap(rollout, shifted[0])
    with pytest.raises(ValueError, match="shape"):
        logprob_gap(rollout, [[lp[:-1] for lp in group] for group in shifted])
