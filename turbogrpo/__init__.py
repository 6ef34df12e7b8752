"""turbogrpo: GRPO training with a shared-prefix training forward and fast rollouts."""

from turbogrpo.prefix import completion_logprobs

__version__ = "0.1.0"
__all__ = ["completion_logprobs"]
