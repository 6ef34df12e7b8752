"""Temporary stand-in for ``turbogrpo.rollout.sampling`` until the rollout engine lands in git.

Same contract as the engine's: ``warp_logits(logits[..., V], sampling) -> [..., V]`` applies
temperature, then top-k, then top-p, masking dropped tokens to -inf; ``sample_tokens`` draws one
token per row (argmax when ``sampling.temperature == 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()


def warp_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    if sampling.temperature == 0:
        return logits
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(warped: torch.Tensor, sampling: SamplingConfig,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    if sampling.temperature == 0:
        return warped.argmax(-1)
    probs = warped.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)
