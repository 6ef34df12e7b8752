"""Advantages and the GRPO policy-loss family."""

from turbogrpo.algo.advantages import REWARD_SCALES, group_advantages, statistics_are_finite
from turbogrpo.algo.losses import (AUTO_TIS_CAP, LOSSES, OFF_POLICY_CORRECTIONS, LossNormalizer, LossSettings, PolicyLoss,
                                   build_loss, get_loss, k3_kl)

__all__ = [
    "AUTO_TIS_CAP",
    "LOSSES",
    "OFF_POLICY_CORRECTIONS",
    "REWARD_SCALES",
    "LossNormalizer",
    "LossSettings",
    "PolicyLoss",
    "build_loss",
    "get_loss",
    "group_advantages",
    "k3_kl",
    "statistics_are_finite",
]
