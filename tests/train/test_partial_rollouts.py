"""Partial rollouts (train.partial_rollouts = c): a rollout stops once its step's batch is whole, the generations
still running continue in the next step with newer weights, each token keeping the version and the sampler's
log-prob that drew it, and no token lags more than train.max_staleness updates."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.rollout.conftest import build_model, random_prompts
from turbogrpo import completion_logprobs
from turbogrpo.config import load_config
from turbogrpo.data import PromptExample
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.engines.native import NativeEngine
from turbogrpo.train import loop
from turbogrpo.train.worker.partial_rollouts import PartialRollouts, pool_state, restore_pool

from .test_async import ASYNC, restore_threads, stepped  # noqa: F401 (a fixture)
from .test_multiturn_run import comparable, final_weights, interrupted_at

REPO = Path(__file__).resolve().parents[2]
STOPS = list(range(8))
"""Stop ids of the random test model: about one token in eight stops, so lengths spread up to the limit."""


def examples(lengths, seed: int = 0) -> list[PromptExample]:
    return [PromptExample(f"p{i}", p, index=i) for i, p in enumerate(random_prompts(lengths, seed=seed))]


def segments(model, sampling, pool: PartialRollouts, starts: list[list[PromptExample]], num_groups: int,
             change_weights=None) -> list:
    """One segment per entry of ``starts`` (version = its index), ``change_weights(model, index)`` before each but
    the first; returns each segment's (batch, examples)."""
    engine, batches = NativeEngine(None), []
    for index, new in enumerate(starts):
        if index and change_weights is not None:
            change_weights(model, index)
        batches.append(pool.segment(engine, model, sampling, index=index, examples=new, num_groups=num_groups,
                                    seed=100 + index, version=index))
    return batches


def perturb(model, index):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(index)) * 0.05)


def test_carried_tokens_keep_their_versions_and_the_sampler_log_probs_of_the_weights_that_drew_them():
    model = build_model("qwen2", seed=3)
    sampling = SamplingConfig(max_new_tokens=16, stop_token_ids=STOPS)
    pool = PartialRollouts(num_members=4, max_new_tokens=16, max_carries=1)
    new = examples([5, 7, 6, 9, 4, 8])
    (first, _), (second, taken) = segments(model, sampling, pool, [new[:4], new[4:]], 2, perturb)
    # Segment 0 stopped with 2 whole groups of 4; the 2 others were carried, some members unfinished.
    assert first.groups.num_groups == 2 and len(taken) == 2
    # Segment 1: the carried groups (started one segment ago, c = 1) had to be finished and are its batch.
    assert {e.index for e in taken} <= {0, 1, 2, 3} and [g.started for g in pool.pool] == [1, 1]
    versions = second.groups.versions
    mixed = [v for v in versions if v.min() == 0 and v.max() == 1]
    assert mixed, "no generation continued across the weight change"
    assert all(v.tolist() == sorted(v.tolist()) for v in versions)  # older tokens first, then newer
    # Each token's sampler log-prob is the log-prob of the weights that drew it (teacher-forced forward).
    model_v0 = build_model("qwen2", seed=3)
    model_v1 = copy.deepcopy(model_v0)
    perturb(model_v1, 1)
    groups = second.groups
    with torch.no_grad():
        logps = {v: [t for g in completion_logprobs(m, groups.prompts, groups.nested()) for t in g]
                 for v, m in ((0, model_v0), (1, model_v1))}
    for i, (sampler, version) in enumerate(zip(groups.sampler_logps, versions)):
        expected = torch.where(version == 0, logps[0][i], logps[1][i])
        torch.testing.assert_close(sampler, expected.to(sampler.dtype), atol=1e-5, rtol=0)
    # The behaviour of version 0 is not that of version 1 there (the check above can tell them apart).
    assert any((logps[0][i] - logps[1][i]).abs().max() > 1e-3 for i in range(len(versions)))


def test_a_carried_completion_continued_with_the_same_weights_equals_one_drawn_in_one_go():
    model = build_model("qwen2", seed=3)
    greedy = SamplingConfig(max_new_tokens=16, temperature=0.0, stop_token_ids=STOPS)
    pool = PartialRollouts(num_members=2, max_new_tokens=16, max_carries=2)
    new = examples([5, 7, 6, 9, 4, 8, 3, 10], seed=1)
    starts = [new[:4], new[4:6], new[6:], []]
    carried_unfinished = []
    engine, batches = NativeEngine(None), []
    for index, start in enumerate(starts):
        batches.append(pool.segment(engine, model, greedy, index=index, examples=start, num_groups=2, seed=index,
                                    version=index))
        carried_unfinished += [g.example.index for g in pool.pool if not g.whole]
    assert carried_unfinished, "nothing was carried unfinished"
    trained = [(e, c) for rollout, taken in batches for e, group in zip(taken, rollout.groups.nested()) for c in group]
    assert sorted({e.index for e, _ in trained}) == list(range(8))  # every group trained exactly once
    assert len(trained) == 16
    for example, completion in trained:
        one_go = generate(model, [example.token_ids], num_samples=1, sampling=greedy).tokens[0]
        assert completion.tolist() == one_go.tolist(), example.index


def test_no_group_is_trained_more_than_c_steps_after_the_one_that_started_it():
    model = build_model("qwen2", seed=5)
    sampling = SamplingConfig(max_new_tokens=16, stop_token_ids=STOPS[:3])  # long tails
    for carries in (1, 2):
        pool = PartialRollouts(num_members=4, max_new_tokens=16, max_carries=carries)
        new = examples([5, 7, 6, 9, 4, 8, 3, 10, 6, 5], seed=carries)
        starts = [new[:4], new[4:6], new[6:8], new[8:], []]
        started = {}
        for index, start in enumerate(starts):
            started.update({e.index: index for e in start})
            rollout, taken = pool.segment(NativeEngine(None), model, sampling, index=index, examples=start,
                                          num_groups=2, seed=index, version=index)
            assert len(taken) == 2
            assert all(index - started[e.index] <= carries for e in taken)
            # Versions are segment indices here: the oldest token of the batch is at most c segments old.
            assert min(int(v.min()) for v in rollout.groups.versions) >= index - carries
        assert not pool.pool


def test_the_pool_round_trips_through_a_checkpoints_tensors():
    model = build_model("qwen2", seed=3)
    pool = PartialRollouts(num_members=3, max_new_tokens=16, max_carries=1)
    new = examples([5, 7, 6, 9])
    pool.segment(NativeEngine(None), model, SamplingConfig(max_new_tokens=16, stop_token_ids=STOPS), index=0,
                 examples=new, num_groups=2, seed=0, version=0)
    tensors, scalars = pool_state(pool.pool)
    back = restore_pool(tensors, scalars, list(reversed(new)))
    assert [g.example.index for g in back] == [g.example.index for g in pool.pool]
    for a, b in zip(back, pool.pool):
        assert a.reasons == b.reasons and a.started == b.started
        for name in ("tokens", "logps", "versions"):
            assert all(torch.equal(x, y) for x, y in zip(getattr(a, name), getattr(b, name)))
    with pytest.raises(ValueError, match="prompt row"):
        restore_pool(tensors, scalars, new[:1])
    # A pool cut short (one member's log-probs gone, or a group's fields) is refused in one line, not a KeyError.
    cut = {k: v for k, v in tensors.items() if k != "carried/0/1/logps"}
    with pytest.raises(ValueError, match="lack carried/0/1/logps"):
        restore_pool(cut, scalars, new)
    with pytest.raises(ValueError, match="group 0 lacks reasons"):
        restore_pool(tensors, [{k: v for k, v in scalars[0].items() if k != "reasons"}, *scalars[1:]], new)


def demo(output_dir: Path, **extra) -> list[str]:
    """The shipped demo config at k = 1 with partial rollouts, cut to 4 prompts x 8 completions per step, no
    held-out evaluation."""
    sets = {**ASYNC, "train.partial_rollouts": 1, "train.num_steps": 3, "train.prompts_per_step": 4,
            "train.accuracy_reward": '""', "train.output_dir": f'"{output_dir}"',
            "train.checkpoint_every": 0, "train.save_final_model": "false", "log.progress_bar": "false",
            "log.tensorboard": "false", "log.report": "false", **extra}
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.mark.parametrize("speculation", ["off", "fixed"])
def test_the_demo_config_trains_with_partial_rollouts_and_no_token_lags_past_the_limit(tmp_path, restore_threads,
                                                                                       speculation):
    """k = 1, c = 1: the worker draws no step ahead, and every batch after the first holds groups started one step
    earlier, some continued with newer weights: tokens of lag 1 and of lag 0 in one batch, none of lag 2. With
    speculation, each segment drafts with its version's draft (which the trainer teaches)."""
    sets = demo(tmp_path / "run", **{"rollout.speculation": f'"{speculation}"'})
    summary = loop.train(load_config(REPO / "configs" / "demo.toml", sets))
    records = stepped(tmp_path / "run")
    if speculation != "off":
        assert all("spec/accepted_length" in r and r["draft/tokens"] > 0 for r in records)
    assert summary.steps == 3 and [r["step"] for r in records] == [1, 2, 3]
    assert [r["staleness/lag_max"] for r in records] == [0.0, 1.0, 1.0]
    # Some batch mixes both (a group's member still running when the step before stopped; the staleness metrics
    # count the trained groups' tokens).
    assert any(0.0 < r["staleness/lag_mean"] < 1.0 for r in records[1:]), [r["staleness/lag_mean"] for r in records]


# k1_c1 and k2_c1: slow. k2_c1_speculative runs k2_c1's path with the draft in flight besides; a resume at k = 1 with
# carried generations and nothing in flight is test_remote_worker.py's SIGTERM case [partial_rollouts].
@pytest.mark.parametrize("max_staleness, in_flight, speculation", [
    pytest.param(1, set(), "off", marks=pytest.mark.slow), pytest.param(2, {"v1"}, "off", marks=pytest.mark.slow),
    (2, {"v1", "draft", "optimizer"}, "fixed")],
    ids=["k1_c1", "k2_c1", "k2_c1_speculative"])
def test_a_resumed_run_with_partial_rollouts_repeats_the_uninterrupted_one(tmp_path, restore_threads, monkeypatch,
                                                                           max_staleness, in_flight, speculation):
    """The checkpoint at step 2 holds the generations carried into step 3 (ids, log-probs, versions) and, at k = 2
    (drawing k - c = 1 step ahead), the weights step 3's rollout samples with (with speculation, its draft's too,
    and the trainer's draft state); the resumed worker continues from them, so metrics and final weights equal an
    uninterrupted run's bit for bit."""
    extra = {"train.num_steps": 4, "train.checkpoint_every": 2, "train.prompts_per_step": 2,
             "train.max_staleness": max_staleness, "rollout.speculation": f'"{speculation}"'}
    loop.train(load_config(REPO / "configs" / "demo.toml", demo(tmp_path / "straight", **extra)))
    interrupted_at(3, load_config(REPO / "configs" / "demo.toml", demo(tmp_path / "resumed", **extra)), monkeypatch)
    carried = load_file(tmp_path / "resumed" / "step-000002" / "extra-rank0.safetensors")
    assert {name.split("/")[0] for name in carried} == {"carried"} | in_flight
    groups = json.loads((tmp_path / "resumed" / "step-000002" / "rng-rank0.json").read_text())["extra"]["carried"]
    assert len(groups) == 2 and None in [r for g in groups for r in g["reasons"]]  # a generation still running
    loop.train(load_config(REPO / "configs" / "demo.toml", demo(tmp_path / "resumed", **extra)), resume=True)
    straight, resumed = (comparable(stepped(tmp_path / d)) for d in ("straight", "resumed"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, straight):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    weights_straight, weights_resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(weights_straight[k], weights_resumed[k]) for k in weights_straight)
