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


@pytest.mark.parametrize("content, found", [
    ("[]", "a JSON list"), ("{not json", "not JSON"), ('"text"', "a JSON str"), ("", "not JSON")])
def test_a_damaged_profile_file_is_named_and_rebuilt(tmp_path, content, found):
    path = tmp_path / "profiles.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match=rf"latency profile file {path} is damaged \({found}"):
        profile = cached_profile(tiny_policy(), context_length=12, path=path, max_tokens=2, repeats=1)
    assert list(json.loads(path.read_text())) == [profile.key]  # rewritten whole


@pytest.mark.parametrize("entry", [[], {"key": "k"}, {"key": "k", "verify": {"num_tokens": [1, 2], "seconds": [1]}},
                                   {"key": "k", "verify": {"num_tokens": [2, 1], "seconds": [0.1, 0.2]}},
                                   {"key": "k", "verify": {"num_tokens": [1], "seconds": ["fast"]}}])
def test_a_damaged_profile_entry_is_measured_again(tmp_path, entry):
    model = tiny_policy()
    path = tmp_path / "profiles.json"
    key = profiler.profile_key(model, context_length=12)
    path.write_text(json.dumps({key: entry, "other": entry}))
    with pytest.warns(UserWarning, match=r"2 damaged entries .* measured again and rewritten"):
        profile = cached_profile(model, context_length=12, path=path, max_tokens=2, repeats=1)
    assert profile.key == key and list(json.loads(path.read_text())) == [key]


def test_an_unwritable_profile_cache_costs_only_measuring_again(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match=r"could not store the latency profile in .*; it is measured again next time"):
        profile = cached_profile(tiny_policy(), context_length=12, path=blocker / "profiles.json", max_tokens=2,
                                 repeats=1)
    assert profile.verify.num_tokens == (1, 2)


def test_profile_sizes_are_bounded_by_the_models_positions_and_the_memory(monkeypatch):
    model = tiny_policy()
    positions = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"--context-length = {positions} is past this model's positions: it attends "
                                         rf"over at most {positions}, and profiling adds \d+ tokens; use at most"):
        profiler.check_profile_size(model, context_length=positions, max_tokens=4,
                                    keys=("--context-length", "--max-tokens"))
    monkeypatch.setattr(profiler, "free_memory_bytes", lambda model: 64 << 20)  # a 64 MiB machine
    with pytest.raises(ValueError, match=r"--max-tokens = 1000000 with --context-length = 16 needs about [\d.]+ GiB on "
                                         r"cpu, which has 0.1 GiB free; use --max-tokens \d+ or less"):
        profiler.check_profile_size(model, context_length=16, max_tokens=1_000_000,
                                    keys=("--context-length", "--max-tokens"))
    profiler.check_profile_size(model, context_length=16, max_tokens=512)  # the default fits
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        profiler.check_profile_size(model, context_length=16, max_tokens=0)


def test_the_memory_estimate_covers_what_a_profile_allocates():
    """The estimate is an upper bound: the peak of the tensors a real profile holds stays below it."""
    model = tiny_policy()
    from turbogrpo.rollout import decode as engine
    sizes = []
    real = engine.GroupedKVCache

    def spy(*args, **kwargs):
        cache = real(*args, **kwargs)
        sizes.append(cache)
        return cache

    import unittest.mock
    with unittest.mock.patch.object(engine, "GroupedKVCache", spy):
        profile_latency(model, context_length=16, max_tokens=64, repeats=1)
    cache = sizes[0]
    held = sum(t.numel() * t.element_size() for t in vars(cache).values() if isinstance(t, torch.Tensor))
    held += sum(t.numel() * t.element_size() for v in vars(cache).values() if isinstance(v, list)
                for t in v if isinstance(t, torch.Tensor))
    num_steps = len(profiler._grid(64)) * 2 + 2
    assert 0 < held <= profiler.profile_memory_bytes(model, 16, 64, num_steps)
