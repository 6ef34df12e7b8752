"""The native engine: turbogrpo's own rollout (``rollout.generate``) and conversations (``env.run_episodes``),
sampling with the policy module itself, so there are no weights to push."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from turbogrpo.rollout.engine import DecodeSchedule, generate
from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.types import Rollout


class NativeEngine:
    """``rollout.generate`` with the run's ``DecodeSchedule`` (plain or speculative with ``draft``)."""

    holds_weights = False

    def __init__(self, schedule: DecodeSchedule | None):
        self.schedule = schedule

    def sample(self, policy: nn.Module, prompts: list[torch.Tensor], *, num_samples: int,
               sampling: SamplingConfig, seed: int | None, draft: object | None = None,
               return_hidden: bool = False) -> Rollout:
        return generate(policy, prompts, num_samples=num_samples, sampling=sampling, seed=seed,
                        schedule=self.schedule, draft=draft, return_hidden=return_hidden)

    def sample_conversations(self, policy: nn.Module, tokenizer, examples: Sequence, episodes, *,
                             num_samples: int, sampling: SamplingConfig, seed: int | None,
                             draft: object | None = None):
        return episodes.sample(policy, tokenizer, examples, num_samples=num_samples, sampling=sampling, seed=seed,
                               schedule=self.schedule, branched=True, draft=draft)

    def push_weights(self, policy: nn.Module) -> None:
        pass  # samples with the policy module itself
