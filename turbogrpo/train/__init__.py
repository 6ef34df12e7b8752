"""The GRPO trainer: the loop and the components it calls (update, checkpoints, metrics, distributed)."""
