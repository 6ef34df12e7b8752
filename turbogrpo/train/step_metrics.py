"""A step's metrics over the global batch (every rank's completions), and completion samples to log."""

from __future__ import annotations

import torch

from turbogrpo.data import PromptExample
from turbogrpo.placement import DistInfo
from turbogrpo.rewards import RewardResult
from turbogrpo.rollout import Rollout
from turbogrpo.train import distributed
from turbogrpo.train.update import UpdateResult


def step_metrics(rollout: Rollout, rewards: RewardResult, sampler_logps: list[torch.Tensor],
                 trainer_logps: list[torch.Tensor], updates: list[UpdateResult], seconds: dict[str, float],
                 run, dist: DistInfo) -> dict[str, float]:
    """Reward mean/std (total and per function), accuracy, completion lengths, loss metrics (KL, clip
    fractions, entropy), grad norm, learning rate, phase times, tokens/s and the sampler-vs-trainer
    log-prob gap (over the completions the update ran: ``sampler_logps`` and ``trainer_logps`` align,
    per completion, flat; model tokens only in multi-turn batches). One gather and one host sync for the batch statistics."""
    names = list(rewards.per_function)
    # Completion lengths count sampled tokens (a multi-turn conversation's environment ids are not generated).
    lengths = torch.tensor(rollout.groups.trained_lengths, dtype=torch.float32)
    truncated = torch.tensor([reason == "length" for reason in rollout.finish_reasons], dtype=torch.float32)
    columns_NC = torch.stack([rewards.total, *(rewards.per_function[n] for n in names), lengths, truncated], dim=1)
    all_NC = distributed.all_gather_cat(columns_NC.to(dist.device), dist)
    sampler = torch.cat([t.float() for t in sampler_logps]).to(dist.device)
    trainer = torch.cat([t.detach().float() for t in trainer_logps]).to(dist.device)
    failed = torch.tensor([float(rewards.num_failed[n]) for n in names], device=dist.device)
    sums = distributed.all_reduce_sum(torch.cat([(sampler - trainer).abs().sum()[None],
                                                 torch.tensor([float(sampler.numel())], device=dist.device),
                                                 failed]), dist)
    # Host sync: the step's statistics are fetched together for logging.
    mean, std = all_NC.mean(0).tolist(), all_NC.std(0).tolist()
    num_samples = rollout.num_samples
    group_std = all_NC[:, 0].view(-1, num_samples).std(1)
    lengths_all = all_NC[:, -2]
    sums = sums.tolist()

    metrics = {"reward": mean[0], "reward_std": std[0]}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = mean[1 + i]
        metrics[f"rewards/{name}/std"] = std[1 + i]
        metrics[f"rewards/{name}/num_failed"] = sums[2 + i]
        if rewards.first_error[name] and dist.is_main:  # the whole message: the console shows it cut
            metrics[f"rewards/{name}/first_error"] = rewards.full_error.get(name) or rewards.first_error[name]
    accuracy = run.held_out.accuracy
    if accuracy is not None and accuracy.name in names:
        metrics["accuracy"] = mean[1 + names.index(accuracy.name)]
    metrics["frac_groups_zero_std"] = float((group_std == 0).float().mean())
    metrics.update({"completion_length/mean": mean[-2], "completion_length/min": float(lengths_all.min()),
                    "completion_length/max": float(lengths_all.max()), "completion_length/truncated": mean[-1]})
    for key in updates[0].metrics:
        metrics[key] = sum(u.metrics[key] for u in updates) / len(updates)
    metrics["grad_norm"] = sum(u.grad_norm for u in updates) / len(updates)
    metrics["skipped_steps"] = float(sum(not u.applied for u in updates))
    metrics["skipped_steps_total"] = float(run.state.nonfinite_total)
    metrics["lr"] = run.optimizer.param_groups[0]["lr"]
    metrics["logprob_gap"] = sums[0] / max(sums[1], 1.0)
    step_time = sum(seconds.values())
    for phase, value in seconds.items():
        metrics[f"time/{phase}"] = value
    metrics["time/step"] = step_time
    generated = float(lengths_all.sum())
    metrics["tokens_per_s"] = generated / step_time
    metrics["rollout_tokens_per_s"] = generated / max(seconds.get("rollout", 0.0), 1e-9)
    return metrics


def completion_samples(examples: list[PromptExample], texts: list[str], rewards: RewardResult, num_samples: int,
                       count: int, env_errors: list[str | None] | None = None) -> list[dict]:
    """The first ``count`` completions of this rank with their prompt (its last 300 characters) and rewards;
    ``env_errors``: each conversation's environment failure (multi-turn), kept as ``env_error`` where set."""
    samples = []
    for i, text in enumerate(texts[:count]):
        prompt = examples[i // num_samples].text
        samples.append({"prompt": prompt if len(prompt) <= 300 else "..." + prompt[-300:], "completion": text,
                        "reward": float(rewards.total[i]),
                        "rewards": {n: float(v[i]) for n, v in rewards.per_function.items()}})
        if env_errors is not None and env_errors[i] is not None:
            samples[-1]["env_error"] = env_errors[i]
    return samples
