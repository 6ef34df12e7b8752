"""The native engine: turbogrpo's own rollout (``rollout.generate``) and conversations (``env.run_episodes``),
sampling with the policy module itself, so there are no weights to push."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from turbogrpo.rollout.decode import DecodeSchedule, generate
from turbogrpo.rollout.multiturn import generate_multiturn
from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.types import Rollout


class NativeEngine:
    """``rollout.generate`` with the run's ``DecodeSchedule`` (plain or speculative with ``draft``); with
    ``record_routes`` every rollout keeps its MoE routes (algo.routing_replay)."""

    holds_weights = False

    def __init__(self, schedule: DecodeSchedule | None, record_routes: bool = False):
        self.schedule = schedule
        self.record_routes = record_routes

    def sample(self, policy: nn.Module, prompts: list[torch.Tensor], *, num_samples: int,
               sampling: SamplingConfig, seed: int | None, draft: object | None = None,
               return_hidden: bool = False) -> Rollout:
        return generate(policy, prompts, num_samples=num_samples, sampling=sampling, seed=seed,
                        schedule=self.schedule, draft=draft, return_hidden=return_hidden,
                        record_routes=self.record_routes)

    def sample_conversations(self, policy: nn.Module, tokenizer, examples: Sequence, episodes, *,
                             num_samples: int, sampling: SamplingConfig, seed: int | None,
                             draft: object | None = None):
        return episodes.sample(policy, tokenizer, examples, num_samples=num_samples, sampling=sampling, seed=seed,
                               schedule=self.schedule, branched=True, draft=draft,
                               generate=partial(generate_multiturn, record_routes=self.record_routes))

    def sample_partial(self, policy: nn.Module, prefixes: list[torch.Tensor], *, limits: list[int],
                       sampling: SamplingConfig, seed: int | None, until: Callable[[list[bool]], bool],
                       draft: object | None = None, prefix_routes: list[torch.Tensor | None] | None = None) -> Rollout:
        """One completion of each prefix (``[P_i]`` ids: a prompt, or a prompt and a carried generation's tokens,
        prefilled afresh) of at most ``limits[i]`` new tokens, stopped early where ``until`` says (a partial
        rollout: ``train/worker/partial_rollouts.py``); speculative with ``draft`` (a ``Speculation``). Recording
        routes, the prefill replays ``prefix_routes`` (a carried generation keeps the experts that ran its ids)."""
        return generate(policy, prefixes, num_samples=1, sampling=sampling, seed=seed, schedule=self.schedule,
                        max_new_tokens_per_completion=limits, until=until, draft=draft,
                        record_routes=self.record_routes, prefix_routes=prefix_routes if self.record_routes else None)

    def push_weights(self, policy: nn.Module) -> None:
        pass  # samples with the policy module itself
