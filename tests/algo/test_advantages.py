import math

import pytest
import torch

from turbogrpo.algo.advantages import DEFAULT_EPS, REWARD_SCALES, group_advantages

EPS = DEFAULT_EPS

# Rewards chosen so every std is a round number:
#   group 0 = [2, 0]:    mean 1, centred [1, -1],    unbiased var (1 + 1) / 1 = 2, std sqrt(2)
#   group 1 = [2, 0, 1]: mean 1, centred [1, -1, 0], unbiased var (1 + 1 + 0) / 2 = 1, std 1
#   batch: mean 5 / 5 = 1, deviations [1, -1, 1, -1, 0], unbiased var 4 / 4 = 1, std 1
REWARDS = torch.tensor([2.0, 0.0, 2.0, 0.0, 1.0])
SIZES = [2, 3]
CENTRED = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])


def test_group_scale_divides_by_each_groups_unbiased_std():
    s2 = math.sqrt(2.0) + EPS
    expected = torch.tensor([1 / s2, -1 / s2, 1 / (1 + EPS), -1 / (1 + EPS), 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, SIZES, "group"), expected)


def test_batch_scale_centres_per_group_but_divides_by_the_batch_std():
    torch.testing.assert_close(group_advantages(REWARDS, SIZES, "batch"), CENTRED / (1 + EPS))


def test_none_scale_only_centres():
    torch.testing.assert_close(group_advantages(REWARDS, SIZES, "none"), CENTRED)


def test_group_scale_matches_torch_std_on_random_groups():
    rewards = torch.randn(4 * 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grouped = rewards.view(4, 8)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + EPS)
    torch.testing.assert_close(group_advantages(rewards, [8] * 4, "group"), expected.flatten())


@pytest.mark.parametrize("scale", sorted(REWARD_SCALES))
def test_groups_of_one_give_zero_not_nan(scale):
    # A single completion has nothing to be compared with: its reward is its own mean, so A = 0.
    advantages = group_advantages(torch.tensor([3.0, -1.0, 0.5]), [1, 1, 1], scale)
    torch.testing.assert_close(advantages, torch.zeros(3))
    assert torch.equal(group_advantages(torch.tensor([3.0]), [1], scale), torch.zeros(1))


def test_group_with_equal_rewards_gets_zero_advantage():
    # std 0: 0 / (0 + eps) = 0; the other group is unaffected.
    advantages = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), [3, 2], "group")
    s2 = math.sqrt(0.5) + EPS  # group [0, 1]: mean 0.5, var (0.25 + 0.25) / 1
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.0, 0.0, -0.5 / s2, 0.5 / s2]))


def test_group_sizes_as_long_tensor_and_dtype_kept():
    rewards = REWARDS.double()
    from_tensor = group_advantages(rewards, torch.tensor(SIZES), "group")
    assert from_tensor.dtype == torch.float64
    torch.testing.assert_close(from_tensor, group_advantages(rewards, SIZES, "group"))


def test_user_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"allowed: \['batch', 'group', 'none'\]"):
        group_advantages(REWARDS, SIZES, "rank")
    with pytest.raises(ValueError, match="sum to len"):
        group_advantages(REWARDS, [2, 2], "group")
    with pytest.raises(ValueError, match=">= 1"):
        group_advantages(REWARDS, [5, 0], "group")
