"""Metrics over a rollout that the trainer logs."""

from __future__ import annotations

import torch

from turbogrpo.rollout.types import Rollout


def logprob_gap(rollout: Rollout, trainer_logprobs: list[list[torch.Tensor]]) -> float:
    """Mean absolute difference between the sampler's and the trainer's log-probs over all tokens.

    ``trainer_logprobs``: per group, per completion ``[S_i]``, as ``turbogrpo.completion_logprobs``
    returns them for ``rollout.prompts`` and ``rollout.tokens_per_group()``. Near 0 when the sampler
    and the trainer see the same weights; large values mean stale weights or a numerics mismatch.
    """
    sampler = rollout.logprobs_per_group()
    if len(trainer_logprobs) != len(sampler) or any(len(t) != len(s) for t, s in zip(trainer_logprobs, sampler)):
        raise ValueError("trainer_logprobs must have one list per prompt with one tensor per completion, "
                         f"like rollout.logprobs_per_group() ({[len(s) for s in sampler]} completions)")
    gaps = []
    for trainer_group, sampler_group in zip(trainer_logprobs, sampler):
        for trainer, ours in zip(trainer_group, sampler_group):
            if trainer.shape != ours.shape:
                raise ValueError(f"trainer_logprobs entry has shape {tuple(trainer.shape)} where the "
                                 f"rollout's completion has {tuple(ours.shape)}")
            gaps.append((trainer.detach().float().to(ours.device) - ours).abs())
    flat = torch.cat(gaps)
    return float(flat.mean()) if flat.numel() else 0.0  # host sync: a logged scalar
