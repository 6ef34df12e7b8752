"""Rollouts: sample G completions per prompt with the policy's own weights.

Each distinct prompt is prefilled once and its K/V shared by its samples; finished sequences leave
the batch (at once on the CPU, by power-of-two buckets on a GPU: ``DecodeSchedule``); the sampler's
log-probs match the trainer's (``turbogrpo.completion_logprobs``).

    from turbogrpo.rollout import SamplingConfig, generate
    rollout = generate(model, prompts, num_samples=8, sampling=SamplingConfig(max_new_tokens=256), seed=0)
    rollout.tokens_per_group()  # per prompt, the 8 completions' token ids
"""

from turbogrpo.rollout.decode import DecodeSchedule, generate
from turbogrpo.rollout.metrics import logprob_gap
from turbogrpo.rollout.sampling import (SamplingConfig, draw_from_probs, sample_tokens, sample_with_logprobs,
                                        token_logprobs, warp_logits)
from turbogrpo.rollout.types import FinishReason, Rollout, RolloutStats

__all__ = ["DecodeSchedule", "FinishReason", "Rollout", "RolloutStats", "SamplingConfig", "draw_from_probs", "generate",
           "logprob_gap", "sample_tokens", "sample_with_logprobs", "token_logprobs", "warp_logits"]
