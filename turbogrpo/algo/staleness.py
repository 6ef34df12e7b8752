"""Policy versions, and how stale a step's tokens are (the record phase's staleness metrics).

A policy version counts the optimizer steps done: the weights of version v drew a token marked v
(``Groups.versions``). A token's lag is ``prox_version - v``, how many optimizer steps the proximal policy
(the weights at the start of the update, which the clipped ratio is taken against) is ahead of the
weights that drew it. In the on-policy loop (``train.max_staleness = 0``) every lag is 0; with k > 0 a
lag is at most k x algo.num_iterations. The behaviour weight ``exp(prox - behav)`` is the importance weight
the off-policy correction caps (``algo.tis_cap``); it is reported here raw, before any cap, whether the
correction is on or not, so a run shows whether it needs one.

Shape legend: N completions, S_i completion i's length, T the step's tokens (sum of S_i over the tokens kept).
"""

from __future__ import annotations

import torch
from torch import Tensor


def policy_version(step: int, num_iterations: int) -> int:
    """The version of the weights GRPO step ``step`` (steps done before it) samples with in the on-policy
    loop: the optimizer steps of the updates before it, applied or skipped for NaN/inf (so a version is a
    function of the step alone, and a resumed run counts as an uninterrupted one)."""
    return step * num_iterations


def staleness_statistics(versions: list[Tensor], prox_version: int, prox_logps: list[Tensor],
                         behav_logps: list[Tensor], cap: float) -> tuple[Tensor, Tensor]:
    """This rank's totals of the step's tokens, to be summed (``sums``) and maxed (``maxima``) over ranks.

    versions: N ``[S_i]`` int64, the version that drew each token; prox_logps / behav_logps: N ``[S_i]``
    log-probs under the proximal policy (the trainer's, at the update's start) and the behaviour policy
    (the sampler's); cap: algo.tis_cap (0: off, nothing counts as over it).
    Returns sums ``[4]`` float64 (tokens, lag sum, weight sum, tokens whose weight passed the cap) and
    maxima ``[2]`` float64 (largest lag, largest weight; 0 without tokens), on prox_logps' device.
    """
    device = prox_logps[0].device if prox_logps else torch.device("cpu")
    lag_T = (prox_version - torch.cat([v.reshape(-1) for v in versions])).to(device, torch.float64)
    log_weight_T = (torch.cat([p.reshape(-1) for p in prox_logps]).detach().to(torch.float64)
                    - torch.cat([b.reshape(-1) for b in behav_logps]).to(device, torch.float64))
    weight_T = log_weight_T.exp()
    over_cap = (weight_T > cap).sum() if cap else weight_T.new_zeros(())
    sums = torch.stack([weight_T.new_full((), float(weight_T.numel())), lag_T.sum(), weight_T.sum(),
                        over_cap.to(torch.float64)])
    if weight_T.numel() == 0:
        return sums, weight_T.new_zeros(2)
    return sums, torch.stack([lag_T.max(), weight_T.max()])


def staleness_metrics(sums: list[float], maxima: list[float], cap: float) -> dict[str, float]:
    """The step's metrics from the totals over every rank (``staleness_statistics``' sums and maxima):
    staleness/lag_mean, staleness/lag_max (optimizer steps), staleness/weight_mean, staleness/weight_max (the
    raw behaviour weight pi_prox / pi_behav per token), and staleness/frac_over_cap with the correction on."""
    num_tokens, lag_sum, weight_sum, over_cap = sums
    per_token = max(num_tokens, 1.0)
    metrics = {"staleness/lag_mean": lag_sum / per_token, "staleness/lag_max": maxima[0],
               "staleness/weight_mean": weight_sum / per_token, "staleness/weight_max": maxima[1]}
    if cap:
        metrics["staleness/frac_over_cap"] = over_cap / per_token
    return metrics
