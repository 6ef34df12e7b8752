import math

import pytest
import torch

from turbogrpo.algo.losses import LOSSES, LossNormalizer, LossSettings, build_loss, get_loss
from turbogrpo.config import AlgoConfig

# Two sequences: 2 real tokens + 1 padding, and 3 real tokens.
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADVANTAGES = torch.tensor([1.0, -1.0])
CLIP_HIGHER = AlgoConfig(epsilon_low=0.2, epsilon_high=0.28)  # ratio kept within [0.8, 1.28]
MAX_LEN = 4  # configured generation limit, longer than this batch's longest completion (3)
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, -0.5, -1.0]])


def with_ratios(ratios):
    """Current log-probs (a leaf) whose ratio to OLD is `ratios`."""
    return (OLD + torch.tensor(ratios).log()).requires_grad_()


def run(name, logps, old, ref=None, settings=CLIP_HIGHER, norm=None):
    norm = norm or LossNormalizer.for_batch(MASK, MAX_LEN)
    loss, metrics = get_loss(name)(logps, old, ref, ADVANTAGES, MASK, norm, settings)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss, metrics, grad


# Token ratios r = [[1.5, 0.5, pad], [1.5, 0.5, 1.0]], A = [+1, -1], clip range [0.8, 1.28]:
#   seq 0, A=+1: r=1.5 -> -min(1.5, 1.28)  = -1.28  clipped high (no gradient)
#                r=0.5 -> -min(0.5, 0.8)   = -0.5   (low ratios are not clipped when A > 0)
#   seq 1, A=-1: r=1.5 -> -min(-1.5, -1.28) = 1.5   (high ratios are not clipped when A < 0)
#                r=0.5 -> -min(-0.5, -0.8)  = 0.8   clipped low (no gradient)
#                r=1.0 -> 1.0
# Token sums: seq 0 = -1.78, seq 1 = 3.3, all = 1.52 over 5 tokens.
# Unclipped d(-r A)/d logp = -A r: seq 0 token 1 -> -0.5; seq 1 token 0 -> 1.5, token 2 -> 1.0.
RATIOS = [[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]]
EXPECTED_LOSS = {
    "grpo": (-1.78 / 2 + 3.3 / 3) / 2,  # mean of per-sequence token means = 0.105
    "dr_grpo": 1.52 / (2 * MAX_LEN),  # / (sequences x max_completion_length) = 0.19
    "bnpo": 1.52 / 5,  # / tokens in the batch = 0.304
    "dapo": 1.52 / 5,  # / tokens in the generation batch (the same batch here)
}
EXPECTED_GRAD = {  # the unclipped gradients above, divided like the loss
    "grpo": [[0.0, -0.5 / 2 / 2, 0.0], [1.5 / 3 / 2, 0.0, 1.0 / 3 / 2]],
    "dr_grpo": [[0.0, -0.5 / 8, 0.0], [1.5 / 8, 0.0, 1.0 / 8]],
    "bnpo": [[0.0, -0.5 / 5, 0.0], [1.5 / 5, 0.0, 1.0 / 5]],
    "dapo": [[0.0, -0.5 / 5, 0.0], [1.5 / 5, 0.0, 1.0 / 5]],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_LOSS))
def test_token_level_clipped_surrogate_by_hand(name):
    loss, metrics, grad = run(name, with_ratios(RATIOS), OLD)
    torch.testing.assert_close(loss, torch.tensor(EXPECTED_LOSS[name]))
    torch.testing.assert_close(grad, torch.tensor(EXPECTED_GRAD[name]))
    torch.testing.assert_close(metrics["loss/policy"], loss.detach())
    # One of 5 tokens clipped low (seq 1 token 1), one clipped high (seq 0 token 0).
    torch.testing.assert_close(metrics["clip_ratio/low"], torch.tensor(0.2))
    torch.testing.assert_close(metrics["clip_ratio/high"], torch.tensor(0.2))
    torch.testing.assert_close(metrics["clip_ratio/region"], torch.tensor(0.4))
    assert "kl" not in metrics


def test_symmetric_clip_clips_more_than_clip_higher():
    # With epsilon_high = 0.2 a ratio of 1.25 (A > 0) is clipped at 1.2; clip-higher (0.28) lets it through.
    ratios = [[1.25, 1.0, 1.0], [1.0, 1.0, 1.0]]
    symmetric = AlgoConfig(epsilon_low=0.2, epsilon_high=0.2)
    loss_sym, metrics_sym, grad_sym = run("dapo", with_ratios(ratios), OLD, settings=symmetric)
    loss_high, metrics_high, grad_high = run("dapo", with_ratios(ratios), OLD)
    # Token sums: symmetric -1.2 - 1 + 3 = 0.8; clip-higher -1.25 - 1 + 3 = 0.75; over 5 tokens.
    torch.testing.assert_close(loss_sym, torch.tensor(0.8 / 5))
    torch.testing.assert_close(loss_high, torch.tensor(0.75 / 5))
    assert grad_sym[0, 0] == 0 and grad_high[0, 0] == pytest.approx(-1.25 / 5)
    torch.testing.assert_close(metrics_sym["clip_ratio/high"], torch.tensor(0.2))
    torch.testing.assert_close(metrics_high["clip_ratio/high"], torch.tensor(0.0))


# k3 KL with d = ref - logp: exp(d) - d - 1 and d/dlogp = 1 - exp(d).
#   d = ln 2 -> 2 - ln 2 - 1 = 0.306853, grad -1;  d = -ln 2 -> 0.5 + ln 2 - 1 = 0.193147, grad 0.5;  d = 0 -> 0, 0.
LN2 = math.log(2.0)
KL_D = torch.tensor([[LN2, 0.0, 0.0], [-LN2, 0.0, LN2]])
KL_TOKENS = [[2 - LN2 - 1, 0.0], [0.5 + LN2 - 1, 0.0, 2 - LN2 - 1]]
KL_GRAD = torch.tensor([[-1.0, 0.0, 0.0], [0.5, 0.0, -1.0]])


def test_k3_kl_added_with_beta_by_hand():
    # old_logps = None: ratio 1, so the policy term per token is -A: seq 0 -> -1 each, seq 1 -> +1 each.
    logps = OLD.clone().requires_grad_()
    ref = OLD + KL_D
    beta = 0.1
    settings = AlgoConfig(beta=beta)
    kl_sum = sum(map(sum, KL_TOKENS))  # 0.806853
    # dapo: policy (-2 + 3) / 5 = 0.2; kl 0.806853 / 5 = 0.161371
    loss, metrics, grad = run("dapo", logps, None, ref, settings)
    torch.testing.assert_close(loss, torch.tensor(0.2 + beta * kl_sum / 5))
    torch.testing.assert_close(metrics["kl"], torch.tensor(kl_sum / 5))
    torch.testing.assert_close(metrics["loss/kl"], torch.tensor(kl_sum / 5))
    torch.testing.assert_close(metrics["loss/policy"], torch.tensor(0.2))
    policy_grad = -ADVANTAGES[:, None] * MASK  # d(-A r)/dlogp at r = 1
    torch.testing.assert_close(grad, (policy_grad + beta * KL_GRAD) / 5)
    # grpo: policy seq means -1 and +1 -> 0; kl seq means 0.306853 / 2 and 0.5 / 3 -> their mean
    loss, metrics, _ = run("grpo", logps, None, ref, settings)
    kl_grpo = (KL_TOKENS[0][0] / 2 + sum(KL_TOKENS[1]) / 3) / 2
    torch.testing.assert_close(loss, torch.tensor(beta * kl_grpo))
    torch.testing.assert_close(metrics["kl"], torch.tensor(kl_sum / 5))  # kl is a token mean for every loss


def test_kl_bias_correction_gives_the_reverse_kl_gradient_on_policy():
    # r * k3 at r = 1 (value 1, d r / d logp = 1): gradient k3 + (1 - exp(d)), which simplifies to -d =
    # logp - ref, the gradient of KL(policy || ref) for a sampled token: -ln 2, 0 / ln 2, 0, -ln 2.
    logps = OLD.clone().requires_grad_()
    beta = 0.1
    settings = AlgoConfig(beta=beta, kl_bias_correction=True)
    loss, metrics, grad = run("dapo", logps, None, OLD + KL_D, settings)
    kl_sum = sum(map(sum, KL_TOKENS))
    torch.testing.assert_close(loss, torch.tensor(0.2 + beta * kl_sum / 5))  # same value as plain k3 at r = 1
    torch.testing.assert_close(metrics["kl"], torch.tensor(kl_sum / 5))
    policy_grad = -ADVANTAGES[:, None] * MASK
    torch.testing.assert_close(grad, (policy_grad + beta * -KL_D * MASK) / 5)


def test_kl_bias_correction_weights_kl_by_the_ratio():
    # Ratios [[1.5, 0.5], [1.5, 0.5, 1.0]] times the k3 values: 1.5 * 0.306853 + 0, 1.5 * 0.193147 + 0 + 0.306853.
    logps = with_ratios(RATIOS)
    settings = AlgoConfig(epsilon_low=0.2, epsilon_high=0.28, beta=0.1, kl_bias_correction=True)
    _, metrics, _ = run("bnpo", logps, OLD, logps.detach() + KL_D, settings)
    weighted = 1.5 * KL_TOKENS[0][0] + 1.5 * KL_TOKENS[1][0] + KL_TOKENS[1][2]
    torch.testing.assert_close(metrics["kl"], torch.tensor(weighted / 5))
    torch.testing.assert_close(metrics["loss/kl"], torch.tensor(weighted / 5))


def test_reference_with_zero_beta_only_reports_kl():
    logps = OLD.clone().requires_grad_()
    loss, metrics, _ = run("dapo", logps, None, OLD + KL_D, AlgoConfig(beta=0.0))
    torch.testing.assert_close(loss, torch.tensor(0.2))
    assert metrics["kl"] > 0


def test_gspo_clips_whole_sequences_by_hand():
    # Mean token log-ratio per sequence: seq 0 (ln 2 + 0) / 2 -> r = sqrt 2 = 1.414 > 1.28 with A = +1:
    # clipped, loss -1.28, no gradient. seq 1 ln 0.9 +- 0.1 around a mean of ln 0.9 -> r = 0.9, A = -1:
    # -min(-0.9, -0.8) = 0.9, unclipped. Loss = (-1.28 + 0.9) / 2 = -0.19.
    # Gradient of seq 1: d r / d logp_t = r / 3 = 0.3 per token, halved by the mean over 2 sequences.
    ln09 = math.log(0.9)
    logps = (OLD + torch.tensor([[LN2, 0.0, 5.0], [ln09 + 0.1, ln09 - 0.1, ln09]])).requires_grad_()
    loss, metrics, grad = run("gspo", logps, OLD)
    torch.testing.assert_close(loss, torch.tensor(-0.19))
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [0.15, 0.15, 0.15]]))
    torch.testing.assert_close(metrics["clip_ratio/high"], torch.tensor(0.5))  # 1 of 2 sequences
    torch.testing.assert_close(metrics["clip_ratio/low"], torch.tensor(0.0))
    torch.testing.assert_close(metrics["clip_ratio/region"], torch.tensor(0.5))


def test_on_policy_gspo_equals_grpo_without_kl():
    # With old = logps the sequence ratio is 1 and its gradient spreads 1/n over n tokens, as grpo's mean does.
    logps = torch.randn(2, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss_gspo, _, grad_gspo = run("gspo", logps, None)
    loss_grpo, _, grad_grpo = run("grpo", logps, None)
    torch.testing.assert_close(loss_gspo, loss_grpo)
    torch.testing.assert_close(grad_gspo, grad_grpo)


def test_dapo_divides_by_generation_tokens_bnpo_by_step_tokens():
    # A rollout of 20 completion tokens feeding 2 optimizer steps: dapo divides every step by 10.
    norm = LossNormalizer(num_sequences=2, num_tokens=5, max_completion_length=MAX_LEN, generation_tokens_per_step=10)
    dapo, _, _ = run("dapo", with_ratios(RATIOS), OLD, norm=norm)
    bnpo, _, _ = run("bnpo", with_ratios(RATIOS), OLD, norm=norm)
    torch.testing.assert_close(dapo, torch.tensor(1.52 / 10))
    torch.testing.assert_close(bnpo, torch.tensor(1.52 / 5))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_fully_masked_sequence_contributes_nothing(name):
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    logps = torch.randn(2, 3, generator=torch.Generator().manual_seed(2)).requires_grad_()
    settings = AlgoConfig(beta=0.1)
    norm = LossNormalizer.for_batch(mask, MAX_LEN)
    ref = torch.zeros(2, 3)
    loss, metrics = LOSSES[name](logps, logps.detach() + 0.3, ref, ADVANTAGES, mask, norm, settings)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(value) for value in metrics.values())
    assert torch.equal(logps.grad[0], torch.zeros(3)) and logps.grad[1, :2].abs().sum() > 0
    # An all-empty batch gives 0, not NaN.
    empty = torch.zeros(2, 3)
    loss, _ = LOSSES[name](logps, None, ref, ADVANTAGES, empty, LossNormalizer.for_batch(empty, MAX_LEN), settings)
    assert loss == 0


def random_batch(B=6, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2])[:B]
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)
    logps = -torch.rand(B, L, generator=g, dtype=torch.float64)
    old = logps + 0.4 * torch.randn(B, L, generator=g, dtype=torch.float64)  # off-policy enough to clip
    ref = logps + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, advantages, mask


@pytest.mark.parametrize("kl_bias_correction", [False, True])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batch_losses_sum_to_the_whole_batch_loss(name, kl_bias_correction):
    logps, old, ref, advantages, mask = random_batch()
    settings = AlgoConfig(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, kl_bias_correction=kl_bias_correction)
    norm = LossNormalizer.for_batch(mask, max_completion_length=8)  # built once, from the whole batch
    whole = logps.clone().requires_grad_()
    loss, metrics = LOSSES[name](whole, old, ref, advantages, mask, norm, settings)
    loss.backward()
    assert metrics["clip_ratio/region"] > 0  # the batch exercises clipping

    split = logps.clone().requires_grad_()
    total_loss, total_metrics = 0.0, dict.fromkeys(metrics, 0.0)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven micro-batches, one holding an empty row
        part, part_metrics = LOSSES[name](
            split[rows], old[rows], ref[rows], advantages[rows], mask[rows], norm, settings
        )
        part.backward()  # gradient accumulation
        total_loss = total_loss + part.detach()
        total_metrics = {key: total_metrics[key] + part_metrics[key] for key in metrics}
    torch.testing.assert_close(total_loss, loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-12)
    for key in metrics:
        torch.testing.assert_close(total_metrics[key], metrics[key], rtol=1e-12, atol=1e-12)


def test_user_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"allowed: \['bnpo', 'dapo', 'dr_grpo', 'grpo', 'gspo'\]"):
        get_loss("ppo")
    with pytest.raises(ValueError, match="config key 'algo.epsilon_low'"):
        build_loss(AlgoConfig(epsilon_low=1.5))
    with pytest.raises(ValueError, match="config key 'algo.beta'"):
        build_loss(AlgoConfig(beta=-0.1))
    norm = LossNormalizer.for_batch(MASK, MAX_LEN)
    with pytest.raises(ValueError, match="ref_logps"):
        get_loss("grpo")(OLD, None, None, ADVANTAGES, MASK, norm, AlgoConfig(beta=0.1))
    with pytest.raises(ValueError, match=r"advantages \[B\]"):
        get_loss("grpo")(OLD, None, None, ADVANTAGES[:1], MASK, norm, AlgoConfig())


def test_bool_mask_gives_the_same_loss():
    norm = LossNormalizer.for_batch(MASK.bool(), MAX_LEN)
    loss, _ = get_loss("grpo")(with_ratios(RATIOS), OLD, None, ADVANTAGES, MASK.bool(), norm, CLIP_HIGHER)
    torch.testing.assert_close(loss, torch.tensor(EXPECTED_LOSS["grpo"]))


# ---- truncated importance sampling (TIS) -----------------------------------------------------------------

# Sampler log-probs ROLLOUT vs the trainer's OLD: weights exp(OLD - ROLLOUT) = [[e^0.5, e^-1, pad], [1, e^2, e^1]],
# capped at 2: [[1.6487, 0.3679, pad], [1, 2 (capped), 2 (capped)]].
ROLLOUT = OLD - torch.tensor([[0.5, -1.0, 0.0], [0.0, 2.0, 1.0]])
TIS_WEIGHTS = torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0], [1.0, 2.0, 2.0]])


def test_tis_weights_each_tokens_policy_loss_by_hand():
    settings = AlgoConfig(epsilon_low=0.2, epsilon_high=0.28, tis_cap=2.0)
    logps = with_ratios(RATIOS)
    norm = LossNormalizer.for_batch(MASK, MAX_LEN)
    loss, metrics = get_loss("bnpo")(logps, OLD, None, ADVANTAGES, MASK, norm, settings, rollout_logps=ROLLOUT)
    (grad,) = torch.autograd.grad(loss, logps)
    # Per-token surrogate (see the table above RATIOS) times the weight, summed over 5 tokens, / 5.
    surrogate = torch.tensor([[-1.28, -0.5, 0.0], [1.5, 0.8, 1.0]])
    torch.testing.assert_close(loss, (surrogate * TIS_WEIGHTS).sum() / 5)
    # The weight scales each unclipped token's gradient and carries none itself (it is detached).
    torch.testing.assert_close(grad, torch.tensor(EXPECTED_GRAD["bnpo"]) * TIS_WEIGHTS * MASK)
    torch.testing.assert_close(metrics["tis/weight_mean"], (TIS_WEIGHTS * MASK).sum() / 5)
    torch.testing.assert_close(metrics["tis/frac_capped"], torch.tensor(2 / 5))  # seq 1 tokens 1 and 2


def test_tis_cap_bounds_every_weight_and_off_is_the_plain_loss():
    norm = LossNormalizer.for_batch(MASK, MAX_LEN)
    far = OLD - 30.0  # a sampler that under-weighted every token by e^30
    for cap in (1.0, 5.0):
        settings = AlgoConfig(tis_cap=cap)
        capped, metrics = get_loss("dapo")(OLD.clone(), OLD, None, ADVANTAGES, MASK, norm, settings, rollout_logps=far)
        plain, _ = get_loss("dapo")(OLD.clone(), OLD, None, ADVANTAGES, MASK, norm, AlgoConfig())
        torch.testing.assert_close(capped, cap * plain)  # every weight is exactly the cap
        torch.testing.assert_close(metrics["tis/frac_capped"], torch.tensor(1.0))
    # On the sampler's own log-probs every weight is 1: the loss is the uncorrected one.
    same, metrics = get_loss("grpo")(OLD.clone(), OLD, None, ADVANTAGES, MASK, norm, AlgoConfig(tis_cap=2.0),
                                     rollout_logps=OLD)
    torch.testing.assert_close(same, get_loss("grpo")(OLD.clone(), OLD, None, ADVANTAGES, MASK, norm,
                                                      AlgoConfig())[0])
    torch.testing.assert_close(metrics["tis/weight_mean"], torch.tensor(1.0))
    with pytest.raises(ValueError, match="tis_cap=2.0 needs rollout_logps"):
        get_loss("grpo")(OLD, OLD, None, ADVANTAGES, MASK, norm, AlgoConfig(tis_cap=2.0))


def test_the_deprecated_loss_settings_still_work_like_the_algo_section():
    with pytest.warns(DeprecationWarning, match="AlgoConfig"):
        old = LossSettings(0.1, 0.3, 0.05, True)
    new = AlgoConfig(epsilon_low=0.1, epsilon_high=0.3, beta=0.05, kl_bias_correction=True)
    logps = with_ratios([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    losses = [run("grpo", logps, OLD, OLD + KL_D, settings)[0] for settings in (old, new)]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="epsilon_low"):
        LossSettings(epsilon_low=1.5)


def test_build_loss_binds_the_sections_settings():
    norm = LossNormalizer.for_batch(MASK, MAX_LEN)
    logps = with_ratios([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    bound, _ = build_loss(AlgoConfig(loss="bnpo", epsilon_high=0.28))(logps, OLD, None, ADVANTAGES, MASK, norm)
    torch.testing.assert_close(bound, get_loss("bnpo")(logps, OLD, None, ADVANTAGES, MASK, norm, CLIP_HIGHER)[0])
