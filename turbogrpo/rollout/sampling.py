"""Sampling: the typed config, logit warping, token draws and the sampler's log-probs.

Shared by the plain engine and the speculative decoder, so that both draw from exactly the same
distribution: ``warp_logits`` defines it (temperature, then top-k, then top-p, in Hugging Face's
order), ``sample_tokens`` draws from it, and ``token_logprobs`` gives the log-prob the trainer
recomputes (full-vocabulary ``log_softmax(logits / temperature)``; top-k/top-p only change which
token is drawn, not the stored log-prob).

Shapes: ``V`` vocabulary; ``...`` any leading batch dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from turbogrpo.rollout.attention import merge_dtype


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The one rule for each sampling setting: (name, test, what is allowed). SamplingConfig and the [rollout]
# config section are both checked with it, so a value means the same in Python and in a config file.
SAMPLING_RULES = (
    ("max_new_tokens", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("temperature", lambda v: _number(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    ("top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    ("top_k", lambda v: _integer(v) and v >= 0, "an integer >= 0 (0 = off)"),
    ("stop_strings", lambda v: all(isinstance(t, str) and t for t in v), "a list of non-empty strings"),
)


def sampling_problem(**settings) -> tuple[str, str, Any] | None:
    """(name, what is allowed, value) of the first setting that breaks its rule in SAMPLING_RULES, or None."""
    for name, ok, allowed in SAMPLING_RULES:
        if name in settings and not ok(settings[name]):
            return name, allowed, settings[name]
    return None



def at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits in the dtype the sampler's distribution is computed in: float32 for half-precision and float32
    models, float64 for a float64 one (so its sampler log-probs match its float64 forward)."""
    return logits.to(merge_dtype(logits.dtype))

@dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn and when they stop."""

    max_new_tokens: int
    """Most tokens generated per completion (>= 1); a completion cut here finishes with "length"."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy (argmax), which ignores top_k/top_p."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep only the top_k most likely tokens (ties at the k-th value are kept); 0 turns it off."""
    stop_token_ids: tuple[int, ...] = ()
    """A completion stops after emitting any of these (the stop token is part of the completion)."""
    stop_strings: tuple[str, ...] = ()
    """A completion stops after the token that completes any of these strings (needs `tokenizer`)."""
    tokenizer: Any = field(default=None, compare=False, repr=False)
    """Tokenizer used to read stop_strings; only needed when stop_strings is non-empty."""

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples so the config stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        problem = sampling_problem(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                   top_p=self.top_p, top_k=self.top_k, stop_strings=self.stop_strings)
        if problem is not None:
            name, allowed, value = problem
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings needs `tokenizer` (to read the generated tokens as text); "
                             "pass tokenizer=... or use stop_token_ids")

    @classmethod
    def from_rollout(cls, rollout, stop_token_ids: tuple[int, ...], tokenizer, *,
                     greedy: bool = False) -> SamplingConfig:
        """The sampling of a run's [rollout] section (``config.RolloutConfig``), with the model's stop
        ids and its tokenizer (for stop strings); ``greedy`` for held-out greedy answers."""
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=0.0 if greedy else rollout.temperature,
                   top_p=rollout.top_p, top_k=rollout.top_k, stop_token_ids=stop_token_ids,
                   stop_strings=tuple(rollout.stop_strings), tokenizer=tokenizer if rollout.stop_strings else None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the stored log-probs: the sampling temperature, or 1 when greedy."""
        return 1.0 if self.greedy else float(self.temperature)


def warp_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``logits [..., V]`` -> the logits actually sampled from ``[..., V]``: divided by the temperature,
    then top-k, then top-p; removed tokens are ``-inf``. Greedy configs return the logits unchanged
    (argmax is all that is taken from them).
    """
    if sampling.greedy:
        return logits
    return _truncate(logits / sampling.temperature, sampling)


def _truncate(scaled: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Top-k, then top-p, on temperature-scaled logits."""
    if sampling.top_k:
        k = min(sampling.top_k, scaled.shape[-1])
        kth_largest = torch.topk(scaled, k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if sampling.top_p < 1:
        scaled = _top_p(scaled, sampling.top_p)
    return scaled


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # Ascending sort: a token is dropped when the mass of itself and every less likely token is at
    # most 1 - top_p; the most likely token always stays.
    sorted_logits, order = torch.sort(logits, dim=-1)
    mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_up_to <= 1 - top_p
    drop_sorted[..., -1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig,
                  generator: torch.Generator | None = None, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row: raw ``logits [..., V]`` (this function warps them; pass already-warped
    probabilities to ``draw_from_probs`` instead) -> token ids ``[...]`` (int64).

    Greedy takes the argmax. Otherwise the draw inverts the cumulative distribution at one uniform
    number per row (what ``torch.multinomial`` does), without its host sync and with one random
    number per row rather than one per vocabulary entry. ``uniform [...]``: see ``draw_from_probs``.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = warp_logits(at_least_float32(logits), sampling).softmax(dim=-1)
    return draw_from_probs(probs, generator, uniform)


def draw_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None,
                    uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from ``probs [..., V]`` (non-negative, need not be normalised) -> ``[...]``,
    by inverting the cumulative distribution at one uniform number per row. For callers that already
    hold the warped distribution (e.g. ``warp_logits(...).softmax(-1)``). ``uniform [...]``: the
    numbers in [0, 1) to use (the engine draws them per completion, so that a row's draw does not
    depend on which other rows share its batch); None draws them from ``generator``."""
    if uniform is None:
        uniform = torch.rand(probs.shape[:-1], generator=generator, device=probs.device, dtype=probs.dtype)
    block = _cdf_block(probs.shape[-1])
    # Below 16 rows the two-level search's extra ops cost more than the short cumsums save
    # (bench/decode_ops.py, 4 rows x 49,152: 0.73x with 2 threads, 1.6x with one).
    if block is None or probs.numel() < 16 * probs.shape[-1]:
        return _invert_cdf(probs, uniform=uniform.to(probs.dtype).unsqueeze(-1)).squeeze(-1)
    return _invert_blocked_cdf(probs, uniform.to(probs.dtype), block)


def _cdf_block(vocab_size: int) -> int | None:
    """Block length of the two-level search over ``vocab_size`` entries (the largest power of two up to
    1024 dividing it), or None for small or odd vocabularies (one cumsum then)."""
    if vocab_size < 4096:
        return None
    block = min(1024, vocab_size & -vocab_size)
    return block if block >= 64 else None


def _invert_cdf(probs: torch.Tensor, *, uniform: torch.Tensor | None = None,
                point: torch.Tensor | None = None) -> torch.Tensor:
    """Index ``[..., 1]`` of the first entry of ``cumsum(probs)`` above ``uniform * total``, or above
    ``point`` (both ``[..., 1]``)."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[..., -1:]
    # Strictly below the total, so that some entry exceeds it; the first entry that does is the
    # draw, which never lands on a zero-probability token (its entry equals its predecessor's).
    point = torch.minimum(uniform * total if point is None else point,
                          torch.nextafter(total, torch.zeros_like(total)))
    # Clamped: NaN probabilities (non-finite logits) find no entry and would give V, outside the
    # vocabulary; their NaN log-prob is what reports them (``OutputBuffers.nonfinite``).
    return torch.searchsorted(cumulative, point, right=True).clamp_(max=probs.shape[-1] - 1)


def _invert_blocked_cdf(probs: torch.Tensor, uniform: torch.Tensor, block: int) -> torch.Tensor:
    """``_invert_cdf`` in two levels: the block whose running total first passes the point, then the
    entry inside it. A cumsum over 49,152 entries runs one row element by element (4.5 ms for 64 rows,
    one CPU thread, about 1/25 of a SmolLM2 decoding step); block sums vectorise, and the two short
    cumsums that remain are 1,024 and 48 long (1.2 ms; ``bench/decode_ops.py``: 2.6-2.9x at 64 rows). Sums are grouped differently, so a draw can
    differ from one cumsum's only where two entries' running totals tie to float rounding."""
    lead, vocab = probs.shape[:-1], probs.shape[-1]
    blocks_RNK = probs.reshape(-1, vocab // block, block)
    uniform_R1 = uniform.reshape(-1, 1)
    block_sums_RN = blocks_RNK.sum(dim=-1)
    chosen_R1 = _invert_cdf(block_sums_RN, uniform=uniform_R1)  # a block of positive mass
    running_RN = block_sums_RN.cumsum(dim=-1)
    point_R1 = uniform_R1 * running_RN[:, -1:]
    before_R1 = torch.where(chosen_R1 > 0, running_RN.gather(1, (chosen_R1 - 1).clamp(min=0)),
                            torch.zeros_like(point_R1))
    entries_RK = blocks_RNK.gather(1, chosen_R1[:, :, None].expand(-1, 1, block)).squeeze(1)
    # The point inside the block, kept below the block's own total (its sum rounds differently from
    # the block sums), so the draw is never one of the block's zero-probability entries.
    inside_R1 = _invert_cdf(entries_RK, point=(point_R1 - before_R1).clamp_(min=0))
    return (chosen_R1 * block + inside_R1).view(lead)


def sample_with_logprobs(logits: torch.Tensor, sampling: SamplingConfig,
                         generator: torch.Generator | None = None,
                         uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample_tokens(...), token_logprobs(...))`` with one pass over the ``[..., V]`` logits: the
    engine's per-step hot path, where the vocabulary-sized work is most of the step after the model.
    Same distribution as ``sample_tokens``, and the same draws for a given generator up to rounding.
    ``uniform [...]``: see ``draw_from_probs``.
    """
    scaled = at_least_float32(logits)
    if sampling.logprob_temperature != 1:
        scaled = scaled / sampling.logprob_temperature
    probs_all = scaled.softmax(dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
    elif sampling.top_k or sampling.top_p < 1:
        tokens = draw_from_probs(_truncate(scaled, sampling).softmax(dim=-1), generator, uniform)
    else:
        tokens = draw_from_probs(probs_all, generator, uniform)
    # log(p) of the drawn token rather than a log_softmax pass over the vocabulary: the same value to
    # float32 rounding for any token that can be drawn (p far above the float32 underflow at 1e-38).
    return tokens, probs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Sampler log-probs ``[...]`` (float32) of ``tokens [...]`` under ``logits [..., V]``:
    ``log_softmax(logits / T)`` over the full vocabulary, with ``T = 1`` when greedy, which is what
    the trainer computes for the same tokens.
    """
    scaled = at_least_float32(logits) / sampling.logprob_temperature
    return scaled.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
