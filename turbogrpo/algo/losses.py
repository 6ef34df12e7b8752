"""The GRPO policy-loss family: grpo, dr_grpo, dapo, bnpo, gspo.

Every variant is the same clipped surrogate plus an optional k3 KL penalty to a reference policy:

    r = exp(logp - logp_prox)                       per token, or per sequence for gspo
    policy = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    kl = exp(ref - logp) - (ref - logp) - 1         per token (k3: unbiased, always >= 0), optionally x r
    loss = reduce(w * policy + beta * kl)
    w = correction(logp_prox - logp_behav)          per token or sequence, detached; 1 when tis_cap is 0 (off)

This is decoupled PPO (Hilton et al. 2021, as AReaL trains on stale rollouts): the trust region is taken
around the proximal policy pi_prox (the weights at the start of the update: ``old_logps`` recomputed by the
trainer, or the update's own detached forward when it is the first), while the tokens were drawn by the
behaviour policy pi_behav (the sampler's log-probs, ``rollout_logps``: another engine, bf16 kernels, or
weights some versions old). The weight w moves the expectation from pi_behav to pi_prox; the off-policy
correction (``algo.off_policy_correction``, OFF_POLICY_CORRECTIONS) bounds it, so a rare token the sampler
under-weighted cannot dominate the step: per token ("tis" = token_truncate truncates at the cap, as verl and
slime do; "mis" = token_mask drops tokens past it, AReaL's behav_imp_weight_cap; icepop masks both sides), or
per sequence (sequence_truncate, sequence_mask on the product of its weights, TRL's default for vLLM;
geometric_mask on their geometric mean, SkyRL's; k3_reject on their mean k3, verl's). When the behaviour
policy is the proximal one (the on-policy loop, the native engine) every mode's w is exactly 1 and the loss
is bit for bit the uncorrected one. Why and what each costs: docs/design/async.md.

The variants differ only in two small units, paired by name in LOSSES: the importance ratio's level
(token or sequence) and the reduction (what the summed token losses are divided by).

Micro-batching: a trainer that splits a step's batch into micro-batches passes the SAME LossNormalizer
(totals of the whole step batch) to every micro-batch. Every reduction is then a sum of per-sequence terms
over fixed denominators, so the micro-batch losses, their gradients and their metrics add up exactly to
those of the whole batch in one piece, however the batch is split.

Shape legend: B sequences in the micro-batch, L padded completion length (completion tokens only).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor


class ObjectiveSettings(Protocol):
    """The [algo] settings a policy loss reads. ``turbogrpo.config.AlgoConfig`` (the section itself) has
    them; the losses name only what they read, so that algo/ builds on nothing of config.py (which
    imports ``LOSSES`` to check ``algo.loss``)."""

    loss: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    tis_cap: float | str  # a number, or "auto" (``correction_cap``)
    tis_cap_low: float
    geometric_mask_low: float
    geometric_mask_high: float
    k3_threshold: float
    off_policy_correction: str
    kl_bias_correction: bool

    def check(self, key: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class LossNormalizer:
    """Totals over the whole step batch, which fix every reduction's denominator.

    The step batch is every sequence whose loss one optimizer step sums (on this process), across all its
    micro-batches. Counts may be 0-dim tensors, so building them from a mask needs no host sync.
    Under DDP (which averages gradients over processes) use per-process totals, except
    `generation_tokens_per_step`, which is global (see there): this reproduces TRL's multi-GPU losses.
    """

    num_sequences: Tensor | float
    """Sequences in the step batch (grpo, gspo, dr_grpo)."""
    num_tokens: Tensor | float
    """Completion tokens (ones of the mask) in the step batch (bnpo)."""
    max_completion_length: int
    """The configured generation limit, not the batch's longest completion (dr_grpo's constant)."""
    generation_tokens_per_step: Tensor | float
    """Completion tokens of the whole generation batch over all processes, divided by (processes x optimizer
    steps the generation batch feeds per pass) (dapo). Equals num_tokens on one process with one optimizer
    step per rollout."""
    trained_tokens: Tensor | float | None = None
    """Completion tokens of the sequences the update runs, when it skips some (groups of equal rewards, which
    add nothing to the loss but count in num_tokens): the denominator of the behaviour weights' means, which
    exist only where the trainer scored a token. None: num_tokens (nothing skipped)."""

    @classmethod
    def for_batch(cls, mask: Tensor, max_completion_length: int) -> "LossNormalizer":
        """Totals of `mask` [B, L] (1 on completion tokens): the whole step batch, which is also the whole
        generation batch (one process, one optimizer step per rollout pass)."""
        num_tokens = mask.sum(dtype=torch.float32)
        return cls(mask.shape[0], num_tokens, max_completion_length, num_tokens)


def _at_least_one(count: Tensor | float) -> Tensor | float:
    """An empty batch (all completions masked out) then gives loss 0 rather than 0 / 0."""
    return count.clamp(min=1) if isinstance(count, Tensor) else max(count, 1)


def step_token_mean(values_BL: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
    """This micro-batch's share of the mean of `values` over the step batch's completion tokens."""
    return (values_BL * mask_BL).sum() / _at_least_one(norm.num_tokens)


# ---- importance-ratio levels ---------------------------------------------------------------------------


class RatioLevel(Protocol):
    def log_weights(self, log_ratio_BL: Tensor, mask_BL: Tensor) -> Tensor:
        """Log importance weights: [B, L] per token, or [B, 1] per sequence."""

    def share(self, flags: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
        """Fraction of the step batch's units (tokens or sequences) where bool `flags` (shaped like the
        weights) holds; additive over micro-batches."""


class TokenLevel:
    """One ratio per token (PPO, GRPO)."""

    def log_weights(self, log_ratio_BL: Tensor, mask_BL: Tensor) -> Tensor:
        return log_ratio_BL

    def share(self, flags: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
        return step_token_mean(flags, mask_BL, norm)


class SequenceLevel:
    """GSPO: one ratio per sequence, the exp of its mean token log-ratio (length-normalised, so the ratio
    stays near 1 for long sequences), applied to all of its tokens: a sequence is clipped as a whole.
    The gradient flows through every token's log-prob, as in TRL's importance_sampling_level="sequence"."""

    def log_weights(self, log_ratio_BL: Tensor, mask_BL: Tensor) -> Tensor:
        return (log_ratio_BL * mask_BL).sum(-1, keepdim=True) / mask_BL.sum(-1, keepdim=True).clamp(min=1)

    def share(self, flags: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
        return flags.sum() / _at_least_one(norm.num_sequences)


# ---- reductions: summed token losses / a whole-batch denominator ----------------------------------------

Reduction = Callable[[Tensor, Tensor, LossNormalizer], Tensor]


def sequence_mean(loss_BL: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
    """grpo, gspo: each sequence's token mean, then the mean over sequences. A token of a short sequence
    weighs more than one of a long sequence (the length bias Dr. GRPO and DAPO remove)."""
    per_sequence_B = (loss_BL * mask_BL).sum(-1) / mask_BL.sum(-1).clamp(min=1)
    return per_sequence_B.sum() / _at_least_one(norm.num_sequences)


def over_max_length(loss_BL: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
    """dr_grpo: token sum / (sequences x max_completion_length), a constant, so every token weighs the same."""
    return (loss_BL * mask_BL).sum() / (_at_least_one(norm.num_sequences) * norm.max_completion_length)


def over_step_tokens(loss_BL: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
    """bnpo: token sum / completion tokens of the step batch (a token mean over the step).

    TRL divides by the tokens of each micro-batch instead, so its bnpo changes with the micro-batch split;
    ours does not (micro-batching must not change what is learned). Equal to TRL's with one micro-batch."""
    return (loss_BL * mask_BL).sum() / _at_least_one(norm.num_tokens)


def over_generation_tokens(loss_BL: Tensor, mask_BL: Tensor, norm: LossNormalizer) -> Tensor:
    """dapo: token sum / completion tokens of the whole generation batch (per optimizer step): a token mean
    over the rollout. Same value as bnpo unless a rollout feeds several optimizer steps or processes."""
    return (loss_BL * mask_BL).sum() / _at_least_one(norm.generation_tokens_per_step)


# ---- the loss ------------------------------------------------------------------------------------------


def k3_kl(ref_logps_BL: Tensor, logps_BL: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference) from samples of the policy: >= 0, unbiased."""
    log_ratio_BL = ref_logps_BL - logps_BL
    return log_ratio_BL.exp() - log_ratio_BL - 1


# ---- off-policy corrections: what the behaviour weight pi_prox / pi_behav becomes past its bounds --------
#
# Each correction is one small function of the log behaviour weight ``log w = logp_prox - logp_behav`` [B, L]
# (detached, padding finite) returning the weight the policy loss takes, per token [B, L] or per sequence
# [B, 1], and where its bound acted (bool, same shape): truncated, or masked to 0. A masked token leaves the
# policy loss but not its denominator (TRL's masking; verl also drops it from the denominator). The modes read
# their bounds from CorrectionBounds; the names are TRL's (``vllm_importance_sampling_mode``) where TRL has the
# mode, and the table in docs/design/async.md gives verl's, SkyRL's and slime's.


@dataclasses.dataclass(frozen=True)
class CorrectionBounds:
    """The numbers the corrections compare against (``algo.*``; see turbogrpo.config.AlgoConfig)."""

    high: float
    """algo.tis_cap: the ratio's upper bound (TRL's vllm_importance_sampling_clip_max)."""
    low: float = 0.0
    """algo.tis_cap_low: the ratio's lower bound, 0 for none (TRL's vllm_importance_sampling_clip_min)."""
    geometric_low: float = 0.99
    """algo.geometric_mask_low: the geometric-mean ratio's lower bound (SkyRL's geo_mask_low)."""
    geometric_high: float = 1.01
    """algo.geometric_mask_high: its upper bound (SkyRL's geo_mask_high)."""
    k3: float = 0.01
    """algo.k3_threshold: the largest mean k3 per token a sequence may have (verl's rollout_rs_threshold)."""

    @classmethod
    def of(cls, settings: "ObjectiveSettings", cap: float) -> "CorrectionBounds":
        """The bounds of the [algo] section ``settings`` with its cap resolved to ``cap``."""
        return cls(cap, settings.tis_cap_low, settings.geometric_mask_low, settings.geometric_mask_high,
                   settings.k3_threshold)


Correction = Callable[[Tensor, Tensor, CorrectionBounds], tuple[Tensor, Tensor]]


def _in_bounds(raw: Tensor, low: float, high: float) -> Tensor:
    """``low <= raw <= high``, False for NaN (a NaN weight is masked, never kept)."""
    return (raw <= high) & (raw >= low)


def _sequence_sum(log_weight_BL: Tensor, mask_BL: Tensor) -> Tensor:
    """[B, 1] log of the product of a sequence's token weights (TRL's and verl's sequence ratio)."""
    return (log_weight_BL * mask_BL).sum(-1, keepdim=True)


def token_truncate(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """"tis": each token's ``w`` clamped to [low, cap] (TRL token_truncate, verl token-TIS, slime TIS)."""
    raw_BL = log_weight_BL.exp()
    # No lower clamp when low is 0: w > 0 already, and "tis" stays the one-sided min(w, cap) to the bit.
    return raw_BL.clamp(min=bounds.low or None, max=bounds.high), (raw_BL > bounds.high) | (raw_BL < bounds.low)


def token_mask(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """"mis": ``w`` where low <= w <= cap, else 0 (TRL token_mask, AReaL's behav_imp_weight_cap)."""
    raw_BL = log_weight_BL.exp()
    kept_BL = _in_bounds(raw_BL, bounds.low, bounds.high)
    return torch.where(kept_BL, raw_BL, torch.zeros_like(raw_BL)), ~kept_BL


def icepop(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """IcePop (AReaL, slime): the two-sided token mask, ``w`` in [low, cap] else 0; needs algo.tis_cap_low > 0."""
    return token_mask(log_weight_BL, mask_BL, bounds)


def sequence_truncate(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """[B, 1] the sequence's product of token weights clamped to [low, cap] (TRL sequence_truncate, verl seq-TIS)."""
    return token_truncate(_sequence_sum(log_weight_BL, mask_BL), mask_BL, bounds)


def sequence_mask(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """[B, 1] the sequence's product of token weights where in [low, cap], else 0 (TRL sequence_mask, verl seq-MIS)."""
    return token_mask(_sequence_sum(log_weight_BL, mask_BL), mask_BL, bounds)


def geometric_mask(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """[B, 1] 1 where the geometric mean of the sequence's token weights is in [geometric_low, geometric_high],
    else 0 (SkyRL's geometric sequence mask, verl's geometric rejection): a length-free test, no weighting."""
    geometric_B1 = SequenceLevel().log_weights(log_weight_BL, mask_BL).exp()
    kept_B1 = _in_bounds(geometric_B1, bounds.geometric_low, bounds.geometric_high)
    return kept_B1.to(log_weight_BL.dtype), ~kept_B1


def k3_reject(log_weight_BL: Tensor, mask_BL: Tensor, bounds: CorrectionBounds) -> tuple[Tensor, Tensor]:
    """[B, 1] 1 where the sequence's mean k3 estimate of KL(pi_behav || pi_prox) is at most k3_threshold, else 0
    (verl's K3 rejection, rollout_rs = "seq_mean_k3"): rejects sequences, weights nothing."""
    delta_BL = log_weight_BL * mask_BL  # padding to 0 before the exp: junk there could overflow, and inf * 0 is NaN
    k3_BL = delta_BL.exp() - 1 - delta_BL
    kept_B1 = SequenceLevel().log_weights(k3_BL, mask_BL) <= bounds.k3
    return kept_B1.to(log_weight_BL.dtype), ~kept_B1


# Every off-policy correction, by the name ``algo.off_policy_correction`` takes (on when algo.tis_cap > 0).
# "tis" and "mis" are the first names of token_truncate and token_mask, kept as aliases.
OFF_POLICY_CORRECTIONS: dict[str, Correction] = {
    "tis": token_truncate, "mis": token_mask,
    "token_truncate": token_truncate, "token_mask": token_mask,
    "sequence_truncate": sequence_truncate, "sequence_mask": sequence_mask,
    "geometric_mask": geometric_mask, "icepop": icepop, "k3_reject": k3_reject,
}
# The modes that need a lower bound on the ratio (algo.tis_cap_low > 0): a two-sided mask by definition.
TWO_SIDED_CORRECTIONS = ("icepop",)

AUTO_TIS_CAP = 2.0
"""algo.tis_cap = "auto" where the sampler is not the trainer's own forward: verl's and slime's per-token cap
(TRL 1.16 corrects vLLM rollouts by default too, per sequence, masking past 3)."""


def correction_cap(tis_cap: float | str, rollout_logps: Tensor | None) -> float:
    """The cap a loss applies: ``tis_cap`` itself, or for "auto" ``AUTO_TIS_CAP`` when the sampler's log-probs
    are given and 0 (off) when not. A run resolves "auto" before its first step (on where the sampler is
    another engine or stale weights: ``turbogrpo.config.AlgoConfig.resolved``); this rule serves the losses
    called directly."""
    if tis_cap == "auto":
        return AUTO_TIS_CAP if rollout_logps is not None else 0.0
    return float(tis_cap)


def behaviour_weights(prox_logps_BL: Tensor, behav_logps_BL: Tensor, correction: str, bounds: CorrectionBounds,
                      mask_BL: Tensor, norm: LossNormalizer) -> tuple[Tensor, dict[str, Tensor]]:
    """The weights ``correction(prox - behav)`` [B, L] (a sequence's weight on each of its tokens), detached (the
    weight changes which distribution the tokens count as drawn from; it is no part of what the update moves),
    and their metrics: ``<correction>/weight_mean`` (mean weight per completion token of the step batch) and
    ``<correction>/frac_capped`` (share of tokens where the correction's bound acted: truncated or masked), both
    additive over micro-batches.

    The exp comes first and the cap after: the cap bounds the weight, not the log-ratio."""
    log_weight_BL = (prox_logps_BL - behav_logps_BL).detach()
    weights, past = OFF_POLICY_CORRECTIONS[correction](log_weight_BL, mask_BL, bounds)  # [B, L] or [B, 1]
    weights_BL, past_BL = weights.expand_as(mask_BL), past.expand_as(mask_BL)
    # Over the tokens the update scores: a skipped group's tokens have no weight (not a weight of 0).
    scored = norm if norm.trained_tokens is None else dataclasses.replace(norm, num_tokens=norm.trained_tokens)
    return weights_BL, {f"{correction}/weight_mean": step_token_mean(weights_BL, mask_BL, scored),
                        f"{correction}/frac_capped": step_token_mean(past_BL.to(mask_BL.dtype), mask_BL, scored)}


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A clipped-surrogate policy loss: one ratio level and one reduction."""

    level: RatioLevel
    reduce: Reduction

    def __call__(
        self,
        logps: Tensor,
        old_logps: Tensor | None,
        ref_logps: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        normalizer: LossNormalizer,
        settings: ObjectiveSettings,
        rollout_logps: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch, already divided by the whole step batch's denominator.

        logps: [B, L] float, log-prob of each completion token under the current policy (differentiable).
        old_logps: [B, L] under the proximal policy: the weights at the start of this update (the trainer's
            forward before the first of num_iterations optimizer steps), or None in that first step itself,
            whose own forward is the proximal policy: the ratio is then exactly 1 in value, with the
            gradient of logps.
        ref_logps: [B, L] under the reference policy, or None. Needed when settings.beta > 0; when given
            with beta = 0 the KL is still reported in the metrics but adds nothing to the loss.
        rollout_logps: [B, L] under the behaviour policy, as the sampler computed them while sampling (any
            engine, any policy version); needed when settings.tis_cap > 0 (the off-policy correction); with
            tis_cap "auto", giving them turns the correction on at AUTO_TIS_CAP.
        advantages: [B], one per sequence.
        mask: [B, L], 1 (or True) on real completion tokens, 0 on padding. Padded positions of the log-prob
            tensors must hold finite numbers (0 is fine): they are multiplied by 0, not selected away.
        normalizer: totals of the whole step batch (the same object for each of its micro-batches).
        Returns (loss [], metrics): detached 0-dim tensors, each additive over micro-batches like the loss:
            loss/policy  the reduced clipped surrogate;
            loss/kl      the reduced KL, before beta (loss = loss/policy + beta * loss/kl), if ref_logps;
            kl           mean KL term per completion token of the step batch (k3, times the ratio with
                         kl_bias_correction: an estimate of the current policy's KL from the sampled
                         tokens), if ref_logps;
            clip_ratio/low, clip_ratio/high, clip_ratio/region  share of tokens (sequences for gspo) whose
                         ratio is clipped: below 1 - eps_low with A < 0, above 1 + eps_high with A > 0, either;
            <c>/weight_mean, <c>/frac_capped  (c = settings.off_policy_correction) mean behaviour weight
                         per completion token and share of tokens where the correction's bound acted
                         (truncated or masked), if tis_cap > 0.
        """
        if logps.shape != mask.shape or advantages.shape != logps.shape[:1]:
            raise ValueError(
                f"expected logps and mask [B, L] and advantages [B], got logps {tuple(logps.shape)}, "
                f"mask {tuple(mask.shape)}, advantages {tuple(advantages.shape)}"
            )
        if settings.beta != 0.0 and ref_logps is None:
            raise ValueError(f"beta={settings.beta} needs ref_logps (the reference policy's log-probs)")
        cap = correction_cap(settings.tis_cap, rollout_logps)
        if cap and rollout_logps is None:
            raise ValueError(f"tis_cap={cap} needs rollout_logps (the sampler's log-probs)")
        mask_BL = mask.to(logps.dtype)
        old_logps_BL = logps.detach() if old_logps is None else old_logps
        ratio = self.level.log_weights(logps - old_logps_BL, mask_BL).exp()  # [B, L] or [B, 1]
        advantages_B1 = advantages.unsqueeze(-1)
        clipped_ratio = ratio.clamp(1 - settings.epsilon_low, 1 + settings.epsilon_high)
        policy = -torch.minimum(ratio * advantages_B1, clipped_ratio * advantages_B1).expand_as(mask_BL)
        correction_metrics = {}
        if cap:
            weights_BL, correction_metrics = behaviour_weights(old_logps_BL, rollout_logps,
                                                               settings.off_policy_correction,
                                                               CorrectionBounds.of(settings, cap), mask_BL,
                                                               normalizer)
            policy = policy * weights_BL
        loss = policy_loss = self.reduce(policy, mask_BL, normalizer)

        low = (ratio < 1 - settings.epsilon_low) & (advantages_B1 < 0)
        high = (ratio > 1 + settings.epsilon_high) & (advantages_B1 > 0)
        metrics = {
            "loss/policy": policy_loss.detach(),
            "clip_ratio/low": self.level.share(low, mask_BL, normalizer),
            "clip_ratio/high": self.level.share(high, mask_BL, normalizer),
            "clip_ratio/region": self.level.share(low | high, mask_BL, normalizer),
            **correction_metrics,
        }
        if ref_logps is not None:
            kl_BL = k3_kl(ref_logps, logps)
            if settings.kl_bias_correction:
                kl_BL = kl_BL * ratio  # [B, L] times [B, L] or [B, 1]
            kl_loss = self.reduce(kl_BL, mask_BL, normalizer)
            if settings.beta != 0.0:
                loss = loss + settings.beta * kl_loss
            metrics["loss/kl"] = kl_loss.detach()
            metrics["kl"] = step_token_mean(kl_BL.detach(), mask_BL, normalizer)
        return loss, metrics


# Every policy loss, by the name configs use (TRL's loss_type names; gspo is TRL's loss_type="grpo" with
# importance_sampling_level="sequence").
LOSSES: dict[str, PolicyLoss] = {
    "grpo": PolicyLoss(TokenLevel(), sequence_mean),
    "dr_grpo": PolicyLoss(TokenLevel(), over_max_length),
    "dapo": PolicyLoss(TokenLevel(), over_generation_tokens),
    "bnpo": PolicyLoss(TokenLevel(), over_step_tokens),
    "gspo": PolicyLoss(SequenceLevel(), sequence_mean),
}


def get_loss(name: str) -> PolicyLoss:
    """The policy loss called `name`; ValueError listing the allowed names otherwise."""
    if name not in LOSSES:
        raise ValueError(f"loss {name!r} is unknown; allowed: {sorted(LOSSES)}")
    return LOSSES[name]


def build_loss(algo: ObjectiveSettings) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss ``algo.loss`` with the [algo] section's settings bound (checked first, so a
    section built in Python is validated as one read from a config file):
    ``loss(logps, old_logps, ref_logps, advantages, mask, normalizer, rollout_logps=None)``."""
    algo.check("algo")
    return functools.partial(get_loss(algo.loss), settings=algo)


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Deprecated (kept for one release): the losses take the [algo] section, ``turbogrpo.config.AlgoConfig``,
    which has these fields (the losses read only them) and is checked by the config's rules."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    kl_bias_correction: bool = False
    tis_cap: float = 0.0
    off_policy_correction: str = "tis"
    tis_cap_low: float = 0.0
    geometric_mask_low: float = 0.99
    geometric_mask_high: float = 1.01
    k3_threshold: float = 0.01

    def __post_init__(self):
        warnings.warn("turbogrpo.algo.LossSettings is deprecated; pass turbogrpo.config.AlgoConfig (the [algo] "
                      "section) instead", DeprecationWarning, stacklevel=3)
        if not 0.0 <= self.epsilon_low < 1.0 or self.epsilon_high < 0.0 or self.beta < 0.0 or self.tis_cap < 0.0:
            raise ValueError(f"bad loss settings {self}: need 0 <= epsilon_low < 1 and epsilon_high, beta, "
                             "tis_cap >= 0")
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(f"off_policy_correction {self.off_policy_correction!r} is unknown; allowed: "
                             f"{sorted(OFF_POLICY_CORRECTIONS)}")
