"""Latency curves, the knee, and the profile cache."""

import json

import pytest
import torch

from tests.speculative.speculative_helpers import tiny_policy
from turbogrpo.speculative import profiler
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.profiler import LatencyCurve, cached_profile, profile_key, profile_latency


def test_curve_interpolates_extrapolates_and_finds_the_knee():
    curve = LatencyCurve((1, 2, 4, 8, 16, 32), (1.0, 1.0, 1.0, 1.0, 2.0, 4.0))
    assert curve(3) == 1.0 and curve(12) == 1.5 and curve(64) == 8.0
    assert curve.at(torch.tensor([0.5, 3.0, 12.0, 64.0])).tolist() == [1.0, 1.0, 1.5, 8.0]
    assert curve.knee() == 16                    # twice the one-token latency
    assert LatencyCurve((1, 2, 4, 8), (1.0, 1.2, 1.5, 3.0)).knee() == 5
    assert LatencyCurve((1, 2), (1.0, 1.0)).knee() == 2


def test_profile_measures_monotone_curves_for_policy_and_draft():
    model = tiny_policy()
    result = profile_latency(model, context_length=12, draft=DraftHead(model), max_tokens=16, repeats=1)
    assert result.verify.num_tokens == (1, 2, 4, 8, 16) and result.draft.num_tokens == (1, 2, 4, 8, 16)
    for curve in (result.verify, result.draft):
        assert all(a <= b for a, b in zip(curve.seconds, curve.seconds[1:])) and curve.seconds[0] > 0
    assert 1 <= result.c_peak <= 16


def test_the_verify_curve_times_the_engines_own_step(monkeypatch):
    """Each point times the rollout engine's plain step with n live rows, as a rollout runs it."""
    from turbogrpo.rollout.step import PlainStep

    rows_seen = []
    step_call = PlainStep.__call__

    def counting(self, state):
        rows_seen.append(state.next_B.shape[0])
        step_call(self, state)

    monkeypatch.setattr(PlainStep, "__call__", counting)
    profile_latency(tiny_policy(), context_length=12, max_tokens=8, repeats=2)
    assert rows_seen == [8] * 3 + [4] * 3 + [2] * 3 + [1] * 3  # warm-up + 2 repeats, largest first


def test_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    model = tiny_policy()
    path = tmp_path / "profiles.json"
    first = cached_profile(model, context_length=12, path=path, max_tokens=4, repeats=1)
    stored = json.loads(path.read_text())
    assert list(stored) == [first.key] and "float32" in first.key and "ctx16" in first.key

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached profile was measured again")
    monkeypatch.setattr(profiler, "profile_latency", no_measuring)
    assert cached_profile(model, context_length=15, path=path) == first       # same power-of-two bucket
    assert profile_key(model, context_length=40) != first.key
    assert profile_key(model, context_length=12, draft=DraftHead(model)) != first.key
    assert profile_key(tiny_policy(hidden_size=48), context_length=12) != first.key


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="context_length"):
        profile_latency(tiny_policy(), context_length=0)
