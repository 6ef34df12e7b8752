"""Held-out accuracy: greedy answers to fixed prompts, scored by the accuracy reward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from turbogrpo.data import PromptExample
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.train.distributed import DistInfo, all_reduce_sum
from turbogrpo.train.setup import Reward, score_rewards


def evaluate_accuracy(model: nn.Module, tokenizer, examples: Sequence[PromptExample], accuracy: Reward,
                      sampling: SamplingConfig, dist: DistInfo, *, num_samples: int = 1, seed: int | None = None,
                      prompts_per_batch: int = 64) -> float:
    """Mean accuracy of ``num_samples`` answers per example (each rank answers a share of the examples).

    Greedy ``sampling`` with one sample gives greedy accuracy; temperature sampling with a fixed
    ``seed`` gives the sampled (pass@1) accuracy, comparable from one evaluation to the next.
    """
    mine = list(examples[dist.rank::dist.world_size])
    device = dist.device
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # [correct, answered]
    was_training = model.training
    model.eval()
    for start in range(0, len(mine), prompts_per_batch):
        batch = mine[start:start + prompts_per_batch]
        rollout = generate(model, [e.token_ids.to(device) for e in batch], num_samples=num_samples,
                           sampling=sampling, seed=None if seed is None else seed + dist.rank + start)
        completions = tokenizer.batch_decode(rollout.tokens, skip_special_tokens=True)
        repeated = [e for e in batch for _ in range(num_samples)]
        scores = score_rewards([accuracy], [e.text for e in repeated], completions,
                               _columns(repeated, rollout.tokens)).total
        counts += torch.tensor([float(scores.sum()), float(len(completions))], dtype=torch.float64, device=device)
    model.train(was_training)
    correct, answered = all_reduce_sum(counts, dist).tolist()  # host sync: the result is a Python number
    return correct / max(answered, 1.0)


def _columns(examples: Sequence[PromptExample], tokens: Sequence[torch.Tensor]) -> dict[str, list]:
    names = examples[0].columns.keys() if examples else ()
    columns = {name: [e.columns.get(name) for e in examples] for name in names}
    columns["completion_lengths"] = [int(t.numel()) for t in tokens]
    return columns
