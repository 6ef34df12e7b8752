"""Speculative rollouts of hybrid models: history drafts as one chain per row, the recurrent states kept after every
length of the chain and the accepted one committed (``turbogrpo.rollout.states``). Lossless: greedy equals plain
greedy, sampler log-probs are the trainer's, the first tokens follow the policy's own law, conversations too. The
neural draft's chains: test_hybrid_neural_chains.py."""

from collections.abc import Callable

import pytest
import torch

from tests.mixers.conftest import build_hybrid, float64_throughout  # noqa: F401 (a fixture)
from tests.rollout.conftest import forbid_host_syncs_inside, random_prompts
from tests.rollout.test_multiturn import Scripted, plain_logprobs
from tests.speculative.speculative_helpers import chi_square_pvalue, joint_counts
from tests.speculative.test_decode import CASES, V, assert_same_completions, exact_first_three
from turbogrpo import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.multiturn import TurnLimits, generate_multiturn
from turbogrpo.speculative import decode
from turbogrpo.speculative.history import HistoryDrafts
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.speculation import Speculation
from turbogrpo.speculative.tree import TreeShape

VOCAB = 16   # small, so that siblings' and earlier rollouts' text is often drafted right
SHAPE = TreeShape(2, 3, 7)   # two chains of 3 for an attention model; one chain of 3 for a hybrid


def speculation(history: HistoryDrafts, shape: TreeShape = SHAPE) -> Speculation:
    return Speculation(None, FixedSizing(shape), history=history)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_greedy_with_history_chains_equals_greedy_plain(model_type):
    model = build_hybrid(model_type, torch.float32, vocab_size=VOCAB)
    prompts = random_prompts([4, 11, 7], vocab_size=VOCAB, seed=1)
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    plain = generate(model, prompts, num_samples=2, sampling=sampling)
    history = HistoryDrafts(min_match=1)
    for _round in range(2):   # the second round finds the first one's text in the store: whole chains accepted
        spec = generate(model, prompts, num_samples=2, sampling=sampling, draft=speculation(history))
        assert_same_completions(plain, spec)
    assert max(spec.stats.tree_sizes) == SHAPE.depth + 1   # one chain per row
    assert spec.stats.num_forwards < 0.6 * plain.stats.num_forwards


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "falcon_h1"])
def test_sampler_logprobs_with_history_chains_equal_the_trainers(model_type, float64_throughout):
    model = build_hybrid(model_type, torch.float64, vocab_size=VOCAB)
    sampling = SamplingConfig(max_new_tokens=12, stop_token_ids=[3])
    prompts = random_prompts([5, 9], vocab_size=VOCAB, seed=2)
    history = HistoryDrafts(min_match=1)
    for seed in (3, 4):   # the second rollout drafts from the first one's text too
        rollout = generate(model, prompts, num_samples=6, sampling=sampling, seed=seed, draft=speculation(history))
    assert max(rollout.stats.accepted_lengths) > 1 and "stop" in rollout.finish_reasons   # chains accepted
    with torch.no_grad():
        trainer = completion_logprobs(model, rollout.prompts, rollout.tokens_per_group())
    for ours, theirs in zip(rollout.logprobs_per_group(), trainer):
        torch.testing.assert_close(torch.cat(ours).double(), torch.cat(theirs).double(), rtol=0, atol=1e-10)


def first_three_tokens_pvalue(model_type: str) -> float:
    """Chi-square p-value of the first three tokens of 4,000 speculative samples (history chains, a second rollout
    drafting from the first one's text) against the policy's exact joint law at temperature 1."""
    model = build_hybrid(model_type, torch.float32, vocab_size=V, seed=1, initializer_range=0.3)
    prompt = torch.tensor([1, 5, 2, 7])
    sampling = CASES["T1"]
    history = HistoryDrafts(min_match=1)
    generate(model, [prompt] * 500, num_samples=8, sampling=sampling, seed=2, draft=speculation(history))
    spec = generate(model, [prompt] * 500, num_samples=8, sampling=sampling, seed=1, draft=speculation(history))
    assert spec.stats.mean_accepted_length > 1.1   # chains really were accepted
    samples = torch.stack([t[:3] for t in spec.tokens])
    return chi_square_pvalue(joint_counts(samples, V), exact_first_three(model, prompt, sampling))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_first_three_tokens_with_history_chains_follow_the_policy(model_type):
    pvalue = first_three_tokens_pvalue(model_type)
    assert pvalue > 1e-3, f"speculative rollouts of a hybrid differ from the policy (p={pvalue:.2e})"


def commit_one_token_too_many(monkeypatch) -> None:
    """A wrong rollback: each row's states committed one token past what it kept (the first rejected draft token run
    into the recurrence and the convolution window)."""
    from turbogrpo.rollout.states import RecurrentStates
    commit = RecurrentStates.commit_lengths

    def one_token_too_many(self, num_kept_B):
        if self._pending_scan:   # a chain forward: its scan states after 0 .. n tokens, [B, n + 1, ...]
            chain_length = next(iter(self._pending_scan.values()))[0].shape[1] - 1
            num_kept_B = (num_kept_B + 1).clamp(max=chain_length)
        commit(self, num_kept_B)
    monkeypatch.setattr(RecurrentStates, "commit_lengths", one_token_too_many)


def test_a_chain_committing_the_state_of_a_rejected_token_fails_the_chi_square(monkeypatch):
    """The test has the power to see a wrong rollback."""
    commit_one_token_too_many(monkeypatch)
    assert first_three_tokens_pvalue("qwen3_5_text") < 1e-9


def assert_conversation_logprobs_are_plain(speculation_for: Callable[[torch.nn.Module], Speculation]) -> None:
    """Two turns of six conversations on a float64 Qwen3.5 speculating as ``speculation_for(model)`` says: each model
    token's sampler log-prob equals a plain forward of the whole conversation."""
    model = build_hybrid("qwen3_5_text", torch.float64, vocab_size=64)
    prompts = random_prompts([5, 9])
    replies = [[list(range(30, 41))[:1 + 2 * i], [40 + i] * (1 + i % 2)] for i in range(6)]
    out = generate_multiturn(model, prompts, [Scripted(r) for r in replies], num_samples=3,
                             sampling=SamplingConfig(max_new_tokens=12, stop_token_ids=list(range(0, 64, 7))),
                             limits=TurnLimits(12, 80, prefill_chunk=16), seed=0, draft=speculation_for(model))
    groups = out.groups
    assert sum(bool((~mask).any()) for mask in groups.model_mask) >= 3
    for i, (ids, mask, logps) in enumerate(zip(groups.completions, groups.model_mask, groups.sampler_logps)):
        reference = plain_logprobs(model, prompts[i // 3], ids)
        torch.testing.assert_close(logps[mask].double(), reference[mask].double(), rtol=0, atol=1e-6)


def test_speculative_conversations_feed_replies_through_the_recurrence(float64_throughout):
    """Reply chunks and chains in one forward, rows waiting for their environment committing nothing, replies longer
    than a tree cut into chunks of its size."""
    assert_conversation_logprobs_are_plain(lambda model: speculation(HistoryDrafts(min_match=1)))


def test_the_chain_step_never_syncs_with_the_host(monkeypatch):
    model = build_hybrid("nemotron_h", torch.float32, vocab_size=VOCAB)
    forbid_host_syncs_inside(monkeypatch, (decode, "verify_step"), (decode, "propose_history"))
    rollout = generate(model, random_prompts([4, 9], vocab_size=VOCAB), num_samples=4, seed=0,
                       sampling=SamplingConfig(max_new_tokens=10, stop_token_ids=[3]),
                       draft=speculation(HistoryDrafts(min_match=1)))
    assert max(rollout.stats.tree_sizes) > 1

