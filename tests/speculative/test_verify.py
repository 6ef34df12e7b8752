"""Losslessness of tree acceptance on a table model: chi-square against the exact distribution."""

import pytest
import torch

from tests.speculative.speculative_helpers import (PROMPT, TableDraft, chi_square_pvalue, exact_joint, joint_counts,
                                                  node_logits, speculative_samples)
from turbogrpo.rollout.sampling import SamplingConfig, sample_tokens, warp_logits
from turbogrpo.speculative.tree import DraftTree, TreeShape, build_tree, chain_tree
from turbogrpo.speculative.verify import TreeVerdict, accept_paths, verify_tree

V = 8
NUM_SAMPLES = 20_000
T1 = SamplingConfig(max_new_tokens=8, temperature=1.0)
T07_TOP_P = SamplingConfig(max_new_tokens=8, temperature=0.7, top_p=0.9)
TOP_K5 = SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=5)
CHAIN = TreeShape(top_k=1, depth=3, num_nodes=4)
WIDE = TreeShape(top_k=4, depth=1, num_nodes=5)
BUSHY = TreeShape(top_k=2, depth=3, num_nodes=7)
TRIMMED = TreeShape(top_k=3, depth=2, num_nodes=6)


def tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(V, V, V, generator=g)
    good_draft = target + 0.3 * torch.randn(V, V, V, generator=g)
    random_draft = 1.5 * torch.randn(V, V, V, generator=g)
    return target, {"good": good_draft, "random": random_draft}


@pytest.mark.parametrize("sampling,draft,shape", [
    (T1, "good", CHAIN), (T1, "random", BUSHY), (T07_TOP_P, "good", BUSHY), (T07_TOP_P, "random", WIDE),
    (TOP_K5, "good", TRIMMED), (TOP_K5, "random", TRIMMED),
])
def test_first_three_tokens_match_the_policy(sampling, draft, shape):
    target, drafts = tables()
    samples = speculative_samples(target, drafts[draft], shape, sampling, num_samples=NUM_SAMPLES, seed=1)
    pvalue = chi_square_pvalue(joint_counts(samples, V), exact_joint(target, sampling))
    assert pvalue > 1e-3, f"speculative samples differ from the policy (p={pvalue:.2e})"


def test_good_draft_is_accepted_more_than_random():
    target, drafts = tables()
    gen = torch.Generator().manual_seed(0)
    lengths = {}
    for name, draft in drafts.items():
        from tests.speculative.speculative_helpers import TableDraft, node_logits
        cur = torch.randint(V, (4000,), generator=gen)
        prev = torch.randint(V, (4000,), generator=gen)
        tree = build_tree(cur, draft[prev, cur].log_softmax(-1), TableDraft(draft, cur), BUSHY)
        lengths[name] = verify_tree(tree, node_logits(target, tree, prev), T1, gen).num_accepted.float().mean()
    assert lengths["good"] > lengths["random"] + 0.3


def typical_acceptance(tree: DraftTree, target_logits, sampling, generator) -> TreeVerdict:
    """WRONG on purpose: accept a child whenever the policy gives it probability >= 0.1."""
    probs = warp_logits(target_logits, sampling).softmax(-1)
    draws = sample_tokens(target_logits, sampling, generator)
    plausible = probs.gather(1, tree.parents[:, :, None].expand(-1, -1, V)).gather(2, tree.tokens[:, :, None])
    forced = torch.where(plausible.squeeze(2) >= 0.1, tree.tokens, draws.gather(1, tree.parents))
    # Re-express "accept" as a draw matching the child, so the path walk is shared.
    draws = draws.scatter(1, tree.parents[:, 1:], forced[:, 1:])
    return accept_paths(tree, draws)


def unwarped_acceptance(tree: DraftTree, target_logits, sampling, generator) -> TreeVerdict:
    """WRONG on purpose: draws from the raw softmax, ignoring the plain sampler's top-k/top-p."""
    unwarped = SamplingConfig(max_new_tokens=8, temperature=sampling.temperature)
    return verify_tree(tree, target_logits, unwarped, generator)


@pytest.mark.parametrize("rule,sampling", [(typical_acceptance, T1), (unwarped_acceptance, TOP_K5)])
def test_wrong_acceptance_rules_fail_the_test(rule, sampling):
    target, drafts = tables()
    samples = speculative_samples(target, drafts["random"], CHAIN, sampling, num_samples=NUM_SAMPLES,
                                  seed=1, accept=rule)
    assert chi_square_pvalue(joint_counts(samples, V), exact_joint(target, sampling)) < 1e-6


@pytest.mark.parametrize("draft", ["good", "random"])
@pytest.mark.parametrize("shape", [CHAIN, BUSHY, WIDE])
def test_greedy_emits_the_greedy_sequence(draft, shape):
    target, drafts = tables()
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    samples = speculative_samples(target, drafts[draft], shape, greedy, num_samples=16, num_tokens=6)
    expected = list(PROMPT)
    for _ in range(6):
        expected.append(int(target[expected[-2], expected[-1]].argmax()))
    assert samples.tolist() == [expected[2:]] * 16


def test_greedy_accepts_while_child_is_argmax():
    # Root 0 -> 3 -> 5 -> 6 chain; the policy's argmax is 3 at the root, 5 after 3, then 1 (not 6).
    tree = chain_tree(torch.tensor([[0, 3, 5, 6]]))
    logits = torch.full((1, 4, V), -5.0)
    logits[0, 0, 3] = logits[0, 1, 5] = logits[0, 2, 1] = logits[0, 3, 2] = 5.0
    verdict = verify_tree(tree, logits, SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.path_nodes.tolist() == [[0, 1, 2, 2]]
    assert verdict.next_token.tolist() == [1]


def test_rejection_at_root_emits_the_draw_only():
    tree = chain_tree(torch.tensor([[0, 3, 5], [0, 4, 4]]))
    logits = torch.full((2, 3, V), -5.0)
    logits[:, 0, 7] = 5.0
    verdict = verify_tree(tree, logits, SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert verdict.num_accepted.tolist() == [0, 0]
    assert verdict.path_nodes.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert verdict.next_token.tolist() == [7, 7]
