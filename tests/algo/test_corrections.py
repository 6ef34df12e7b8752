"""The off-policy correction family: each mode by hand, and each against the trainer it comes from.

A correction turns the log behaviour weight ``log w = logp_prox - logp_behav`` into the weight the policy loss
takes (``turbogrpo.algo.OFF_POLICY_CORRECTIONS``). The golden tests evaluate TRL's, verl's, SkyRL's and slime's
formulas, written out below from their source with a citation, on the same float64 tensors (ragged rows, one
empty, padding holding junk) and require ours to agree to 1e-12 on every completion token.
"""

import inspect
import math

import pytest
import torch

from turbogrpo.algo.losses import (OFF_POLICY_CORRECTIONS, CorrectionBounds, LossNormalizer, get_loss, token_mask,
                                   token_truncate)
from turbogrpo.config import AlgoConfig

F64 = torch.float64
EXACT = dict(rtol=1e-12, atol=1e-12)


def weights_of(mode: str, log_weight_BL, mask_BL, **bounds):
    """Our weight per token [B, L] (a sequence's on each of its tokens) and where the bound acted."""
    weights, past = OFF_POLICY_CORRECTIONS[mode](log_weight_BL, mask_BL, CorrectionBounds(**bounds))
    return weights.expand_as(mask_BL), past.expand_as(mask_BL)


# ---- by hand ------------------------------------------------------------------------------------------------

# Two sequences: w = [3, 0.5] and [2.5, padding]. Products 1.5 and 2.5, geometric means sqrt(1.5) = 1.2247 and
# 2.5, mean k3 (w - 1 - ln w) ((2 - ln 3) + (-0.5 + ln 2)) / 2 = 0.5472 and 1.5 - ln 2.5 = 0.5837.
HAND_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
HAND_LOG_W = torch.tensor([[3.0, 0.5], [2.5, 7.0]], dtype=F64).log()  # 7: junk under the padding
HAND = {  # mode, bounds -> weights on the real tokens (padding: 0 below), bound acted per token
    ("tis", ()): ([[2.0, 0.5], [2.0, 0]], [[1, 0], [1, 0]]),
    ("token_truncate", (("low", 0.6),)): ([[2.0, 0.6], [2.0, 0]], [[1, 1], [1, 0]]),
    ("mis", ()): ([[0.0, 0.5], [0.0, 0]], [[1, 0], [1, 0]]),
    ("token_mask", (("low", 0.6),)): ([[0.0, 0.0], [0.0, 0]], [[1, 1], [1, 0]]),
    ("icepop", (("low", 0.4), ("high", 2.6))): ([[0.0, 0.5], [2.5, 0]], [[1, 0], [0, 0]]),
    ("sequence_truncate", ()): ([[1.5, 1.5], [2.0, 0]], [[0, 0], [1, 0]]),
    ("sequence_truncate", (("low", 1.6), ("high", 3.0))): ([[1.6, 1.6], [2.5, 0]], [[1, 1], [0, 0]]),
    ("sequence_mask", ()): ([[1.5, 1.5], [0.0, 0]], [[0, 0], [1, 0]]),
    ("geometric_mask", (("geometric_low", 0.8), ("geometric_high", 1.25))): ([[1.0, 1.0], [0.0, 0]],
                                                                            [[0, 0], [1, 0]]),
    ("geometric_mask", (("geometric_low", 0.8), ("geometric_high", 1.2))): ([[0.0, 0.0], [0.0, 0]],
                                                                           [[1, 1], [1, 0]]),
    ("k3_reject", (("k3", 0.55),)): ([[1.0, 1.0], [0.0, 0]], [[0, 0], [1, 0]]),
    ("k3_reject", (("k3", 0.5),)): ([[0.0, 0.0], [0.0, 0]], [[1, 1], [1, 0]]),
}


@pytest.mark.parametrize("mode, bounds", list(HAND), ids=[f"{m}-{dict(b)}" for m, b in HAND])
def test_each_mode_by_hand(mode, bounds):
    expected_weights, expected_past = HAND[mode, bounds]
    weights, past = weights_of(mode, HAND_LOG_W, HAND_MASK, **{"high": 2.0, **dict(bounds)})
    torch.testing.assert_close(weights * HAND_MASK, torch.tensor(expected_weights, dtype=F64), **EXACT)
    assert (past & HAND_MASK.bool()).tolist() == [[bool(x) for x in row] for row in expected_past]


def test_every_registered_mode_has_a_hand_case_and_a_one_line_doc():
    assert {mode for mode, _ in HAND} == set(OFF_POLICY_CORRECTIONS)
    for mode, correction in OFF_POLICY_CORRECTIONS.items():
        assert correction.__doc__ and correction.__doc__.strip(), mode


def test_tis_and_mis_are_their_first_formulas_bit_for_bit():
    """The aliases of the first two modes (min(w, cap); w where w <= cap, else 0) give the same bits as those
    formulas, including weights far past the cap and exp underflow, so no run's numbers move."""
    log_w = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(0), dtype=F64) * 3,
                       torch.tensor([-800.0, 0.0, math.log(2.0), 800.0], dtype=F64)])[None]
    mask = torch.ones_like(log_w)
    for dtype in (F64, torch.float32, torch.bfloat16):
        raw = log_w.to(dtype).exp()
        assert OFF_POLICY_CORRECTIONS["tis"] is token_truncate and OFF_POLICY_CORRECTIONS["mis"] is token_mask
        weights, past = token_truncate(log_w.to(dtype), mask, CorrectionBounds(2.0))
        assert torch.equal(weights, raw.clamp(max=2.0)) and torch.equal(past, raw > 2.0)
        weights, past = token_mask(log_w.to(dtype), mask, CorrectionBounds(2.0))
        assert torch.equal(weights, torch.where(raw <= 2.0, raw, torch.zeros_like(raw)))
        assert torch.equal(past, raw > 2.0)


# The hand case of tests/algo/test_off_policy.py (bnpo over 4 tokens, A = [+1, -1], clip [0.8, 1.28]): token
# surrogates [[-1, -1.28], [0.8, 1.2]] (sum -0.28) with gradient [[-1, 0], [0, 1.2]] before any weight, and
# w = [[3, 0.5], [1.5, 1]]: both sequences' products are 1.5.
THETA_PROX_BEHAV = (torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=F64),  # prox
                    torch.tensor([[1.0, 1.5], [0.5, 1.2]], dtype=F64),  # r = pi_theta / pi_prox
                    torch.tensor([[3.0, 0.5], [1.5, 1.0]], dtype=F64))  # w = pi_prox / pi_behav


@pytest.mark.parametrize("cap, expected_loss, expected_grad, capped", [
    (2.0, -0.28 * 1.5 / 4, [[-1.5 / 4, 0.0], [0.0, 1.2 * 1.5 / 4]], 0.0),  # both kept, weighted 1.5
    (1.4, 0.0, [[0.0, 0.0], [0.0, 0.0]], 1.0),                          # both past the cap: nothing learnt
])
def test_a_sequence_mask_weights_the_whole_sequence_in_the_loss_by_hand(cap, expected_loss, expected_grad, capped):
    prox, ratios, weights = THETA_PROX_BEHAV
    theta = (prox + ratios.log()).requires_grad_()
    settings = AlgoConfig(loss="bnpo", tis_cap=cap, off_policy_correction="sequence_mask")
    norm = LossNormalizer.for_batch(torch.ones(2, 2, dtype=F64), 4)
    advantages, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 2, dtype=F64)
    loss, metrics = get_loss("bnpo")(theta, prox, None, advantages, mask, norm, settings,
                                     rollout_logps=prox - weights.log())
    (grad,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(loss.detach(), torch.tensor(expected_loss, dtype=F64), **EXACT)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=F64), **EXACT)
    assert metrics["sequence_mask/frac_capped"].item() == capped


@pytest.mark.parametrize("field, value, message", [
    ("tis_cap_low", 1.5, "config key 'algo.tis_cap_low': 1.5 is not allowed; expected a number in [0, 1]"),
    ("geometric_mask_low", 0.0,
     "config key 'algo.geometric_mask_low': 0.0 is not allowed; expected a number in (0, 1]"),
    ("geometric_mask_high", 0.9, "config key 'algo.geometric_mask_high': 0.9 is not allowed; expected a number >= 1"),
    ("k3_threshold", 0.0, "config key 'algo.k3_threshold': 0.0 is not allowed; expected a number > 0"),
])
def test_a_bad_bound_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        AlgoConfig(**{field: value}).check("algo")


def test_icepop_needs_its_lower_bound():
    with pytest.raises(ValueError, match=r"config key 'algo.tis_cap_low': 0.0 is not allowed; expected a number in "
                                         r"\(0, 1\] with off_policy_correction = 'icepop'"):
        AlgoConfig(off_policy_correction="icepop").check("algo")
    AlgoConfig(off_policy_correction="icepop", tis_cap_low=0.5, tis_cap=5.0).check("algo")


# ---- golden: the same tensors through TRL's, verl's, SkyRL's and slime's formulas ---------------------------

LENGTHS = [7, 1, 0, 3, 5, 2, 6, 4]
# Per-row spread of the sampler's log-probs around the trainer's: from the near-agreement the geometric mask
# and K3 rejection keep to gaps every mode acts on, so that each mode keeps some sequences and drops others.
SPREAD = [0.8, 0.002, 0.05, 0.004, 0.01, 1.2, 0.003, 0.02]


def golden_tensors(seed: int = 0):
    """float64 prox and behav log-probs [8, 7] and their mask; padding holds junk (finite, large)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(7)[None] < torch.tensor(LENGTHS)[:, None]).to(F64)
    prox = -torch.rand(8, 7, generator=g, dtype=F64) * 3
    behav = prox + torch.tensor(SPREAD, dtype=F64)[:, None] * torch.randn(8, 7, generator=g, dtype=F64)
    junk = 9.0 * torch.randn(8, 7, generator=g, dtype=F64)
    return torch.where(mask.bool(), prox, junk), torch.where(mask.bool(), behav, -junk), mask


def trl_importance_sampling_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """TRL 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions ("Compute the
    importance sampling ratio when using vLLM"), inline there so copied here (test_trl_formula_is_still_trls
    checks its lines against the installed TRL): [B, T] for token_*, [B, 1] for sequence_*."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(vllm_importance_sampling_ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
    return vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)


def test_trl_formula_is_still_trls():
    trl = pytest.importorskip("trl", minversion="1.16")
    source = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    for line in ("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
                 "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
                 "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
                 "vllm_importance_sampling_ratio < min_val) | (",
                 "invalid_mis_mask, value=0.0"):
        assert line in source, line


def assert_kept_and_dropped(weights_BL, mask_BL):
    """The golden tensors must exercise the bound: some sequences kept whole, some touched."""
    real = mask_BL.sum(-1) > 0
    untouched = ((weights_BL != 0) | (mask_BL == 0)).all(-1) & real
    assert 0 < untouched.sum() < real.sum()


@pytest.mark.parametrize("clip_min", [None, 0.5])
@pytest.mark.parametrize("clip_max", [2.0, 3.0])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_modes_equal_trls_formula(mode, clip_min, clip_max):
    prox, behav, mask = golden_tensors(seed=2)
    theirs = trl_importance_sampling_ratio(prox, behav, mask, mode, clip_min, clip_max).expand_as(mask)
    ours, _ = weights_of(mode, prox - behav, mask, high=clip_max, low=clip_min or 0.0)
    torch.testing.assert_close(ours * mask, theirs * mask, **EXACT)
    if mode.endswith("mask"):
        assert_kept_and_dropped(ours, mask)


# verl at b178a3cd (2026-01), verl/trainer/ppo/rollout_corr_helper.py, written out: IS weights
# (compute_rollout_correction_weights) and rejection masks (compute_rollout_rejection_mask), with verl's
# masked_sum / masked_mean (verl/utils/torch_functional.py) and its exp(+-20) safety bound. The presets are
# RolloutCorrectionConfig's (verl/trainer/config/algorithm.py).
SAFETY_BOUND = 20.0


def verl_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:  # "sequence": the product of the token ratios
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    return (weights * response_mask).clamp(max=rollout_is_threshold)


def verl_rejection_mask(log_ratio, response_mask, option, lower, upper):
    """seq_sum_k1 / seq_mean_k1 keep log(lower) <= statistic <= log(upper), seq_mean_k3 keeps statistic <= upper."""
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token_k1 = -log_ratio_safe
    token_k3 = torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe
    if option == "seq_sum_k1":
        stat = verl_masked_sum(token_k1, response_mask, axis=-1)
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    elif option == "seq_mean_k1":
        stat = verl_masked_mean(token_k1, response_mask, axis=-1)
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:  # "seq_mean_k3"
        keep = verl_masked_mean(token_k3, response_mask, axis=-1) <= upper
    return response_mask * keep.unsqueeze(-1).expand_as(response_mask).to(log_ratio.dtype)


# verl preset -> its weight per token [B, L], and our mode with the bounds that equal it.
VERL_PRESETS = {
    # token_is(threshold=2.0): token TIS.
    "token_is": (lambda lr, m: verl_is_weights(lr, m, "token", 2.0), "token_truncate", dict(high=2.0)),
    # seq_is(threshold=2.0): sequence TIS.
    "seq_is": (lambda lr, m: verl_is_weights(lr, m, "sequence", 2.0), "sequence_truncate", dict(high=2.0)),
    # seq_is_rs(is_threshold=2.0, rs_threshold="0.5_2.0") (seq-MIS): -sum log r in [log 0.5, log 2] keeps the
    # product in [0.5, 2], where the truncation at 2 does nothing: TRL's sequence_mask on [0.5, 2].
    "seq_is_rs": (lambda lr, m: (verl_is_weights(lr, m, "sequence", 2.0)
                                 * verl_rejection_mask(lr, m, "seq_sum_k1", 0.5, 2.0)),
                  "sequence_mask", dict(low=0.5, high=2.0)),
    # geo_rs(rs_threshold="0.99_1.01"), no IS weight: its bounds are on the geometric mean of pi_behav / pi_prox
    # (k1 = -log r), ours on that of w = pi_prox / pi_behav, so verl's [a, b] is our [1 / b, 1 / a].
    "geo_rs": (lambda lr, m: verl_rejection_mask(lr, m, "seq_mean_k1", 0.99, 1.01), "geometric_mask",
               dict(high=2.0, geometric_low=1 / 1.01, geometric_high=1 / 0.99)),
    # k3_rs(rs_threshold=0.01), no IS weight.
    "k3_rs": (lambda lr, m: verl_rejection_mask(lr, m, "seq_mean_k3", None, 0.01), "k3_reject",
              dict(high=2.0, k3=0.01)),
}


@pytest.mark.parametrize("preset", list(VERL_PRESETS))
def test_verl_presets_equal_verls_formulas(preset):
    verl_weights, mode, bounds = VERL_PRESETS[preset]
    prox, behav, mask = golden_tensors(seed=1)
    theirs = verl_weights(prox - behav, mask)
    ours, _ = weights_of(mode, prox - behav, mask, **bounds)
    torch.testing.assert_close(ours * mask, theirs, **EXACT)
    if mode in ("sequence_mask", "geometric_mask", "k3_reject"):
        assert_kept_and_dropped(ours, mask)


def test_geometric_mask_equals_skyrls():
    """SkyRL (NovaSky-AI/SkyRL, skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py,
    compute_sequence_mask, sequence_mask_metric="geometric", geo_mask_low 0.99, geo_mask_high 1.01)."""
    prox, behav, mask = golden_tensors(seed=2)
    num_tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = ((prox - behav) * mask).sum(dim=-1, keepdim=True)
    geo_mean_ratio = torch.exp((seq_log_ratio / num_tokens).clamp(-20.0, 20.0))
    theirs = (~(geo_mean_ratio > 1.01) & ~(geo_mean_ratio < 0.99)).to(F64).expand_as(mask)
    ours, _ = weights_of("geometric_mask", prox - behav, mask, high=2.0, geometric_low=0.99, geometric_high=1.01)
    torch.testing.assert_close(ours * mask, theirs * mask, **EXACT)
    assert_kept_and_dropped(ours, mask)


def test_icepop_equals_slimes():
    """slime (THUDM/slime, slime/backends/megatron_utils/loss.py, icepop_function with --tis-clip-low 0.5
    --tis-clip 5)."""
    prox, behav, mask = golden_tensors(seed=3)
    behav = prox + 2 * (behav - prox) / torch.tensor(SPREAD, dtype=F64)[:, None]  # gaps wide enough to mask
    ice_ratio = torch.exp(prox - behav)
    theirs = torch.where((ice_ratio >= 0.5) & (ice_ratio <= 5.0), ice_ratio, torch.zeros_like(ice_ratio))
    ours, _ = weights_of("icepop", prox - behav, mask, high=5.0, low=0.5)
    torch.testing.assert_close(ours * mask, theirs * mask, **EXACT)
    assert 0 < ((ours == 0) & mask.bool()).sum() < mask.sum()


@pytest.mark.parametrize("mode", sorted(OFF_POLICY_CORRECTIONS))
def test_junk_under_the_padding_changes_no_weight(mode):
    """float32 junk of +-200 under the padding (exp overflows to inf there) gives every real token the weight it
    gets with 0 there: no inf * 0 = NaN leaks into a sequence's statistic."""
    prox, behav, mask = golden_tensors(seed=4)
    log_w = ((prox - behav) * mask).float()
    signs = torch.sign(torch.randn(mask.shape, generator=torch.Generator().manual_seed(5)))
    junk = torch.where(mask.bool(), log_w, 200.0 * signs)
    bounds = dict(high=2.0, low=0.5)
    clean, _ = weights_of(mode, log_w, mask.float(), **bounds)
    dirty, _ = weights_of(mode, junk, mask.float(), **bounds)
    assert torch.equal(clean * mask.float(), torch.where(mask.bool(), dirty, 0.0))
