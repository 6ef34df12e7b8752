"""The knee profile as vLLM's per-batch-size draft lengths (``engines/vllm_speculation.py``), with
hand-computed values; no vLLM needed (its own schedule parser is checked in test_vllm_speculation.py)."""

import pytest

from turbogrpo.engines.vllm_speculation import (draft_lengths, length_schedule, speculative_settings)
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile

# Flat to 64 tokens, then 1 ms per 5.33 tokens: the knee (twice the 1-token time, 20 ms) is at 64 + 64 * 8/12.
VERIFY = LatencyCurve((1, 64, 128), (0.010, 0.012, 0.024))
DRAFT = LatencyCurve((1, 64, 128), (0.001, 0.001, 0.002))
PROFILE = LatencyProfile("test", VERIFY, DRAFT)


def test_knee_lengths_give_each_sequence_its_share_of_the_knee():
    assert PROFILE.c_peak == 106
    lengths = draft_lengths("knee", PROFILE, 64, max_length=4)
    # N = 106 // B verify tokens each, L = min(N - 1, 4): B <= 21 -> 4, 22-26 -> 3, 27-35 -> 2, 36-53 -> 1, then 0
    assert length_schedule(lengths) == [(1, 21, 4), (22, 26, 3), (27, 35, 2), (36, 53, 1), (54, 64, 0)]


def test_cost_lengths_pick_the_fastest_chain_by_hand():
    # B = 1: a chain of L costs verify(L + 1) (flat: 10 + 2 (L) / 63 ms) + (L + 1) ms of drafting; with a = 0.5
    # it yields (1 - 0.5^(L+1)) / 0.5 tokens: 1/11, 1.5/12.03, 1.75/13.06, 1.875/14.10, 1.9375/15.13 per ms
    # = 0.0909, 0.1247, 0.1340, 0.1330, 0.1281: the best is L = 2.
    assert draft_lengths("cost", PROFILE, 1, max_length=4, acceptance=0.5) == [2]
    # B = 64: verify(64 (L + 1)) grows 12 ms per 64 tokens past the flat part, so no chain pays.
    assert draft_lengths("cost", PROFILE, 64, max_length=4, acceptance=0.5)[-1] == 0
    with pytest.raises(ValueError, match="draft curve"):
        draft_lengths("cost", LatencyProfile("no draft", VERIFY, None), 4)
    with pytest.raises(ValueError, match="must be one of"):
        draft_lengths("fastest", PROFILE, 4)


def test_the_schedule_starts_at_one_and_the_settings_speculate_up_to_its_longest():
    assert length_schedule([2, 2, 1, 1, 1, 0]) == [(1, 2, 2), (3, 5, 1), (6, 6, 0)]
    settings = speculative_settings("/drafts/x", [(1, 2, 2), (3, 5, 1), (6, 6, 0)])
    assert settings == {"method": "eagle", "model": "/drafts/x", "num_speculative_tokens": 2,
                        "num_speculative_tokens_per_batch_size": [[1, 2, 2], [3, 5, 1], [6, 6, 0]]}
    with pytest.raises(ValueError, match="speculation = \"off\""):
        speculative_settings("/drafts/x", [(1, 8, 0)])


def test_a_runs_sizing_policy_gives_the_engines_chain_lengths():
    from turbogrpo.engines.vllm_speculation import sizing_lengths
    from turbogrpo.speculative.sizing import CostSizing, FastGRPOSizing, FixedSizing, MergedSizing
    from turbogrpo.speculative.tree import TreeShape

    assert sizing_lengths(FixedSizing(TreeShape(4, 3, 10)), 4) == [3, 3, 3, 3]
    assert sizing_lengths(FastGRPOSizing(c_peak=8, l_max=3), 6) == [3, 3, 1, 1, 0, 0]  # 8 // B - 1, at most 3
    cost = CostSizing(PROFILE, l_max=4, prior_top1=0.5)  # its first-rank acceptance before any tree: 0.5
    assert sizing_lengths(cost, 1) == draft_lengths("cost", PROFILE, 1, max_length=4, acceptance=0.5) == [2]
    with pytest.raises(ValueError, match="without draft.history"):
        sizing_lengths(MergedSizing(cost, FixedSizing()), 4)
