"""algo.routing_replay end to end: a MoE run records its routes at sampling and replays them in training, on-policy,
asynchronous, with partial rollouts and with gradient checkpointing; an engine that records none is refused in one
line; without it nothing changes."""

import functools

import pytest
import torch

from tests.conftest import REPO
from turbogrpo.config import ConfigError, load_config
from turbogrpo.models import tiny_moe
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.output_dir import run_record

from .tiny_run import overrides, write_model, write_rows


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model = write_model(root / "model", build=functools.partial(tiny_moe, "qwen3_moe", dtype="float32"))
    return model, write_rows(root / "rows.jsonl")


def run(moe_assets, out, **extra):
    model_dir, rows = moe_assets
    sets = overrides(model_dir, rows, out, **{"train.num_steps": 2, "data.num_eval_problems": 2,
                                               "train.accuracy_reward": '""', "log.completions_every": 0, **extra})
    train(load_config(None, sets))
    return read_metrics(out)


def test_a_replaying_run_reports_how_many_tokens_its_routers_would_route_otherwise(moe_assets, tmp_path):
    replayed = run(moe_assets, tmp_path / "replay", **{"algo.routing_replay": '"replay"'})
    plain = run(moe_assets, tmp_path / "off")
    shares = [step["mismatch/frac_tokens_routes_differ"] for step in replayed if "loss" in step]
    # The native engine samples with the trainer's own float32 weights: the routers agree on (nearly) every token.
    assert len(shares) == 2 and all(0 <= share <= 0.05 for share in shares)
    assert not any("mismatch/frac_tokens_routes_differ" in step for step in plain)
    # Same draws (recording reads the routers, it changes nothing), same first update (the replayed routes are
    # the ones the trainer's routers choose here).
    first = lambda steps: next(s for s in steps if "loss" in s)  # noqa: E731
    assert first(replayed)["completion_length/mean"] == first(plain)["completion_length/mean"]
    assert first(replayed)["loss"] == pytest.approx(first(plain)["loss"], rel=1e-4, abs=1e-6)


def test_an_asynchronous_run_replays_the_routes_its_rollout_worker_recorded(moe_assets, tmp_path):
    """At train.max_staleness = 1 the rollout worker's engine records the routes and its messages carry them. Step 0
    trains on a rollout of its own weights: the recorded routes are the trainer's routers' own choice. Step 1 trains
    on a rollout of the weights before step 0's update (a large learning rate moved the routers): the trainer's
    routers would route some tokens otherwise, and it runs the worker's experts there."""
    steps = [s for s in run(moe_assets, tmp_path / "async", **{"algo.routing_replay": '"replay"',
                                                                "train.max_staleness": 1, "optim.lr": 0.05}) if "loss" in s]
    shares = [s["mismatch/frac_tokens_routes_differ"] for s in steps]
    assert len(shares) == 2 and shares[0] <= 0.05 and shares[1] > shares[0]


def test_partial_rollouts_and_gradient_checkpointing_run_with_replay(moe_assets, tmp_path):
    """The settings replay once refused: a carried generation keeps its routes (tests/train/test_replayed_routes.py)
    and a checkpointed layer replays them when recomputed (tests/test_moe_routes.py); here they run end to end."""
    steps = [s for s in run(moe_assets, tmp_path / "partial", **{
        "algo.routing_replay": '"replay"', "train.max_staleness": 1, "train.partial_rollouts": 1,
        "model.gradient_checkpointing": "true"}) if "loss" in s]
    assert len(steps) == 2 and all(0 <= s["mismatch/frac_tokens_routes_differ"] <= 1 for s in steps)


def test_an_engine_without_routes_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="rollout.engine") as error:
        load_config(REPO / "configs" / "demo.toml", ['rollout.engine="vllm"', 'algo.routing_replay="replay"'])
    assert "\n" not in str(error.value) and "routing_replay" in str(error.value)


def test_the_settings_replay_once_refused_load():
    for sets in (["train.max_staleness=1", "train.partial_rollouts=1"],
                 ['env.factory="a.b:c"', 'rollout.speculation="cost"', "draft.learn=false"],
                 ["model.gradient_checkpointing=true"]):
        assert load_config(REPO / "configs" / "demo.toml", [*sets, 'algo.routing_replay="replay"']).algo.routing_replay


def test_the_vllm_refusal_says_why():
    with pytest.raises(ConfigError, match="CPU runner returns none"):
        load_config(REPO / "configs" / "demo.toml", ['rollout.engine="vllm"', 'algo.routing_replay="replay"'])


def test_a_model_without_experts_is_refused_at_the_build(tmp_path):
    from turbogrpo.rewards import build_rewards
    from turbogrpo.placement import join_job
    from turbogrpo.train.run import build_run
    config = load_config(REPO / "configs" / "demo.toml", ['algo.routing_replay="replay"', "data.num_eval_problems=2",
                                                          f'train.output_dir="{tmp_path}"'])
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])  # (qwen3_5_moe: a hybrid, with its state cache)
def test_the_engine_records_the_routes_the_trainer_replays(family):
    """The native engine's routes of every prompt and completion token are the model's own forward's (float64:
    no rounding can flip a choice), with finished rows waiting in the batch (host check every 3 steps)."""
    from turbogrpo.rollout.decode import DecodeSchedule, generate
    from turbogrpo.rollout.sampling import SamplingConfig
    model = tiny_moe(family)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 60, (p,), generator=g) for p in (5, 3, 4)]
    sampling = SamplingConfig(max_new_tokens=9, stop_token_ids=(1, 2, 3, 4, 5))
    schedule = DecodeSchedule(host_check_every=3, buckets="pow2")
    batch = generate(model, prompts, num_samples=3, sampling=sampling, seed=1, schedule=schedule,
                     record_routes=True).groups
    plain = generate(model, prompts, num_samples=3, sampling=sampling, seed=1, schedule=schedule).groups
    assert plain.routes is None and all(torch.equal(a, b) for a, b in zip(plain.completions, batch.completions))
    assert len(set(batch.lengths)) > 1  # some stopped early
    assert_routes_are_the_models_own(model, prompts, batch, 3)


def assert_routes_are_the_models_own(model, prompts, batch, num_samples):
    from turbogrpo.moe_routes import recording
    for i, completion in enumerate(batch.completions):
        prompt = prompts[i // num_samples]
        with recording(model) as recorder:
            model(torch.cat([prompt, completion])[None])
        own = recorder.take()
        assert torch.equal(batch.prompt_routes[i // num_samples], own[:prompt.numel()])
        assert torch.equal(batch.routes[i], own[prompt.numel():-1])   # every token the sampler ran


def test_a_speculative_rollout_records_the_accepted_paths_routes():
    """Greedy, with the first rollout's text as history drafts: the second accepts whole chains, and each token's
    routes are those of the tree node that carried it (the rejected nodes' dropped)."""
    from turbogrpo.rollout.decode import generate
    from turbogrpo.rollout.sampling import SamplingConfig
    from turbogrpo.speculative.history import HistoryDrafts
    from turbogrpo.speculative.sizing import FixedSizing
    from turbogrpo.speculative.speculation import Speculation
    from turbogrpo.speculative.tree import TreeShape
    model = tiny_moe("qwen3_moe")
    prompts = [torch.tensor([5, 9, 11, 3, 7]), torch.tensor([8, 1, 2])]
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    history = HistoryDrafts(min_match=1)
    plain = generate(model, prompts, num_samples=2, sampling=greedy, record_routes=True)
    runs = [generate(model, prompts, num_samples=2, sampling=greedy, record_routes=True,
                     draft=Speculation(None, FixedSizing(TreeShape(2, 4, 9)), history=history)) for _ in range(2)]
    assert runs[1].stats.num_forwards < plain.stats.num_forwards   # chains were accepted
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run.groups.completions, plain.groups.completions))
        assert_routes_are_the_models_own(model, prompts, run.groups, 2)


class Scripted:
    """Answers every turn with ``reply`` (ids) up to ``turns`` turns, then ends the conversation; forks by copy."""

    def __init__(self, reply, turns=2):
        self.reply, self.turns, self.seen = reply, turns, 0

    def __call__(self, turn_ids):
        self.seen += 1
        return self.reply if self.seen <= self.turns else None

    def fork(self):
        return Scripted(self.reply, self.turns)


@pytest.mark.parametrize("branching", [(), (2, 2)])
def test_a_conversation_records_the_routes_of_its_sampled_and_environment_ids(branching):
    """Model turns and prefilled replies (in chunks of 3, batched with decoding rows), forked by branching: each
    conversation's routes are those of the model's own forward over the whole conversation."""
    from turbogrpo.rollout.multiturn import TurnLimits, generate_multiturn
    from turbogrpo.rollout.sampling import SamplingConfig
    model = tiny_moe("qwen3_moe")
    prompts = [torch.tensor([5, 9, 11, 3, 7]), torch.tensor([8, 1, 2])]
    first = 2 if branching else 4
    out = generate_multiturn(model, prompts, [Scripted([30 + i, 31, 32, 33]) for i in range(2 * first)],
                             num_samples=4, sampling=SamplingConfig(max_new_tokens=6, stop_token_ids=(1, 2, 3)),
                             limits=TurnLimits(6, 30, prefill_chunk=3), seed=0, branching=branching,
                             reply_timing="next_step", record_routes=True)
    assert any(not bool(m.all()) for m in out.groups.model_mask)   # replies were prefilled
    assert_routes_are_the_models_own(model, prompts, out.groups, 4)
