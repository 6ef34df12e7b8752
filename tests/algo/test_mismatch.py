"""The mismatch metrics (sampler vs trainer) by hand, and the quantiles against torch.quantile."""

import math

import pytest
import torch

from turbogrpo.algo.losses import CorrectionBounds
from turbogrpo.algo.mismatch import QUANTILES, mismatch_metrics, mismatch_statistics, quantiles_of

# Two completions: delta = prox - behav = [0, ln 3, 0] and [0, ln 0.5], so w = [1, 3, 1] and [1, 0.5].
F64 = torch.float64
PROX = [torch.tensor([-1.0, -1.0, -1.0], dtype=F64), torch.tensor([-2.0, -2.0], dtype=F64)]
BEHAV = [PROX[0] - torch.tensor([0.0, math.log(3.0), 0.0], dtype=F64),
         PROX[1] - torch.tensor([0.0, math.log(0.5)], dtype=F64)]
LN3, LN2 = math.log(3.0), math.log(2.0)
# |delta| sorted [0, 0, 0, ln 2, ln 3]: p50 0, p99 at position 0.99 * 4 = 3.96: ln 2 + 0.96 (ln 3 - ln 2).
# k3 = w - ln w - 1: 3 - ln 3 - 1 and 0.5 + ln 2 - 1, the others 0.
BY_HAND = {"mismatch/k3_kl": (2 - LN3 + LN2 - 0.5) / 5, "mismatch/abs_delta_mean": (LN3 + LN2) / 5,
           "mismatch/abs_delta_p50": 0.0, "mismatch/abs_delta_p99": LN2 + 0.96 * (LN3 - LN2),
           "mismatch/abs_delta_max": LN3}


def metrics_of(correction, prox=PROX, behav=BEHAV, **bounds):
    sums, quantiles, maxima = mismatch_statistics(prox, behav, correction, CorrectionBounds(**{"high": 2.0, **bounds}))
    return mismatch_metrics(sums.tolist(), quantiles.tolist(), maxima.tolist(), corrected=correction is not None)


@pytest.mark.parametrize("correction, tokens, sequences", [
    ("tis", 0.0, 0.0),             # truncation masks nothing
    ("token_mask", 0.2, 0.5),      # w = 3 is past the cap: 1 token of 5, in 1 sequence of 2
    ("sequence_mask", 0.6, 0.5),   # products 3 and 0.5: the first sequence (3 tokens) goes
    ("icepop", 0.4, 1.0),          # with low 0.6 the w = 0.5 token goes too
])
def test_mismatch_metrics_by_hand(correction, tokens, sequences):
    bounds = {"low": 0.6} if correction == "icepop" else {}
    metrics = metrics_of(correction, **bounds)
    assert metrics == pytest.approx({**BY_HAND, "mismatch/frac_tokens_masked": tokens,
                                     "mismatch/frac_sequences_masked": sequences}, rel=1e-12, abs=1e-12)


def test_without_the_correction_nothing_counts_as_masked_and_agreement_is_zero():
    assert metrics_of(None) == pytest.approx(BY_HAND, rel=1e-12, abs=1e-12)
    agreeing = metrics_of("sequence_mask", behav=PROX)
    assert agreeing == {"mismatch/k3_kl": 0.0, "mismatch/abs_delta_mean": 0.0, "mismatch/abs_delta_p50": 0.0,
                        "mismatch/abs_delta_p99": 0.0, "mismatch/abs_delta_max": 0.0,
                        "mismatch/frac_tokens_masked": 0.0, "mismatch/frac_sequences_masked": 0.0}


def test_no_tokens_gives_zeros():
    assert metrics_of("tis", prox=[torch.zeros(0)], behav=[torch.zeros(0)])["mismatch/abs_delta_max"] == 0.0
    assert metrics_of("tis", prox=[], behav=[])["mismatch/k3_kl"] == 0.0


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_quantiles_equal_torch_quantile(n):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).abs()
    expected = torch.quantile(values, torch.tensor(QUANTILES, dtype=torch.float64))
    torch.testing.assert_close(quantiles_of(values, QUANTILES), expected, rtol=1e-12, atol=1e-12)
