"""turbogrpo: GRPO training with a shared-prefix training forward and fast rollouts."""

__version__ = "0.1.0"
