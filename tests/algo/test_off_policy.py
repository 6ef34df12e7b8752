"""The off-policy correction (decoupled PPO with a capped behaviour weight): exact at k = 0, right by hand at k > 0.

Decoupled PPO: ratio r = pi_theta / pi_prox (clipped), weight w = at_cap(pi_prox / pi_behav) (detached), loss
reduce(-w * min(r A, clip(r) A)). Each hand case below is built so that the usual wrong implementations fail:
the ratio taken against the behaviour policy, the cap applied to the log-weight before the exp, a weight left
with a gradient, a masked token dropped from the denominator.
"""

import dataclasses
import math

import pytest
import torch

from turbogrpo.algo.losses import AUTO_TIS_CAP, LOSSES, OFF_POLICY_CORRECTIONS, LossNormalizer, get_loss
from turbogrpo.algo.staleness import policy_version, staleness_metrics, staleness_statistics
from turbogrpo.batch import Groups
from turbogrpo.config import AlgoConfig

F64 = torch.float64
# Bounds at which every correction mode acts on some of random_batch's units and not on others.
BOUNDS = dict(tis_cap_low=0.35, geometric_mask_low=0.8, geometric_mask_high=1.25, k3_threshold=0.2)


def random_batch(seed=0, B=6, L=5):
    """float64 logps [B, L] (the current policy), prox logps some way off (so ratios clip), ref, advantages, mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2])[:B]
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(F64)
    logps = -torch.rand(B, L, generator=g, dtype=F64)
    prox = logps + 0.4 * torch.randn(B, L, generator=g, dtype=F64)
    ref = logps + 0.3 * torch.randn(B, L, generator=g, dtype=F64)
    advantages = torch.randn(B, generator=g, dtype=F64)
    return logps, prox, ref, advantages, mask


def loss_and_grad(name, logps, old, ref, advantages, mask, settings, behav=None):
    leaf = logps.clone().requires_grad_()
    norm = LossNormalizer.for_batch(mask, max_completion_length=8)
    loss, metrics = LOSSES[name](leaf, old, ref, advantages, mask, norm, settings, rollout_logps=behav)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("first_iteration", [False, True], ids=["prox_given", "prox_is_own_forward"])
@pytest.mark.parametrize("correction", sorted(OFF_POLICY_CORRECTIONS))
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_behaviour_equal_to_proximal_is_the_plain_loss_bit_for_bit(name, correction, first_iteration):
    # k = 0: the sampler is the trainer at the update's start, so every weight is exp(0) = 1 exactly and the
    # corrected loss and its gradient are today's uncorrected ones to the last bit (KL with bias correction on).
    logps, prox, ref, advantages, mask = random_batch()
    old = None if first_iteration else prox
    behav = logps if first_iteration else prox  # the proximal policy's log-probs, whichever it is
    common = dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, kl_bias_correction=True)
    plain_loss, plain_grad, plain_metrics = loss_and_grad(name, logps, old, ref, advantages, mask, AlgoConfig(**common))
    loss, grad, metrics = loss_and_grad(name, logps, old, ref, advantages, mask,
                                        AlgoConfig(**common, **BOUNDS, tis_cap=2.0, off_policy_correction=correction),
                                        behav)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert grad.abs().sum() > 0 and (first_iteration or plain_metrics["clip_ratio/region"] > 0)
    for key in plain_metrics:
        assert torch.equal(metrics[key], plain_metrics[key]), key
    assert metrics[f"{correction}/weight_mean"] == 1.0 and metrics[f"{correction}/frac_capped"] == 0.0


# Two sequences of two tokens, A = [+1, -1], clip range [0.8, 1.28], cap 2, bnpo (token sum / 4 tokens).
# r = pi_theta / pi_prox and w = pi_prox / pi_behav per token:
#   seq 0, A=+1: t0 r=1.0 w=3.0  -> surrogate -1     (grad -A r = -1);  tis w 2, mis w 0 (over the cap)
#                t1 r=1.5 w=0.5  -> -min(1.5, 1.28) = -1.28, clipped high (no grad)
#   seq 1, A=-1: t0 r=0.5 w=1.5  -> -min(-0.5, -0.8) = 0.8, clipped low (no grad)
#                t1 r=1.2 w=1.0  -> 1.2             (grad -A r = 1.2)
# tis: loss (-1*2 - 1.28*0.5 + 0.8*1.5 + 1.2*1) / 4 = -0.06, grad [[-2, 0], [0, 1.2]] / 4
# mis: loss (0 - 0.64 + 1.2 + 1.2) / 4 = 0.44, grad [[0, 0], [0, 1.2]] / 4 (the dropped token stays in the / 4)
# Against the behaviour policy (a wrong ratio r w = [[3, 0.75], [0.75, 1.2]]) the clipping and the loss differ;
# a cap on the log-weight (min(ln 3, 2) = ln 3) leaves t0's weight at 3.
MASK = torch.ones(2, 2, dtype=F64)
ADVANTAGES = torch.tensor([1.0, -1.0], dtype=F64)
PROX = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=F64)
RATIOS = torch.tensor([[1.0, 1.5], [0.5, 1.2]], dtype=F64)
WEIGHTS = torch.tensor([[3.0, 0.5], [1.5, 1.0]], dtype=F64)
THETA = PROX + RATIOS.log()
BEHAV = PROX - WEIGHTS.log()
EXPECTED = {"tis": (-0.06, [[-0.5, 0.0], [0.0, 0.3]], 1.25), "mis": (0.44, [[0.0, 0.0], [0.0, 0.3]], 0.75)}


@pytest.mark.parametrize("correction", sorted(EXPECTED))
def test_stale_tokens_are_clipped_around_the_proximal_policy_and_weighted_by_hand(correction):
    settings = AlgoConfig(epsilon_low=0.2, epsilon_high=0.28, tis_cap=2.0, off_policy_correction=correction)
    loss, grad, metrics = loss_and_grad("bnpo", THETA, PROX, None, ADVANTAGES, MASK, settings, BEHAV)
    expected_loss, expected_grad, weight_mean = EXPECTED[correction]
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics[f"{correction}/weight_mean"], torch.tensor(weight_mean, dtype=F64))
    torch.testing.assert_close(metrics[f"{correction}/frac_capped"], torch.tensor(0.25, dtype=F64))
    # Clipping is judged on r against the proximal policy: one token clipped high, one low.
    torch.testing.assert_close(metrics["clip_ratio/high"], torch.tensor(0.25, dtype=F64))
    torch.testing.assert_close(metrics["clip_ratio/low"], torch.tensor(0.25, dtype=F64))


def test_in_the_first_iteration_the_weight_carries_no_gradient():
    # old_logps None: the proximal policy is the update's own forward, so r = 1 (gradient 1 per token) and
    # w = exp(theta - behav) = [[3, 0.5], [1.5, 1]] read off the same tensor. Detached, each token's gradient is
    # -A w / 4 = [[-2 (capped at 2), -0.5], [1.5, 1]] / 4; a weight left in the graph would double the
    # uncapped ones ([[-0.5, -0.25], [0.75, 0.5]]).
    theta = PROX
    behav = theta - WEIGHTS.log()
    settings = AlgoConfig(tis_cap=2.0, off_policy_correction="tis")
    loss, grad, _ = loss_and_grad("bnpo", theta, None, None, ADVANTAGES, MASK, settings, behav)
    torch.testing.assert_close(loss, torch.tensor((-2.0 - 0.5 + 1.5 + 1.0) / 4, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.125], [0.375, 0.25]], dtype=F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("correction", sorted(OFF_POLICY_CORRECTIONS))
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_corrected_micro_batches_sum_to_the_whole_batch(name, correction):
    logps, prox, ref, advantages, mask = random_batch(seed=3)
    behav = prox - 0.8 * torch.randn(prox.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    settings = AlgoConfig(beta=0.05, **BOUNDS, tis_cap=2.5, off_policy_correction=correction)
    norm = LossNormalizer.for_batch(mask, max_completion_length=8)
    whole = logps.clone().requires_grad_()
    loss, metrics = LOSSES[name](whole, prox, ref, advantages, mask, norm, settings, rollout_logps=behav)
    loss.backward()
    assert 0 < metrics[f"{correction}/frac_capped"] < 1  # some weights pass a bound, some do not
    split = logps.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, _ = LOSSES[name](split[rows], prox[rows], ref[rows], advantages[rows], mask[rows], norm, settings,
                               rollout_logps=behav[rows])
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-12)


def test_an_unknown_correction_is_refused_in_one_line():
    norm = LossNormalizer.for_batch(MASK, 4)
    with pytest.raises(ValueError, match="config key 'algo.off_policy_correction': 'is' is not allowed; expected "
                                         "one of tis, mis"):
        AlgoConfig(tis_cap=2.0, off_policy_correction="is").check("algo")
    with pytest.raises(ValueError, match="tis_cap=2.0 needs rollout_logps"):
        get_loss("grpo")(THETA, PROX, None, ADVANTAGES, MASK, norm, AlgoConfig(tis_cap=2.0))


def test_tis_cap_auto_corrects_exactly_when_the_samplers_log_probs_are_given():
    """A loss called directly with tis_cap "auto" (a run resolves it first) is the cap-2 loss when given the
    sampler's log-probs and the uncorrected one when not."""
    norm = LossNormalizer.for_batch(MASK, 4)
    behav = PROX - WEIGHTS.log()
    auto, fixed, off = (AlgoConfig(tis_cap=cap) for cap in ("auto", AUTO_TIS_CAP, 0))
    with_logps = [get_loss("grpo")(THETA, PROX, None, ADVANTAGES, MASK, norm, s, rollout_logps=behav) for s in (auto, fixed)]
    assert torch.equal(with_logps[0][0], with_logps[1][0]) and with_logps[0][1].keys() == with_logps[1][1].keys()
    without = [get_loss("grpo")(THETA, PROX, None, ADVANTAGES, MASK, norm, s) for s in (auto, off)]
    assert torch.equal(without[0][0], without[1][0]) and "tis/weight_mean" not in without[0][1]
    assert not torch.equal(with_logps[0][0], without[0][0])


def test_the_weight_metrics_average_over_the_tokens_the_update_scores():
    """A step that skips groups (equal rewards) keeps their tokens in the loss's denominators but has no weight
    for them: the mean weight is over the scored tokens (1 exactly when sampler and trainer agree), not diluted."""
    whole = LossNormalizer.for_batch(MASK, 4)
    skipped_half = dataclasses.replace(whole, num_tokens=2 * whole.num_tokens, trained_tokens=whole.num_tokens)
    _, metrics = get_loss("grpo")(THETA, PROX, None, ADVANTAGES, MASK, skipped_half, AlgoConfig(tis_cap=2.0),
                                  rollout_logps=PROX)
    assert metrics["tis/weight_mean"].item() == 1.0 and metrics["tis/frac_capped"].item() == 0.0
    _, diluted = get_loss("grpo")(THETA, PROX, None, ADVANTAGES, MASK, dataclasses.replace(skipped_half,
                                  trained_tokens=None), AlgoConfig(tis_cap=2.0), rollout_logps=PROX)
    assert diluted["tis/weight_mean"].item() == 0.5  # what dividing by every token of the batch would report


# ---- versions and staleness -------------------------------------------------------------------------------


def test_at_version_marks_every_token_and_travels_with_the_groups():
    prompts = [torch.tensor([1, 2]), torch.tensor([3])]
    batch = Groups.from_nested(prompts, [[torch.tensor([4, 5, 6]), torch.tensor([7])], [torch.tensor([8, 9])]])
    assert batch.versions is None
    marked = batch.at_version(6)
    assert [v.tolist() for v in marked.versions] == [[6, 6, 6], [6], [6, 6]]
    assert [v.tolist() for v in marked.select([1]).versions] == [[6, 6]]
    assert [v.tolist() for mb in marked.micro_batches(6) for v in mb.versions] == [[6, 6, 6], [6], [6, 6]]
    assert marked.padded("versions").tolist() == [[6, 6, 6], [6, 0, 0], [6, 6, 0]]
    with pytest.raises(ValueError, match="version must be an integer >= 0"):
        batch.at_version(-1)
    assert policy_version(3, 2) == 6  # step 3 with 2 optimizer steps per rollout samples with version 6


def test_staleness_statistics_by_hand():
    # A partial rollout: completion 0's first token drawn at version 3, the rest at 4; completion 1 at 2.
    # The update starts at version 4: lags [1, 0, 0] and [2, 2] -> mean 1, max 2.
    versions = [torch.tensor([3, 4, 4]), torch.tensor([2, 2])]
    prox = [torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-2.0, -2.0])]
    behav = [prox[0] - torch.tensor([0.0, math.log(3.0), 0.0]), prox[1] - torch.tensor([0.0, math.log(0.5)])]
    sums, maxima = staleness_statistics(versions, 4, prox, behav, cap=2.0)
    metrics = staleness_metrics(sums.tolist(), maxima.tolist(), 2.0)
    # Raw weights [1, 3, 1, 1, 0.5]: mean 6.5 / 5, max 3, one of five over the cap.
    assert metrics == pytest.approx({"staleness/lag_mean": 1.0, "staleness/lag_max": 2.0,
                                     "staleness/weight_mean": 1.3, "staleness/weight_max": 3.0,
                                     "staleness/frac_over_cap": 0.2})
    assert "staleness/frac_over_cap" not in staleness_metrics(sums.tolist(), maxima.tolist(), 0.0)
