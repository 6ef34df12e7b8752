"""Tree sizing policies: FastGRPO's rule (without the reference bugs) and the cost model."""

import pytest
import torch

from tests.speculative.speculative_helpers import trained_pair
from turbogrpo.rollout import SamplingConfig
from turbogrpo.speculative.speculation import Speculation, generate_speculative
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile
from turbogrpo.speculative.sizing import (SIZING_POLICIES, CostSizing, FastGRPOSizing, FixedSizing, acceptance_counts,
                                          expected_accepted_table, make_sizing)
from turbogrpo.speculative.tree import TreeShape, ancestors_from_parents, chain_tree
from turbogrpo.speculative.verify import accept_paths

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def profile(draft_ms_per_token=0.01, draft_base_ms=1.0):
    """Verify: flat 10 ms up to 64 tokens, then +1 ms per 8 tokens; the draft: cheap and linear."""
    verify = tuple(10e-3 + max(0, n - 64) * 1e-3 / 8 for n in GRID)
    draft = tuple(draft_base_ms * 1e-3 + n * draft_ms_per_token * 1e-3 for n in GRID)
    return LatencyProfile("test", LatencyCurve(GRID, verify), LatencyCurve(GRID, draft))


def test_registry_has_every_policy():
    assert set(SIZING_POLICIES) == {"off", "fixed", "fastgrpo", "cost"}
    with pytest.raises(ValueError, match="sizing policy must be one of"):
        make_sizing("eagle")
    with pytest.raises(ValueError, match="c_peak"):
        make_sizing("fastgrpo")
    assert make_sizing("fastgrpo", profile=profile()).c_peak == 144   # where 10 ms doubles


@pytest.mark.parametrize("num_live,shape", [
    (1, TreeShape(8, 6, 64)),   # N = 64: log2(64 / 0.75) = 6.4
    (4, TreeShape(8, 4, 16)),   # N = 16: log2(21.3) = 4.4
    (16, TreeShape(3, 2, 4)),   # N = 4: K = 3, log2(5.3) = 2.4
    (32, TreeShape(1, 1, 2)),   # N = 2: one draft token, depth 1 (no floor on L)
    (33, None),                 # N = 1: off, where the reference took log2(0)
    (10_000, None),
])
def test_fastgrpo_rule(num_live, shape):
    assert FastGRPOSizing(64).choose(num_live) == shape


def test_fastgrpo_never_crashes_and_fits_its_bounds():
    policy = FastGRPOSizing(160, alpha=0.5, k_max=4, l_max=3, n_max=20)
    max_nodes, max_slots = policy.bounds()
    for num_live in range(1, 400):
        shape = policy.choose(num_live)
        if shape is not None:
            shape.validate()
            assert shape.num_nodes <= max_nodes and (shape.depth - 1) * shape.top_k <= max_slots


def test_expected_accepted_of_a_chain_and_a_tree():
    acceptance = torch.full((3, 2), 0.5, dtype=torch.float64)
    table = expected_accepted_table(acceptance, [(1, 3), (2, 2)], n_max=7)
    assert table[0].tolist() == pytest.approx([0, 0.5, 0.75, 0.875, 0.875, 0.875, 0.875])
    # K=2, L=2: candidates .5, .5, then four .25 children
    assert table[1].tolist() == pytest.approx([0, 0.5, 1.0, 1.25, 1.5, 1.75, 2.0])


def test_acceptance_counts_by_depth_and_rank():
    # root -> a (rank 0), b (rank 1); a -> c; the walk accepts a, then stops at a (c rejected).
    tree = chain_tree(torch.tensor([[0, 1, 2, 3]]))
    tree = tree._replace(tokens=torch.tensor([[0, 1, 2, 3]]), parents=torch.tensor([[0, 0, 0, 1]]),
                         depths=torch.tensor([[0, 1, 1, 2]]), path_logprobs=torch.tensor([[0.0, -0.1, -2.0, -0.5]]))
    tree = tree._replace(ancestors=ancestors_from_parents(tree.parents, 2), max_depth=2)
    verdict = accept_paths(tree, torch.tensor([[1, 7, 0, 0]]))   # root draws 1 (= a), a draws 7
    counts = acceptance_counts(tree, verdict, max_depth=2, max_rank=2).view(2, 2, 2)
    matches, trials = counts
    assert matches.tolist() == [[1, 0], [0, 0]]
    assert trials.tolist() == [[1, 1], [1, 0]]


TOP1_90_PERCENT = ([9.0] + [0.0] * 7) * 6 + [10.0] * 48   # (matches, trials) per (depth, rank)


def timed_cost_policy(**kwargs) -> CostSizing:
    """A cost policy that has seen one plain step run exactly as profiled."""
    policy = CostSizing(kwargs.pop("profile", None) or profile(), **kwargs)
    assert policy.choose(4) is None            # nothing measured yet: a plain step comes first
    policy.observe_time(4, None, policy.profile.verify(4))
    return policy


def test_cost_policy_speculates_in_the_tail_only_when_the_draft_is_good():
    good = timed_cost_policy()
    good.observe(TOP1_90_PERCENT)
    good.refresh()
    assert good.choose(1) is not None and good.choose(1).num_nodes > 8
    assert good.choose(4) is not None
    assert good.choose(512) is None                     # past the knee: plain decoding
    sizes = [good.choose(b).num_nodes if good.choose(b) else 1 for b in (1, 4, 16, 64, 512)]
    assert sizes == sorted(sizes, reverse=True)          # trees shrink as the batch grows

    bad = timed_cost_policy()
    bad.observe([0.0] * 48 + [100.0] * 48)                # the draft is never accepted
    bad.refresh()
    assert all(bad.choose(b) is None for b in (1, 4, 64))

    costly_draft = timed_cost_policy(profile=profile(draft_base_ms=30.0))
    costly_draft.observe(TOP1_90_PERCENT)
    costly_draft.refresh()
    assert costly_draft.choose(1) is None                 # drafting costs more than it saves


def test_unvisited_depths_borrow_the_estimate_of_the_level_above():
    policy = timed_cost_policy()
    seen_at_depth_1 = ([90.0] + [0.0] * 7) + [0.0] * 40 + ([100.0] * 8) + [0.0] * 40
    policy.observe(seen_at_depth_1)                       # 90 of 100 top-1 children matched, depth 1 only
    top1 = policy.acceptance()[:, 0]
    expected_depth_1 = (90 + policy.PRIOR_WEIGHT * 0.5) / (100 + policy.PRIOR_WEIGHT)
    assert top1.tolist() == pytest.approx([expected_depth_1] * policy.l_max)


def test_cost_policy_keeps_exploring_while_off():
    bad = timed_cost_policy()
    bad.observe([0.0] * 48 + [100.0] * 48)                # the draft is never accepted
    bad.refresh()
    choices = [bad.choose(1) for _ in range(3 * bad.EXPLORE_EVERY)]
    tried = [i for i, shape in enumerate(choices) if shape is not None]
    # One exploratory tree per EXPLORE_EVERY steps, so the statistics can recover if the text changes.
    assert tried == [bad.EXPLORE_EVERY - 1, 2 * bad.EXPLORE_EVERY - 1, 3 * bad.EXPLORE_EVERY - 1]
    # Not while the draft has yet to read the prompts: exploring would pay for its prompt pass.
    assert all(bad.choose(1, draft_ready=False) is None for _ in range(2 * bad.EXPLORE_EVERY))


def test_a_first_tree_must_repay_the_drafts_prompt_pass_before_the_rollout_ends():
    policy = timed_cost_policy()
    policy.observe(TOP1_90_PERCENT)
    policy.refresh()
    assert policy.choose(4) is not None                    # trees pay at B=4 once the draft is ready
    policy.observe_startup(0.05)                           # its prompt pass took 50 ms
    policy.observe_lengths([20] * 60 + [200] * 4)          # most completions end at 20, a few run long
    assert policy.expected_remaining(4, position=19) == pytest.approx(1.0)
    # Near the end of short completions the saving cannot repay 50 ms; in a long tail it can.
    assert policy.choose(4, draft_ready=False, position=19) is None
    assert policy.choose(4, draft_ready=False, position=30) is not None
    assert policy.choose(4, draft_ready=True, position=19) is not None   # already paid for


def test_cost_policy_learns_slow_tree_steps_from_their_measured_time():
    policy = timed_cost_policy()
    policy.observe(TOP1_90_PERCENT)
    policy.refresh()
    shape = policy.choose(16)
    assert shape is not None
    for _ in range(policy.REFRESH_STEPS):   # every tree step takes 5x what the curves predict
        predicted = float(policy._tree_time(16, *(torch.tensor([[float(v)]]) for v in shape), 0.0, 16))
        policy.observe_time(16, shape, 5 * predicted / policy.tree_scale, catch_up_tokens=16)
    assert policy.tree_scale == pytest.approx(5.0, rel=0.05)
    assert policy.choose(16) is None
    assert policy.describe()["num_timed"] == {"plain": 1, "tree": policy.REFRESH_STEPS}


def chain_counts(policy: CostSizing, num_live: int, depth: int, top1: float) -> list[float]:
    """(matches, trials) of ``num_live`` sequences walking a tree's top-1 children to ``depth``,
    each accepted with probability ``top1`` (in expectation)."""
    matches, trials = torch.zeros(policy.l_max, policy.k_max), torch.zeros(policy.l_max, policy.k_max)
    for d in range(min(depth, policy.l_max)):
        trials[d, 0], matches[d, 0] = num_live * top1 ** d, num_live * top1 ** (d + 1)
    return matches.flatten().tolist() + trials.flatten().tolist()


def test_trees_that_lose_at_one_live_batch_are_vetoed_there_only():
    """One time scale cannot fit every B: here tree steps run as profiled at B=1 but 3x slower at B=16.
    The realised gain per live-batch bucket vetoes trees at B=16 (and 17-31) and keeps them at B=1."""
    policy = timed_cost_policy()
    policy.observe(TOP1_90_PERCENT)
    policy.refresh()
    shapes = {1: policy.choose(1), 16: policy.choose(16)}
    assert None not in shapes.values()
    for _ in range(policy.MIN_REALISED):
        for num_live, slowdown in ((16, 3.0), (1, 1.0)):
            shape = shapes[num_live]
            predicted = float(policy._tree_time(num_live, *(torch.tensor([[float(v)]]) for v in shape), 0.0, num_live))
            policy.observe_time(num_live, shape, slowdown * predicted / policy.tree_scale, catch_up_tokens=num_live)
            policy.observe(chain_counts(policy, num_live, shape.depth, 0.9))  # as accepted as before
    realised = policy.describe()["realised_gain_by_bucket"]
    assert realised[16]["gain"] < 1 < realised[1]["gain"] and realised[16]["tree_steps"] == policy.MIN_REALISED
    assert policy.loses(16) and policy.loses(20) and not policy.loses(1) and not policy.loses(8)
    policy.refresh()
    assert policy._best_shape(16)[1] > 1 + policy.margin   # the time model alone would still speculate
    assert policy.choose(1) is not None and policy.choose(16) is None
    # Exploration goes on at the vetoed batch, so the veto can lift.
    assert any(policy.choose(16) is not None for _ in range(policy.EXPLORE_EVERY))
    restored = CostSizing(profile())
    restored.load_state_dict(policy.state_dict())
    assert restored.loses(16) and not restored.loses(1)


def test_the_realised_gain_leaves_out_the_backlog_of_the_plain_steps_before_a_tree():
    """An exploratory tree after a plain streak catches the draft up on the whole streak's tokens: a
    cost of switching trees on, which must not veto trees that pay step by step."""
    gains = {}
    for backlog in (None, 32 * 4):
        policy = timed_cost_policy(profile=profile(draft_ms_per_token=0.2))
        policy.observe(TOP1_90_PERCENT)
        policy.refresh()
        shape = policy.choose(4)
        counts = chain_counts(policy, 4, shape.depth, 0.9)
        emitted = 4 + sum(counts[:len(counts) // 2])
        catch_up = backlog or round(emitted)
        predicted = float(policy._tree_time(4, *(torch.tensor([[float(v)]]) for v in shape), 0.0, catch_up))
        policy.observe_time(4, shape, predicted, catch_up_tokens=catch_up)  # as slow as the curves say
        policy.observe(counts)
        gains[backlog] = policy.describe()["realised_gain_by_bucket"][policy.bucket(4)]["gain"]
    assert gains[None] > 1.5
    assert gains[32 * 4] == pytest.approx(gains[None], rel=0.02)


def test_the_realised_gain_of_one_token_or_two_is_their_ratio_of_sums_not_the_last_few():
    """At B=1 a tree step emits 1 or 2 tokens: a run of misses must not veto trees that pay on average."""
    policy = timed_cost_policy()
    plain = policy._plain_time(1)
    for emitted in [2, 2, 2, 1, 1, 1, 1, 2, 1, 2]:          # 1.5 tokens for 1.2 plain steps' time: 1.25x
        policy._record_gain(1, emitted * plain, 1.2 * plain)
        if policy.realised[1][2] >= policy.MIN_REALISED:
            assert not policy.loses(1)
    assert policy.describe()["realised_gain_by_bucket"][1]["gain"] == pytest.approx(1.25, abs=0.1)
    for _ in range(12):
        policy._record_gain(1, 1 * plain, 1.2 * plain)       # a draft that stopped matching: 0.83x
    assert policy.loses(1)
    old = policy.state_dict()
    old["realised"] = {"1": [0.9, 5]}                        # a checkpoint from before the ratio of sums
    policy.load_state_dict(old)
    assert policy.loses(1) and policy.describe()["realised_gain_by_bucket"][1] == {"gain": 0.9, "tree_steps": 5}


def test_the_realised_gain_compares_a_tree_with_plain_steps_at_its_own_live_batch():
    """Plain steps run 2x the curve at B=1 (overhead) and as profiled at B=64: a tree step at B=64 that
    emits 1.3 tokens for 1.55x a plain step's time loses (0.84x), though the global plain scale (pulled
    up by B=1) would call it a gain."""
    policy = timed_cost_policy()
    for _ in range(20):
        policy.observe_time(1, None, 2.0 * policy.profile.verify(1))
        policy.observe_time(64, None, policy.profile.verify(64))
    policy.observe_time(1, None, 2.0 * policy.profile.verify(1))
    assert policy.plain_scale > 1.5 and policy.plain_scale_by_bucket[64] == pytest.approx(1.0)
    counts = chain_counts(policy, 64, 1, 0.3)
    for _ in range(policy.MIN_REALISED):
        policy.observe_time(64, TreeShape(1, 1, 2), 1.55 * policy.profile.verify(64), catch_up_tokens=83)
        policy.observe(counts)
    assert policy.describe()["realised_gain_by_bucket"][64]["gain"] == pytest.approx(1.3 / 1.55, rel=0.02)
    assert policy.loses(64)
    restored = CostSizing(profile())
    restored.load_state_dict(policy.state_dict())
    assert restored.plain_scale_by_bucket == policy.plain_scale_by_bucket


def test_policies_drive_a_rollout_and_record_tree_sizes():
    policy, draft, prompts = trained_pair()
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    cost = timed_cost_policy()
    fixed = FixedSizing(TreeShape(2, 3, 6))
    for sizing, expected in ((cost, None), (fixed, {6}), (FastGRPOSizing(16), None)):
        rollout = generate_speculative(policy, prompts, num_samples=2, sampling=sampling,
                                       draft=Speculation(draft, sizing))
        stats = rollout.stats
        assert len(stats.tree_sizes) == len(stats.live_batch_sizes) == len(stats.accepted_lengths)
        if expected:
            assert set(stats.tree_sizes) == expected
    assert cost.trials.sum() > 0          # the cost policy learned from the verified trees
    fast = rollout.stats
    assert all(n == (FastGRPOSizing(16).choose(b) or TreeShape(0, 0, 1)).num_nodes
               for n, b in zip(fast.tree_sizes, fast.live_batch_sizes))


def test_the_old_module_name_still_imports_with_a_warning():
    import importlib
    import sys

    sys.modules.pop("turbogrpo.speculative.policy", None)
    with pytest.warns(DeprecationWarning, match="turbogrpo.speculative.sizing"):
        old = importlib.import_module("turbogrpo.speculative.policy")
    assert old.make_sizing is make_sizing and old.SIZING_POLICIES is SIZING_POLICIES


class Scripted(FixedSizing):
    """A fixed shape (or None) with a scripted predicted gain, recording what it is taught."""

    def __init__(self, shape, gain):
        self.shape, self.gain, self.taught = shape, gain, []

    def choose(self, num_live, *, draft_ready=True, position=0):
        return self.shape

    def predicted_gain(self, num_live):
        return self.gain

    def feedback(self, tree, verdict):
        return torch.tensor([float(self.gain)])

    def observe(self, values):
        self.taught.append(("counts", values))

    def observe_time(self, num_live, shape, seconds, catch_up_tokens=0):
        self.taught.append(("time", shape))

    def forget(self, keep):
        self.taught.append(("forget", keep))

    def state_dict(self):
        return {"gain": self.gain}

    def load_state_dict(self, state):
        self.gain = state["gain"]


def test_merged_sizing_takes_the_better_kind_and_teaches_the_one_that_ran():
    from turbogrpo.speculative.sizing import MergedSizing
    neural, history = Scripted(TreeShape(4, 3, 10), 1.3), Scripted(TreeShape(1, 8, 9), 2.0)
    merged = MergedSizing(neural, history)
    assert merged.bounds() == (10, 8)     # the larger tree; only the neural tree writes draft slots
    tried = [merged.choose(4) for _ in range(2 * merged.MIN_TRIES)]   # each kind a few times first
    assert tried.count(TreeShape(1, 8, 9)) == tried.count(TreeShape(4, 3, 10)) == merged.MIN_TRIES
    assert merged.choose(4) == TreeShape(1, 8, 9) and merged.history_alone   # the larger predicted gain
    assert merged.feedback(None, None).item() == 2.0
    merged.observe([1.0])
    merged.observe_time(4, TreeShape(1, 8, 9), 0.1)
    assert history.taught == [("counts", [1.0]), ("time", TreeShape(1, 8, 9))] and neural.taught == []
    picks = [merged.choose(4) for _ in range(2 * merged.EXPLORE_EVERY)]   # the other kind now and then
    assert picks.count(TreeShape(4, 3, 10)) == 2 and merged.tries["neural"] == merged.MIN_TRIES + 2
    history.gain = 1.1
    assert merged.choose(4) == TreeShape(4, 3, 10) and not merged.history_alone
    merged.observe_time(4, TreeShape(4, 3, 10), 0.1)
    assert neural.taught == [("time", TreeShape(4, 3, 10))]
    merged.observe_time(4, None, 0.05)   # a plain step's time anchors both
    assert neural.taught[-1] == history.taught[-1] == ("time", None)
    merged.forget(0.5)                    # the draft changed: the history's chains did not
    assert neural.taught[-1] == ("forget", 0.5) and history.taught[-1] == ("time", None)
    merged.observe_lengths([5, 7])        # a rollout ended: the store changed, each kind is tried again
    assert history.taught[-1] == ("forget", merged.HISTORY_KEEP) and neural.taught[-1] == ("forget", 0.5)
    assert merged.tries == {"neural": 0, "history": 0}
    merged.tries = {"neural": merged.MIN_TRIES, "history": merged.MIN_TRIES}
    neural.shape = None                   # the neural draft plays plain: the chains alone still run
    assert merged.choose(4) == TreeShape(1, 8, 9) and merged.history_alone
    history.shape = None
    assert merged.choose(4) is None
    state = merged.state_dict()
    assert state == {"neural.gain": 1.3, "history.gain": 1.1}
    neural.gain = history.gain = 0.0
    merged.load_state_dict(state)
    assert (neural.gain, history.gain) == (1.3, 1.1)
    merged.load_state_dict({"gain": 1.7})  # a checkpoint of the neural policy alone, from before merging
    assert (neural.gain, history.gain) == (1.7, 1.1)


def test_cost_sizing_predicts_the_gain_it_chooses_by():
    policy = timed_cost_policy()
    shape = policy.choose(1)
    assert shape is not None and policy.predicted_gain(1) > 1 + policy.margin
    assert policy.predicted_gain(10_000) == 0.0  # no tree fits the profiled range: no prediction of a gain
