"""Speculative rollouts against the plain engine: greedy equality, edge cases, losslessness."""

import dataclasses
import functools

import pytest
import torch

from tests.speculative.speculative_helpers import chi_square_pvalue, joint_counts, tiny_policy, trained_pair
from turbogrpo.prefix.logprobs import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.speculative.decode import SpeculativeStats
from turbogrpo.speculative.speculation import Speculation, generate_speculative
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.tree import TreeShape

GREEDY = SamplingConfig(max_new_tokens=20, temperature=0.0)


def prompts_of(lengths, vocab_size=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (n,), generator=g) for n in lengths]


def speculate(policy, draft, prompts, sampling, shape=TreeShape(3, 4, 12), *, num_samples=2, seed=0, **kw):
    return generate_speculative(policy, prompts, num_samples=num_samples, sampling=sampling, seed=seed,
                                draft=Speculation(draft, FixedSizing(shape)), **kw)


def assert_same_completions(plain, spec):
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    assert spec.finish_reasons == plain.finish_reasons
    for a, b in zip(plain.logprobs, spec.logprobs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@functools.lru_cache(maxsize=None)
def models_and_drafts():
    policy, draft, _ = trained_pair()
    llama = tiny_policy("llama", seed=1, sharpness=6.0)
    mistral = tiny_policy("mistral", seed=2, sharpness=6.0, sliding_window=6)
    return {"qwen2-trained-draft": (policy, draft), "llama-random-draft": (llama, DraftHead(llama)),
            "mistral-window6-random-draft": (mistral, DraftHead(mistral))}


@pytest.mark.parametrize("name", ["qwen2-trained-draft", "llama-random-draft", "mistral-window6-random-draft"])
@pytest.mark.parametrize("shape", [TreeShape(1, 4, 5), TreeShape(3, 4, 12)])
def test_greedy_speculative_equals_greedy_plain(name, shape):
    policy, draft = models_and_drafts()[name]
    prompts = trained_pair()[2][:3]
    plain = generate(policy, prompts, num_samples=2, sampling=GREEDY)
    spec = speculate(policy, draft, prompts, GREEDY, shape)
    assert_same_completions(plain, spec)
    if name.endswith("trained-draft"):
        assert spec.stats.num_forwards < 0.8 * plain.stats.num_forwards  # the draft really was accepted


def test_stop_token_inside_accepted_paths_and_different_finishing_steps():
    policy, draft, prompts = trained_pair()
    reference = generate(policy, prompts, num_samples=1, sampling=GREEDY)
    stops = (int(reference.tokens[0][6]), int(reference.tokens[2][3]))
    sampling = SamplingConfig(max_new_tokens=20, temperature=0.0, stop_token_ids=stops)
    plain = generate(policy, prompts, num_samples=2, sampling=sampling)
    spec = speculate(policy, draft, prompts, sampling)
    assert_same_completions(plain, spec)
    assert "stop" in spec.finish_reasons and len(set(len(t) for t in spec.tokens)) > 1
    assert max(spec.stats.accepted_lengths) > 2
    sizes = spec.stats.live_batch_sizes
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_reached_mid_path(max_new_tokens):
    policy, draft, prompts = trained_pair()
    prompts = prompts[:2]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    plain = generate(policy, prompts, num_samples=2, sampling=sampling)
    spec = speculate(policy, draft, prompts, sampling, TreeShape(2, 6, 12))
    assert_same_completions(plain, spec)
    assert all(len(t) == max_new_tokens for t in spec.tokens)


def test_per_completion_limits_match_plain():
    policy, draft, prompts = trained_pair()
    prompts = prompts[:2]
    limits = [20, 3, 1, 11]
    plain = generate(policy, prompts, num_samples=2, sampling=GREEDY, max_new_tokens_per_completion=limits)
    spec = speculate(policy, draft, prompts, GREEDY, max_new_tokens_per_completion=limits)
    assert_same_completions(plain, spec)
    assert [len(t) for t in spec.tokens] == limits


def test_a_single_live_sequence():
    policy, draft, prompts = trained_pair()
    prompts = prompts[:1]
    plain = generate(policy, prompts, num_samples=1, sampling=GREEDY)
    spec = speculate(policy, draft, prompts, GREEDY, num_samples=1)
    assert_same_completions(plain, spec)
    assert set(spec.stats.live_batch_sizes) == {1}


class AlwaysWrongDraft(DraftHead):
    """Proposes one token (that greedy decoding never emits) at every node."""

    wrong_token = 0

    def logits(self, features):
        logits = torch.zeros(*features.shape[:-1], self.config.vocab_size, device=features.device)
        logits[..., self.wrong_token] = 10.0
        return logits


def test_an_always_wrong_draft_changes_nothing():
    policy, _, prompts = trained_pair()
    plain = generate(policy, prompts, num_samples=2, sampling=GREEDY)
    used = set(torch.cat(plain.tokens).tolist())
    draft = AlwaysWrongDraft(policy)
    draft.wrong_token = min(set(range(64)) - used)
    spec = speculate(policy, draft, prompts, GREEDY, TreeShape(1, 3, 4))
    assert_same_completions(plain, spec)
    assert set(spec.stats.accepted_lengths) == {1.0}
    assert spec.stats.num_forwards == plain.stats.num_forwards


def test_sampler_logprobs_and_hidden_are_the_policys():
    policy, draft, prompts = trained_pair()
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.8, top_k=20)
    spec = speculate(policy, draft, prompts, sampling, num_samples=3, return_hidden=True)
    logprobs, hidden = completion_logprobs(policy, spec.prompts, spec.tokens_per_group(), temperature=0.8,
                                           return_hidden=True)
    for ours, theirs in zip(spec.logprobs_per_group(), logprobs):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=0)
    for ours, theirs in zip(spec.hidden_per_group(), hidden):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = spec.stats
    assert isinstance(stats, SpeculativeStats)
    assert len(stats.tree_sizes) == len(stats.accepted_lengths) == len(stats.live_batch_sizes)
    assert stats.mean_accepted_length > 1.5


V = 8
CASES = {
    "T1": SamplingConfig(max_new_tokens=3, temperature=1.0),
    "T0.7-top_p0.9": SamplingConfig(max_new_tokens=3, temperature=0.7, top_p=0.9),
    "top_k5": SamplingConfig(max_new_tokens=3, top_k=5),
}


def exact_first_three(policy, prompt, sampling):
    """``[V, V, V]`` exact probabilities of the first three tokens from the policy's logits."""
    from turbogrpo.rollout.sampling import warp_logits
    firsts = torch.arange(V)
    pairs = torch.cartesian_prod(firsts, firsts)                                       # [V*V, 2]
    sequences = torch.cat([prompt.expand(V * V, -1), pairs], 1)
    with torch.no_grad():
        logits = policy(sequences).logits.double()
    probs = warp_logits(logits, sampling).softmax(-1)
    p1 = probs[0, len(prompt) - 1]                                                    # [V]
    p2 = probs[::V, len(prompt)]                                                      # [V(first), V]
    p3 = probs[:, len(prompt) + 1].view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("case,draft_kind,shape", [
    ("T1", "trained", TreeShape(3, 2, 6)), ("T1", "random", TreeShape(4, 1, 5)),
    ("T0.7-top_p0.9", "random", TreeShape(2, 3, 7)), ("top_k5", "trained", TreeShape(1, 3, 4)),
    ("T1", "trained-eagle3", TreeShape(3, 2, 6)), ("T0.7-top_p0.9", "random-eagle3", TreeShape(2, 3, 7)),
])
def test_end_to_end_distribution_is_the_policys(case, draft_kind, shape):
    layout = "eagle3" if draft_kind.endswith("eagle3") else "turbogrpo"
    eagle3 = {"layout": "eagle3", "ttt_steps": 2} if layout == "eagle3" else {}  # the other cases share one pair
    policy, trained, _ = trained_pair(V, sharpness=1.5, **eagle3)
    draft = trained if draft_kind.startswith("trained") else DraftHead(policy, layout=layout)
    prompt = torch.tensor([1, 5, 2, 7])
    sampling = CASES[case]
    spec = speculate(policy, draft, [prompt], sampling, shape, num_samples=8_000, seed=1)
    samples = torch.stack([t[:3] for t in spec.tokens])
    pvalue = chi_square_pvalue(joint_counts(samples, V), exact_first_three(policy, prompt, sampling))
    assert pvalue > 1e-3, f"speculative rollouts differ from the policy (p={pvalue:.2e})"
    if draft_kind.startswith("trained"):
        assert spec.stats.mean_accepted_length > 1.15


def restricted(policy, draft, token_ids):
    """``draft``'s weights, drafting from the vocabulary ``token_ids`` only."""
    small = DraftHead(policy, num_draft_tokens=len(token_ids))
    small.load_state_dict({**draft.state_dict(), "draft_token_ids": torch.tensor(token_ids)})
    return small


def test_a_draft_vocabulary_keeps_the_policys_distribution():
    policy, trained, _ = trained_pair(V, sharpness=1.5)
    draft = restricted(policy, trained, [0, 2, 3, 6])  # half the vocabulary can be proposed
    prompt = torch.tensor([1, 5, 2, 7])
    sampling = CASES["T1"]
    spec = speculate(policy, draft, [prompt], sampling, TreeShape(3, 2, 6), num_samples=8_000, seed=2)
    pvalue = chi_square_pvalue(joint_counts(torch.stack([t[:3] for t in spec.tokens]), V),
                               exact_first_three(policy, prompt, sampling))
    assert pvalue > 1e-3, f"speculative rollouts with a draft vocabulary differ from the policy (p={pvalue:.2e})"


def test_a_draft_vocabulary_drafts_only_its_tokens_and_greedy_is_unchanged():
    policy, trained, prompts = trained_pair()
    draft = restricted(policy, trained, list(range(0, 64, 2)))
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    plain = generate(policy, prompts, num_samples=1, sampling=greedy, seed=0)
    spec = speculate(policy, draft, prompts, greedy, num_samples=1)
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    logprobs = draft.draft_logprobs(torch.randn(3, 32))
    assert torch.isinf(logprobs[:, 1::2]).all() and torch.allclose(logprobs[:, ::2].logsumexp(-1), torch.zeros(3), atol=1e-5)


def test_a_draft_of_another_model_object_is_refused():
    policy, draft, prompts = trained_pair()
    other = tiny_policy(seed=5)
    with pytest.raises(ValueError, match="another model object"):
        generate_speculative(other, prompts, num_samples=1, sampling=GREEDY, draft=draft)
    with pytest.raises(ValueError, match="DraftHead"):
        generate_speculative(policy, prompts, num_samples=1, sampling=GREEDY, draft="eagle")


def test_draft_time_is_counted_only_when_the_draft_runs():
    policy, draft, prompts = trained_pair()
    spec = speculate(policy, draft, prompts[:2], GREEDY)
    assert spec.stats.num_draft_forwards > 0 and 0 < spec.stats.draft_seconds < spec.stats.wall_time_s
    off = generate_speculative(policy, prompts[:2], num_samples=2, sampling=GREEDY,
                               draft=Speculation(draft, "off"))
    assert off.stats.num_draft_forwards == 0 and off.stats.draft_seconds == 0.0


def test_a_bare_draft_head_and_the_engine_import_nothing_speculative():
    """generate(draft=...) takes a Speculation (duck-typed make_step), generate_speculative also a bare
    DraftHead; the rollout package itself never imports turbogrpo.speculative (no import cycle)."""
    import subprocess
    import sys

    code = ("import sys, turbogrpo.rollout, turbogrpo.rollout.decode; "
            "print(any(m.startswith('turbogrpo.speculative') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    policy, draft, prompts = trained_pair()
    plain = generate(policy, prompts[:2], num_samples=1, sampling=GREEDY)
    bare = generate_speculative(policy, prompts[:2], num_samples=1, sampling=dataclasses.replace(GREEDY), draft=draft)
    assert_same_completions(plain, bare)
    with pytest.raises(ValueError, match=r"draft must be a turbogrpo.speculative.Speculation .*got DraftHead; wrap"):
        generate(policy, prompts[:2], num_samples=1, sampling=GREEDY, draft=draft)


def test_the_draft_vocabularys_head_rows_follow_the_policys_updates():
    policy, trained, _ = trained_pair()
    draft = restricted(policy, trained, list(range(0, 64, 2)))
    features = torch.randn(3, 32)
    before = draft.draft_logprobs(features)
    assert torch.equal(draft.draft_logprobs(features), before)  # the kept rows give the same values
    with torch.no_grad():
        policy.get_output_embeddings().weight[2].add_(1.0)     # an optimizer-style in-place update
    after = draft.draft_logprobs(features)
    head = policy.get_output_embeddings().weight[0::2]
    expected = (features @ head.T).float().log_softmax(-1)
    torch.testing.assert_close(after[:, ::2], expected)
    assert not torch.equal(after, before)
    draft.set_draft_tokens(torch.arange(1, 64, 2))             # new ids: the rows are gathered again
    torch.testing.assert_close(draft.draft_logprobs(features)[:, 1::2],
                               (features @ policy.get_output_embeddings().weight[1::2].T).log_softmax(-1))


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.enable_grad])
def test_a_speculative_rollout_under_inference_mode_or_grad_equals_one_under_no_grad(mode):
    policy, draft = models_and_drafts()["qwen2-trained-draft"]
    prompts = trained_pair()[2][:2]
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    with torch.no_grad():
        reference = speculate(policy, draft, prompts, sampling, seed=4)
    with mode():
        ours = speculate(policy, draft, prompts, sampling, seed=4)
    assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in reference.tokens]
    assert all(torch.equal(a, b) and not a.is_inference() for a, b in zip(ours.logprobs, reference.logprobs))
