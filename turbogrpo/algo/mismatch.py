"""How far the sampler is from the trainer: the record phase's mismatch metrics (``mismatch/*``).

Over a step's trained tokens, with the trainer's log-probs at the update's start (the proximal policy) and the
sampler's (the behaviour policy), ``delta = logp_prox - logp_behav`` per token:

    mismatch/k3_kl                  mean of exp(delta) - delta - 1: the k3 estimate of KL(sampler || trainer)
                                    from the sampler's own tokens (verl's rollout_corr/k3_kl)
    mismatch/abs_delta_{mean,p50,p99,max}   |delta| per token (the mean is ``logprob_gap``, in float64)
    mismatch/frac_tokens_masked     share of tokens the off-policy correction gives weight 0, and
    mismatch/frac_sequences_masked  share of sequences with such a token (with the correction on)
    mismatch/frac_tokens_routes_differ  MoE with algo.routing_replay: share of the replayed tokens whose experts the
                                    trainer's routers would choose otherwise in some layer (counted by the update's
                                    replaying forwards, ``train.update``; ``turbogrpo.moe_routes``)

A few reductions over tensors the step has anyway, one row per rank gathered with the staleness metrics
(``train.loop.step_staleness``): sums add, maxima take the largest; the quantiles are each rank's, averaged over
ranks (exact on one process; a pooled quantile would gather every token).

Shape legend: N completions, S the longest one's length, T their tokens laid end to end.
"""

from __future__ import annotations

import torch
from torch import Tensor

from turbogrpo.algo.losses import OFF_POLICY_CORRECTIONS, CorrectionBounds

QUANTILES = (0.5, 0.99)
"""The |delta| quantiles reported (p50, p99)."""


def padded(flat_T: Tensor, lengths: list[int]) -> tuple[Tensor, Tensor]:
    """[N, S] values (0 past each end) and their mask, from the N lengths' values laid end to end in ``flat_T``.
    Built on the device from the host lengths: no copy from the host (a blocking one would sync)."""
    values_NS = torch.nn.utils.rnn.pad_sequence(list(flat_T.split(lengths)), batch_first=True)
    mask_NS = torch.nn.utils.rnn.pad_sequence(list(torch.ones_like(flat_T).split(lengths)), batch_first=True)
    return values_NS, mask_NS


def quantiles_of(values_T: Tensor, qs: tuple[float, ...]) -> Tensor:
    """[len(qs)] quantiles of ``values_T`` with torch.quantile's linear interpolation, by one sort (torch.quantile
    refuses more than 2^24 values); positions and fractions are host numbers, so nothing is copied or synced."""
    sorted_T, last = values_T.sort().values, values_T.numel() - 1
    positions = [q * last for q in qs]
    return torch.stack([sorted_T[int(p)] + (sorted_T[min(int(p) + 1, last)] - sorted_T[int(p)]) * (p - int(p))
                        for p in positions])


def masked_counts(weights_NS: Tensor, mask_NS: Tensor) -> Tensor:
    """[2] tokens of weight 0 and sequences holding one, among the real tokens of ``mask_NS``."""
    masked_NS = (weights_NS.expand_as(mask_NS) == 0) & mask_NS.bool()
    return torch.stack([masked_NS.sum(), masked_NS.any(-1).sum()]).to(torch.float64)


def mismatch_statistics(prox_logps: list[Tensor], behav_logps: list[Tensor], correction: str | None,
                        bounds: CorrectionBounds) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's totals, to be summed (``sums``), averaged (``quantiles``) and maxed (``maxima``) over ranks.

    prox_logps / behav_logps: N ``[S_i]`` log-probs of the step's trained tokens under the trainer at the
    update's start and under the sampler; correction: ``algo.off_policy_correction`` when the correction is on,
    else None (nothing counts as masked); bounds: its bounds. No host sync of its own (the lengths are the
    tensors' shapes; only sampler log-probs held on the CPU are copied over).
    Returns sums ``[6]`` float64 (tokens, sequences with a token, k3 sum, |delta| sum, tokens masked, sequences
    masked), quantiles ``[2]`` (|delta| p50, p99) and maxima ``[1]`` (largest |delta|), all 0 without tokens, on
    prox_logps' device.
    """
    device = prox_logps[0].device if prox_logps else torch.device("cpu")
    lengths = [p.numel() for p in prox_logps]
    if sum(lengths) == 0:
        return tuple(torch.zeros(n, dtype=torch.float64, device=device) for n in (6, 2, 1))
    delta_T = (torch.cat([p.reshape(-1) for p in prox_logps]).detach().to(torch.float64)
               - torch.cat([b.reshape(-1) for b in behav_logps]).to(device, torch.float64))
    abs_delta_T = delta_T.abs()
    masked = torch.zeros(2, dtype=torch.float64, device=device)
    if correction is not None:
        delta_NS, mask_NS = padded(delta_T, lengths)
        masked = masked_counts(OFF_POLICY_CORRECTIONS[correction](delta_NS, mask_NS, bounds)[0], mask_NS)
    counts = [delta_T.new_full((), float(n)) for n in (sum(lengths), sum(n > 0 for n in lengths))]  # fills, no copy
    sums = torch.cat([torch.stack([*counts, (delta_T.exp() - delta_T - 1).sum(), abs_delta_T.sum()]), masked])
    return sums, quantiles_of(abs_delta_T, QUANTILES), abs_delta_T.max()[None]


def mismatch_metrics(sums: list[float], quantiles: list[float], maxima: list[float],
                     corrected: bool) -> dict[str, float]:
    """The step's mismatch/* from the totals over every rank (``mismatch_statistics``' sums, the mean of its
    quantiles and the max of its maxima); the masked shares only with the correction on."""
    num_tokens, num_sequences, k3_sum, abs_sum, tokens_masked, sequences_masked = sums
    per_token, per_sequence = max(num_tokens, 1.0), max(num_sequences, 1.0)
    metrics = {"mismatch/k3_kl": k3_sum / per_token, "mismatch/abs_delta_mean": abs_sum / per_token,
               "mismatch/abs_delta_p50": quantiles[0], "mismatch/abs_delta_p99": quantiles[1],
               "mismatch/abs_delta_max": maxima[0]}
    if corrected:
        metrics["mismatch/frac_tokens_masked"] = tokens_masked / per_token
        metrics["mismatch/frac_sequences_masked"] = sequences_masked / per_sequence
    return metrics
