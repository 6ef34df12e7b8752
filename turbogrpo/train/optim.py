"""AdamW and its learning-rate schedule (linear warm-up, then cosine / linear / constant).

The schedule is a pure function of the optimizer-step count, so resuming needs only that count: no
scheduler object, no state to pickle.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from turbogrpo.config import OptimConfig


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (1-D) get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters (with lora.enabled, check lora.target_modules)")
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps)


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# Decay shapes after warm-up: progress in [0, 1] -> multiplier in [0, 1] (rescaled to min_lr_ratio..1).
DECAYS: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def learning_rate(step: int, total_steps: int, config: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(total_steps - config.warmup_steps - 1, 1)
    progress = min((step - config.warmup_steps) / decay_steps, 1.0)
    shape = DECAYS[config.schedule](progress)
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
