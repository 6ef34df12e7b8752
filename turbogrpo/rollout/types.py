"""What a rollout returns.

Completions are ordered group-major: completion ``i`` is sample ``i % num_samples`` of prompt
``i // num_samples`` (``group_index`` says so explicitly), held in one ``turbogrpo.batch.Groups``. ``S_i`` is completion i's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from turbogrpo.batch import Groups

FinishReason = Literal["stop", "length"]
""""stop": ended on a stop token or stop string (kept as its last token); "length": max_new_tokens."""

@dataclass
class RolloutStats:
    """Cost of one rollout."""

    num_forwards: int = 0
    """Policy forwards: one prefill plus one per decoding step."""
    num_generated_tokens: int = 0
    wall_time_s: float = 0.0
    live_batch_sizes: list[int] = field(default_factory=list)
    """Live sequences in each decoding step (the forward after the prefill), in step order."""
    num_idle_steps: int = 0
    """Steps run after every sequence had finished (the rest of the last window of steps between
    two host checks; see ``DecodeSchedule``); not in ``num_forwards``."""

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0


@dataclass
class Rollout:
    """Completions of ``num_samples`` samples for each prompt, with the sampler's log-probs.

    ``groups`` holds them (``turbogrpo.batch.Groups``: K groups of G completions, group-major) with
    ``finish_reasons``, ``sampler_logps`` (``log_softmax(logits / T)`` of each generated token over the
    full vocabulary ``[S_i]``, float32, T = 1 when greedy: what the trainer recomputes) and, with
    ``return_hidden``, ``hidden`` (``[S_i, Hd]``: the policy's final, post-norm hidden state at the
    position that predicted each token, the prompt's last token for the first one). The attributes
    below are views of it.
    """

    groups: Groups
    stats: RolloutStats

    @property
    def prompts(self) -> list[torch.Tensor]:
        """Per group: the prompt ``[P_g]`` (int64)."""
        return self.groups.prompts

    @property
    def num_samples(self) -> int:
        return self.groups.sizes[0]

    @property
    def tokens(self) -> list[torch.Tensor]:
        """Per completion: generated token ids ``[S_i]`` (int64), stop token included."""
        return self.groups.completions

    @property
    def logprobs(self) -> list[torch.Tensor]:
        """Per completion: the sampler's log-prob of each generated token ``[S_i]``."""
        return self.groups.sampler_logps

    @property
    def finish_reasons(self) -> list[FinishReason]:
        return self.groups.finish_reasons

    @property
    def hidden(self) -> list[torch.Tensor] | None:
        """With ``return_hidden``: per completion ``[S_i, Hd]``; else None."""
        return self.groups.hidden

    @property
    def group_index(self) -> list[int]:
        """Per completion: index of its prompt in ``prompts``."""
        return [g for g, size in enumerate(self.groups.sizes) for _ in range(size)]

    @property
    def num_completions(self) -> int:
        return self.groups.num_completions

    def tokens_per_group(self) -> list[list[torch.Tensor]]:
        """``tokens`` grouped per prompt (the layout ``turbogrpo.completion_logprobs`` takes)."""
        return self.groups.nested()

    def logprobs_per_group(self) -> list[list[torch.Tensor]]:
        return self.groups.split(self.logprobs)

    def hidden_per_group(self) -> list[list[torch.Tensor]]:
        if self.hidden is None:
            raise ValueError("this rollout has no hidden states; generate with return_hidden=True")
        return self.groups.split(self.hidden)
