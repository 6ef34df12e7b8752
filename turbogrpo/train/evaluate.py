"""Held-out accuracy: greedy (and sampled) answers to fixed prompts, scored by the accuracy reward.

Built once (``build_held_out``) and measured the same way by a training run, between its steps, and by
``turbogrpo eval``. With an environment (``[env]``) every answer is a whole conversation, scored by the
accuracy reward with the episodes (the built-in "environment" reward: the environment's own score).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from turbogrpo.data import PromptExample
from turbogrpo.placement import DistInfo
from turbogrpo.rewards import Reward, score_completions
from turbogrpo.rollout import Rollout, SamplingConfig, generate
from turbogrpo.train.episodes import EpisodeSampler
from turbogrpo.train.distributed import all_reduce_sum


class HeldOutAccuracy(NamedTuple):
    """An accuracy over the answers the reward could score; answers it failed on are left out and counted."""

    accuracy: float | None
    """Mean score of the scored answers; None when the reward failed on every answer."""
    num_scored: int
    num_failed: int
    first_error: str | None
    """The reward's first failure on this rank (None: none here)."""

    def describe_failures(self, reward_name: str) -> str:
        return (f"reward {reward_name!r} failed on {self.num_failed} of {self.num_scored + self.num_failed} "
                f"held-out answers ({self.first_error or 'see the other ranks'})")


def evaluate_accuracy(model: nn.Module, tokenizer, examples: Sequence[PromptExample], accuracy: Reward,
                      sampling: SamplingConfig, dist: DistInfo, *, num_samples: int = 1, seed: int | None = None,
                      prompts_per_batch: int = 64, episodes: EpisodeSampler | None = None) -> HeldOutAccuracy:
    """Mean accuracy of ``num_samples`` answers per example (each rank answers a share of the examples).

    Greedy ``sampling`` with one sample gives greedy accuracy; temperature sampling with a fixed
    ``seed`` gives the sampled (pass@1) accuracy, comparable from one evaluation to the next.
    An answer the reward fails on (it raised, or returned None/NaN) is not scored as wrong: it is
    left out of the accuracy and counted, so a broken reward never shows up as a low accuracy.
    ``episodes``: answer in conversations with the run's environment (None: single completions).
    """
    mine = list(examples[dist.rank::dist.world_size])
    device = dist.device
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # [correct, scored, failed]
    first_error = None
    was_training = model.training
    model.eval()
    for start in range(0, len(mine), prompts_per_batch):
        batch = mine[start:start + prompts_per_batch]
        batch_seed = None if seed is None else seed + dist.rank + start
        rollout, columns = _answers(model, tokenizer, batch, sampling, num_samples, batch_seed, episodes, device)
        completions = tokenizer.batch_decode(rollout.tokens, skip_special_tokens=True)
        scored = score_completions([accuracy], batch, completions, [t.numel() for t in rollout.tokens], num_samples,
                                   columns)
        failed = scored.failed[accuracy.name]
        first_error = first_error or scored.first_error[accuracy.name]
        # The reward's own values, not the weighted total: the built-in accuracy reward has weight 0.
        values = scored.per_function[accuracy.name]
        counts += torch.tensor([float(values[~failed].sum()), float((~failed).sum()), float(failed.sum())],
                               dtype=torch.float64, device=device)
    model.train(was_training)
    correct, num_scored, num_failed = all_reduce_sum(counts, dist).tolist()  # host sync: Python numbers out
    return HeldOutAccuracy(correct / num_scored if num_scored else None, int(num_scored), int(num_failed),
                           first_error)


def _answers(model: nn.Module, tokenizer, batch: Sequence[PromptExample], sampling: SamplingConfig, num_samples: int,
             seed: int | None, episodes: EpisodeSampler | None, device: torch.device) -> tuple[Rollout, dict | None]:
    """The answers to ``batch`` and the reward columns they add (the episodes, with an environment)."""
    if episodes is None:
        return generate(model, [e.token_ids.to(device) for e in batch],
                        num_samples=num_samples, sampling=sampling, seed=seed), None
    sampled = episodes.sample(model, tokenizer, batch, num_samples=num_samples, sampling=sampling, seed=seed)
    return Rollout(sampled.rollout.groups, sampled.rollout.stats), {"environments": sampled.episodes}


# The sampled accuracy's seed is train.seed + this: fixed from one evaluation to the next, and apart from
# every training rollout's seed.
SAMPLED_SEED_OFFSET = 7_919


@dataclass(frozen=True)
class HeldOut:
    """What held-out evaluation needs, built once from the config."""

    examples: list[PromptExample]
    """The held-out prompts ([] when the config has none)."""
    accuracy: Reward | None
    """The reward that scores an answer (train.accuracy_reward; None: no evaluation)."""
    greedy: SamplingConfig
    sampling: SamplingConfig
    """The rollout's sampling, for the sampled (pass@1) accuracy."""
    num_samples: int
    """data.num_eval_samples: sampled answers per problem (0: greedy only)."""
    seed: int
    episodes: EpisodeSampler | None = None
    """The run's environment: answers are conversations (None: single completions)."""

    @property
    def enabled(self) -> bool:
        return bool(self.examples) and self.accuracy is not None


def build_held_out(examples: list[PromptExample], accuracy: Reward | None, sampling: SamplingConfig,
                   num_samples: int, seed: int, episodes: EpisodeSampler | None = None) -> HeldOut:
    """The held-out evaluation of ``examples`` (the held-out prompts), scored by ``accuracy``, greedy and, with
    ``num_samples`` (data.num_eval_samples), sampled with ``sampling`` (the run's, ``setup.rollout_sampling``)
    from ``seed`` (train.seed) + SAMPLED_SEED_OFFSET, in conversations with ``episodes``' environment when
    given."""
    return HeldOut(examples, accuracy, dataclasses.replace(sampling, temperature=0.0), sampling, num_samples,
                   seed + SAMPLED_SEED_OFFSET, episodes)


def measure_held_out(held_out: HeldOut, model: nn.Module, tokenizer, dist: DistInfo) -> dict[str, HeldOutAccuracy]:
    """"accuracy" (greedy) and, with num_samples, "sampled_accuracy" of ``model`` now (call under the
    run's precision, with full parameters)."""
    args = (model, tokenizer, held_out.examples, held_out.accuracy)
    measured = {"accuracy": evaluate_accuracy(*args, held_out.greedy, dist, episodes=held_out.episodes)}
    if held_out.num_samples:
        measured["sampled_accuracy"] = evaluate_accuracy(*args, held_out.sampling, dist,
                                                         num_samples=held_out.num_samples, seed=held_out.seed,
                                                         episodes=held_out.episodes)
    return measured


def describe_accuracies(held_out: HeldOut, accuracies: dict[str, float]) -> str:
    """``held-out accuracy greedy 95.0%, sampled 37.5% (4 per problem, temperature 1) on 20 problems``."""
    sampled = (f", sampled {accuracies['sampled_accuracy']:.1%} ({held_out.num_samples} per problem, "
               f"temperature {held_out.sampling.temperature:g})" if "sampled_accuracy" in accuracies else "")
    return f"held-out accuracy greedy {accuracies['accuracy']:.1%}{sampled} on {len(held_out.examples)} problems"
