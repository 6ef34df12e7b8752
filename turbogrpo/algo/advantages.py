"""Group-relative advantages: each completion's reward minus its group's mean, optionally divided by a std.

Shape legend: N completions in the batch, K groups (one prompt each). Groups are contiguous runs of the N
completions, in order.
"""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# Added to the std before dividing, so a group whose rewards are all equal (std 0) gets advantage 0, not NaN.
# The same constant as TRL, so advantages match its values.
DEFAULT_EPS = 1e-4


def _unbiased_std(sum_sq: Tensor, counts: Tensor) -> Tensor:
    """sqrt(sum of squared deviations / (n - 1)), as `torch.std`; n = 1 has no spread (sum_sq = 0), so std 0."""
    return (sum_sq / (counts - 1).clamp(min=1)).sqrt()


def _group_std(rewards_N: Tensor, mean_N: Tensor, group_of_N: Tensor, counts_K: Tensor) -> Tensor:
    """Std of each completion's own group."""
    sum_sq_K = torch.zeros_like(counts_K).index_add_(0, group_of_N, (rewards_N - mean_N).square())
    return _unbiased_std(sum_sq_K, counts_K)[group_of_N]


def _batch_std(rewards_N: Tensor, mean_N: Tensor, group_of_N: Tensor, counts_K: Tensor) -> Tensor:
    """Std of all rewards in the batch, about the batch mean (the centring itself stays per group)."""
    sum_sq = (rewards_N - rewards_N.mean()).square().sum()
    # A batch of one has no spread: its sum_sq is 0, so std 0.
    return (sum_sq / max(rewards_N.numel() - 1, 1)).sqrt().expand_as(rewards_N)


def _no_std(rewards_N: Tensor, mean_N: Tensor, group_of_N: Tensor, counts_K: Tensor) -> None:
    """Dr. GRPO: dividing by the std biases learning towards questions that are almost always (un)solved."""
    return None


# How advantages are scaled, by `scale` name. Each returns the std to divide by ([N]), or None to leave
# the centred rewards as they are.
REWARD_SCALES: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor | None]] = {
    "group": _group_std,
    "batch": _batch_std,
    "none": _no_std,
}


def group_advantages(
    rewards: Tensor,
    group_sizes: Sequence[int] | Tensor,
    scale: str = "group",
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """A = (R - mean of R over the group) / (std + eps), with the std picked by `scale`.

    rewards: [N] float, finite (the reward stage replaces failed rewards by its fallback first).
    group_sizes: [K] ints >= 1 summing to N; group k is the next group_sizes[k] entries of `rewards`.
        Sizes may differ between groups. A LongTensor is used as is (no host sync, so not checked).
    scale: "group" (std within the group, unbiased like `torch.std`), "batch" (std of the whole batch) or
        "none" (no division). A group or batch of one has std 0, hence advantage 0.
    Returns [N], same dtype and device as `rewards`.
    """
    centered_N, std_N = _centered_and_std(rewards, group_sizes, scale)
    return centered_N if std_N is None else centered_N / (std_N + eps)


def statistics_are_finite(rewards: Tensor, group_sizes: Sequence[int] | Tensor, scale: str = "group") -> Tensor:
    """Whether the group means and the stds that ``group_advantages`` divides by are finite in the
    rewards' dtype: a 0-dim bool tensor on their device (no host sync).

    Finite rewards can still overflow them (float32 rewards of +-3e38 have an inf std); the advantages
    are then silently 0 or NaN, so callers check this and stop with a message instead.
    """
    centered_N, std_N = _centered_and_std(rewards, group_sizes, scale)
    finite = torch.isfinite(centered_N).all()
    return finite if std_N is None else finite & torch.isfinite(std_N).all()


def _centered_and_std(rewards: Tensor, group_sizes: Sequence[int] | Tensor, scale: str) -> tuple[Tensor, Tensor | None]:
    """(R - group mean [N], the std to divide by [N] or None), as ``group_advantages`` describes."""
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale={scale!r} is not a reward scaling; allowed: {sorted(REWARD_SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not isinstance(group_sizes, Tensor):
        if any(size < 1 for size in group_sizes) or sum(group_sizes) != rewards.numel():
            raise ValueError(
                f"group_sizes must be >= 1 each and sum to len(rewards)={rewards.numel()}, got {list(group_sizes)}"
            )
    sizes_K = torch.as_tensor(group_sizes, dtype=torch.long, device=rewards.device)
    counts_K = sizes_K.to(rewards.dtype)
    # output_size spares the host sync that repeat_interleave would otherwise need to size its result.
    group_of_N = torch.repeat_interleave(
        torch.arange(sizes_K.numel(), device=rewards.device), sizes_K, output_size=rewards.numel()
    )
    sum_K = torch.zeros_like(counts_K).index_add_(0, group_of_N, rewards)
    mean_N = (sum_K / counts_K)[group_of_N]
    return rewards - mean_N, REWARD_SCALES[scale](rewards, mean_N, group_of_N, counts_K)
