"""History and sibling drafts: hand-computed suffix matches and trees, greedy equality with plain
decoding, the chi-square test of losslessness, and no host sync inside the step."""

import math

import pytest
import torch

from tests.rollout.conftest import forbid_host_syncs_inside
from tests.speculative.speculative_helpers import chi_square_pvalue, joint_counts, trained_pair
from tests.speculative.test_decode import CASES, V, assert_same_completions, exact_first_three
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.speculative import decode
from turbogrpo.speculative import speculation as speculation_module
from turbogrpo.speculative.speculation import Speculation
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.history import (DEAD_TOKEN, HistoryCorpus, HistoryDrafts, HistoryStore, chain_geometry,
                                           continuations, corpus_rows, history_profile, history_sizing_options,
                                           history_tree, row_queries, suffix_matches, tree_from_paths)
from turbogrpo.speculative.sizing import FixedSizing, MergedSizing, make_sizing
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile
from turbogrpo.speculative.tree import TreeShape, chain_tree
from turbogrpo.speculative.verify import accept_paths

GREEDY = SamplingConfig(max_new_tokens=20, temperature=0.0)
X = -1  # padding / no token


def test_suffix_matches_take_the_longest_then_the_latest():
    corpus = torch.tensor([[[5, 1, 2, 3, 9, X, X],
                            [1, 2, 3, 4, 1, 2, X]]])             # [B=1, S=2, T=7]
    starts, lengths = suffix_matches(corpus, torch.tensor([[1, 2, 3]]), num_matches=3, min_match=1)
    # Full matches end at source 0 position 3 (then 9) and source 1 position 2 (then 4): the later
    # position first. No other window ends in "3" (the third best is no match at all).
    assert lengths.tolist() == [[3, 3, 0]]
    assert starts[0, :2].tolist() == [4, 7 + 3]  # flat positions of the first continuation token
    chains = continuations(corpus, starts, lengths, depth=3)
    assert chains.tolist() == [[[9, X, X], [4, 1, 2], [X, X, X]]]  # a chain stops at its source's end


def test_suffix_matches_count_trailing_tokens_and_respect_min_match():
    corpus = torch.tensor([[[7, 2, 3, 8, 0, 2, 3, 6, X]]])
    query = torch.tensor([[1, 2, 3]])
    starts, lengths = suffix_matches(corpus, query, num_matches=2, min_match=2)
    assert lengths.tolist() == [[2, 2]] and starts.tolist() == [[7, 3]]  # "2 3" twice, latest first
    assert continuations(corpus, starts, lengths, 2).tolist() == [[[6, X], [8, 0]]]
    _unused, lengths = suffix_matches(corpus, query, num_matches=1, min_match=3)
    assert lengths.tolist() == [[0]]
    assert continuations(corpus, *suffix_matches(corpus, query, 1, 3), 2).tolist() == [[[X, X]]]


def test_a_row_reads_its_own_query_and_siblings_but_never_its_own_end():
    # One group (prompt 4 5), two samples: sample 0 wrote "6 7 8", sample 1 wrote "6". Output columns
    # past a length hold leftovers (99) that must never be read.
    corpus = HistoryCorpus(prompt_GP=torch.tensor([[X, 4, 5]]), past_GHJ=torch.full((1, 0, 0), X), num_samples=2)
    tokens_NT = torch.tensor([[6, 7, 8, 99], [6, 99, 99, 99]])
    lengths_N = torch.tensor([3, 1])
    rows = corpus_rows(corpus, tokens_NT, lengths_N, torch.tensor([0, 1]), num_columns=3)
    assert rows.tolist() == [[[X, 4, 5, 6, 7, 8], [X, 4, 5, 6, X, X]]] * 2
    query = row_queries(rows, 3, torch.tensor([0, 1]), torch.tensor([3, 1]), 2, n=3)
    assert query.tolist() == [[6, 7, 8], [4, 5, 6]]
    starts, lengths = suffix_matches(rows, query, num_matches=1, min_match=1)
    # Row 0's "8" occurs only at its own end, which nothing follows: no match. Row 1's "4 5 6" is
    # also sibling 0's start, followed by "7 8" (row 1's own "4 5 6" is its end, not a match).
    assert lengths.tolist() == [[0], [3]]
    assert continuations(rows, starts, lengths, 3).tolist() == [[[X, X, X]], [[7, 8, X]]]


def test_tree_from_paths_merges_equal_paths_and_keeps_dead_nodes_unmatchable():
    paths = torch.tensor([[[1, X], [2, X], [1, 3], [1, X], [1, 4], [X, X]]])   # [B=1, M=6, D=2]
    tree = tree_from_paths(torch.tensor([10]), paths, -torch.arange(1.0, 7.0)[None])
    assert tree.tokens.tolist() == [[10, 1, 2, 3, DEAD_TOKEN, 4, DEAD_TOKEN]]
    assert tree.parents.tolist() == [[0, 0, 0, 1, 0, 1, 0]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 1, 2, 1]]
    assert tree.ancestors[0, 5].nonzero().flatten().tolist() == [0, 1, 5]
    # Draws: root -> 1, node 1 -> 4: the path root, 1, 4 (node 5); a dead node never matches.
    verdict = accept_paths(tree, torch.tensor([[1, 4, 0, 0, 0, 0, 0]]))
    assert verdict.num_accepted.tolist() == [2] and verdict.path_nodes.tolist() == [[0, 1, 5]]
    verdict = accept_paths(tree, torch.tensor([[7, 0, 0, 0, 0, 0, 0]]))
    assert verdict.num_accepted.tolist() == [0]


def test_history_chains_merge_into_a_neural_tree_without_repeating_its_nodes():
    root = torch.tensor([3])
    neural = chain_tree(torch.tensor([[3, 5, 6]]))                         # root -> 5 -> 6
    chains = torch.tensor([[[5, 6, 7], [8, X, X]]])                        # K=2 chains of depth 3
    tree = history_tree(root, chains, neural)
    # 5 and 5-6 are the neural nodes; the chains add 5-6-7 under node 2, and 8 under the root.
    assert tree.tokens.tolist() == [[3, 5, 6, DEAD_TOKEN, DEAD_TOKEN, 7, 8, DEAD_TOKEN, DEAD_TOKEN]]
    assert tree.parents.tolist() == [[0, 0, 1, 0, 0, 2, 0, 0, 0]]
    assert tree.max_depth == 3
    alone = history_tree(root, chains)
    assert alone.tokens.tolist() == [[3, 5, 6, 7, 8, DEAD_TOKEN, DEAD_TOKEN]]


def test_chain_geometry_fits_the_shape():
    assert chain_geometry(TreeShape(1, 6, 7)) == (1, 6)
    assert chain_geometry(TreeShape(1, 6, 4)) == (1, 3)
    assert chain_geometry(TreeShape(4, 4, 16)) == (4, 3)


def test_the_store_is_bounded_and_keyed_by_prompt_tokens():
    store = HistoryStore(max_prompts=2, per_prompt=2)
    a, b, c = torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([9])
    store.add(a, [torch.tensor([5]), torch.tensor([6]), torch.tensor([7])])
    assert [t.tolist() for t in store.get(torch.tensor([1, 2]))] == [[6], [7]]  # the newest two
    store.add(b, [torch.tensor([8])])
    store.get(a)
    store.add(a, [])  # use refreshes a prompt
    store.add(c, [torch.tensor([4])])
    assert len(store) == 2 and store.get(b) == [] and store.get(a)


def speculate(policy, prompts, sampling, draft=None, shape=TreeShape(1, 5, 6), history=None, **kw):
    history = history or HistoryDrafts()
    return generate(policy, prompts, sampling=sampling, seed=kw.pop("seed", 0),
                    draft=Speculation(draft, FixedSizing(shape), history=history), **{"num_samples": 3, **kw})


@pytest.mark.parametrize("kind", ["history", "history+trained", "history+random"])
@pytest.mark.parametrize("shape", [TreeShape(1, 5, 6), TreeShape(2, 3, 7)])
def test_greedy_with_history_equals_greedy_plain(kind, shape):
    policy, trained, prompts = trained_pair()
    draft = {"history": None, "history+trained": trained, "history+random": DraftHead(policy)}[kind]
    plain = generate(policy, prompts, num_samples=3, sampling=GREEDY)
    history = HistoryDrafts(min_match=1)
    first = speculate(policy, prompts, GREEDY, draft, shape, history)
    again = speculate(policy, prompts, GREEDY, draft, shape, history)  # the store now holds the first rollout
    assert_same_completions(plain, first)
    assert_same_completions(plain, again)
    if kind == "history":  # the store holds this very text: whole chains are accepted
        assert again.stats.num_forwards < 0.5 * plain.stats.num_forwards


def test_greedy_with_history_stops_and_limits_like_plain():
    policy, _unused, prompts = trained_pair()
    reference = generate(policy, prompts, num_samples=1, sampling=GREEDY)
    sampling = SamplingConfig(max_new_tokens=20, temperature=0.0,
                              stop_token_ids=(int(reference.tokens[0][6]), int(reference.tokens[2][3])))
    limits = [20, 3, 1, 11, 7, 20, 2, 5, 20, 20, 9, 1]
    plain = generate(policy, prompts, num_samples=3, sampling=sampling, max_new_tokens_per_completion=limits)
    history = HistoryDrafts(min_match=1)
    for _round in range(2):
        spec = speculate(policy, prompts, sampling, shape=TreeShape(1, 6, 7), history=history,
                         max_new_tokens_per_completion=limits)
        assert_same_completions(plain, spec)
    assert "stop" in spec.finish_reasons and max(spec.stats.accepted_lengths) > 2


@pytest.mark.parametrize("case,kind,shape", [
    ("T1", "history", TreeShape(1, 3, 4)), ("T0.7-top_p0.9", "history", TreeShape(2, 2, 5)),
    ("T1", "history+trained", TreeShape(2, 2, 4)),
])
def test_distribution_with_history_is_the_policys(case, kind, shape):
    policy, trained, _ = trained_pair(V, sharpness=1.5)
    draft = trained if kind == "history+trained" else None
    prompt = torch.tensor([1, 5, 2, 7])
    sampling = CASES[case]
    # 1000 groups of the same prompt: 8 siblings each, and a store filled by a first rollout.
    history = HistoryDrafts(min_match=1)
    speculate(policy, [prompt] * 1000, sampling, draft, shape, history, num_samples=8, seed=2)
    spec = speculate(policy, [prompt] * 1000, sampling, draft, shape, history, num_samples=8, seed=1)
    samples = torch.stack([t[:3] for t in spec.tokens])
    pvalue = chi_square_pvalue(joint_counts(samples, V), exact_first_three(policy, prompt, sampling))
    assert pvalue > 1e-3, f"speculative rollouts with history differ from the policy (p={pvalue:.2e})"
    assert spec.stats.mean_accepted_length > 1.15  # history candidates really were accepted


def test_the_history_step_never_syncs_with_the_host(monkeypatch):
    policy, draft, prompts = trained_pair()
    forbid_host_syncs_inside(monkeypatch, (decode, "draft_tree"), (decode, "verify_step"), (decode, "propose_history"))
    history = HistoryDrafts(min_match=1)
    for neural in (None, draft):
        for sampling in (GREEDY, SamplingConfig(max_new_tokens=10, top_p=0.9, stop_token_ids=(3,))):
            rollout = speculate(policy, prompts[:2], sampling, neural, TreeShape(2, 3, 5), history)
            assert rollout.stats.tree_sizes and min(rollout.stats.tree_sizes) > 1


class StepClock:
    """``time`` for the speculative step's timing: every read is 1e-4 s after the last, so each step takes what
    the test's latency profile says a plain step takes, whatever else the machine runs (a step slowed by a
    competing process would otherwise teach the sizing that trees do not pay)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-4
        return self.now


def test_history_alone_sizes_chains_with_the_cost_policy(monkeypatch):
    """Cost sizing without a draft prices no draft forward and proposes chains (K = 1); speculation
    is off at first (one plain step anchors the timing) and on once the curve says it pays."""
    monkeypatch.setattr(decode, "time", StepClock())
    policy, _unused, prompts = trained_pair()
    profile = LatencyProfile("test", LatencyCurve((1, 64), (1e-4, 1.2e-4)), None)
    spec = generate(policy, prompts, num_samples=3, sampling=GREEDY, draft=Speculation(None, "cost", profile=profile,
                                                                                     history=HistoryDrafts()))
    assert spec.stats.tree_sizes[0] == 1 and max(spec.stats.tree_sizes) > 1
    assert_same_completions(generate(policy, prompts, num_samples=3, sampling=GREEDY), spec)
    # The policy object learns from timed tree steps: a finite time scale (a one-point zero draft
    # curve once made it NaN, which kept speculation off for good).
    sizing = make_sizing("cost", profile=history_profile(profile), **history_sizing_options("cost"))
    history = HistoryDrafts()
    for _round in range(3):
        spec = generate(policy, prompts, num_samples=3, sampling=GREEDY, draft=Speculation(None, sizing, history=history))
    assert sizing.num_timed["tree"] > 0 and math.isfinite(sizing.tree_scale)
    assert_same_completions(generate(policy, prompts, num_samples=3, sampling=GREEDY), spec)
    with pytest.raises(ValueError, match="draft curve"):
        make_sizing("cost", profile=profile)


class Alternating(FixedSizing):
    """A fixed shape whose predicted gain alternates high and low from step to step."""

    def __init__(self, shape):
        super().__init__(shape)
        self.calls = 0

    def predicted_gain(self, num_live):
        self.calls += 1
        return 3.0 if self.calls % 3 else 0.5


def mixed_speculation(draft, history):
    """Merged speculation whose steps mix chains alone (no draft forward: the draft lags behind) and
    neural trees with chains merged in."""
    return Speculation(draft, MergedSizing(FixedSizing(TreeShape(2, 3, 7)), Alternating(TreeShape(1, 5, 6))),
                       history=history)


def test_merged_steps_of_both_kinds_equal_greedy_plain():
    policy, trained, prompts = trained_pair()
    plain = generate(policy, prompts, num_samples=3, sampling=GREEDY)
    history = HistoryDrafts(min_match=1)
    for _round in range(2):
        spec = generate(policy, prompts, num_samples=3, sampling=GREEDY, draft=mixed_speculation(trained, history))
        assert_same_completions(plain, spec)
    assert {6, 1 + 6 + 3}.issubset(set(spec.stats.tree_sizes))  # chains alone, and neural trees + one chain


@pytest.mark.parametrize("case", ["T1", "T0.7-top_p0.9"])
def test_distribution_of_merged_steps_of_both_kinds_is_the_policys(case):
    policy, trained, _ = trained_pair(V, sharpness=1.5)
    prompt = torch.tensor([1, 5, 2, 7])
    sampling = CASES[case]
    history = HistoryDrafts(min_match=1)
    generate(policy, [prompt] * 1000, num_samples=8, sampling=sampling, seed=2, draft=mixed_speculation(trained, history))
    spec = generate(policy, [prompt] * 1000, num_samples=8, sampling=sampling, seed=1,
                    draft=mixed_speculation(trained, history))
    samples = torch.stack([t[:3] for t in spec.tokens])
    pvalue = chi_square_pvalue(joint_counts(samples, V), exact_first_three(policy, prompt, sampling))
    assert pvalue > 1e-3, f"merged speculative rollouts differ from the policy (p={pvalue:.2e})"
    assert spec.stats.mean_accepted_length > 1.15


def test_merged_cost_sizing_runs_the_chains_alone_where_they_beat_the_neural_trees(monkeypatch):
    """A random draft with history at greedy on recurring prompts (the store holds an earlier rollout's
    text): the history's policy learns its chains are accepted whole, predicts more from them than
    the neural policy from its trees, and the merged speculation runs chains alone."""
    monkeypatch.setattr(decode, "time", StepClock())
    policy, _unused, prompts = trained_pair()
    history = HistoryDrafts()
    generate(policy, prompts, num_samples=3, sampling=GREEDY, draft=Speculation(None, FixedSizing(TreeShape(1, 1, 2)),
                                                                                history=history))
    curve = LatencyCurve((1, 128), (1e-4, 1.2e-4))
    profile = LatencyProfile("test", curve, LatencyCurve((1, 128), (2e-5, 3e-5)))
    speculation = Speculation(DraftHead(policy), "cost", profile=profile, history=history)
    sizing = speculation_module.resolve_sizing(speculation, policy, prompts, GREEDY)
    assert isinstance(sizing, MergedSizing)
    speculation.sizing = sizing  # one policy object across rollouts, as a trainer keeps it
    plain = generate(policy, prompts, num_samples=3, sampling=GREEDY)
    for _round in range(3):
        spec = generate(policy, prompts, num_samples=3, sampling=GREEDY, draft=speculation)
        assert_same_completions(plain, spec)
    assert sizing.history.acceptance()[0, 0] > 0.8
    assert sizing.history.predicted_gain(12) > sizing.neural.predicted_gain(12)
    assert spec.stats.num_forwards < 0.5 * plain.stats.num_forwards


def test_a_speculation_without_draft_or_history_is_refused():
    policy, _unused, prompts = trained_pair()
    with pytest.raises(ValueError, match="DraftHead"):
        generate(policy, prompts, num_samples=1, sampling=GREEDY, draft=Speculation(None))
    with pytest.raises(ValueError, match="HistoryDrafts"):
        generate(policy, prompts, num_samples=1, sampling=GREEDY, draft=Speculation(None, history="suffix"))
    with pytest.raises(ValueError, match="min_match"):
        HistoryDrafts(min_match=9)

