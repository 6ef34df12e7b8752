"""Speculative rollouts of hybrid models with a neural draft head: its body is Llama layers of the policy's width
(``speculative.draft_body``), it proposes one chain per row (its top path; a history chain instead where that runs as
deep), verified by the chain machinery history chains use, the recurrent states rolled back to the accepted length.
Lossless: greedy equals plain greedy, sampler log-probs are the trainer's, the first tokens follow the policy's law,
and a wrong rollback fails that test."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from tests.mixers.conftest import build_hybrid, float64_throughout  # noqa: F401 (a fixture)
from tests.rollout.conftest import random_prompts
from tests.speculative.speculative_helpers import chi_square_pvalue, joint_counts
from tests.speculative.test_hybrid_chains import assert_conversation_logprobs_are_plain, commit_one_token_too_many
from tests.speculative.test_decode import CASES, V, assert_same_completions, exact_first_three
from turbogrpo import completion_logprobs
from turbogrpo.config import DraftLearningConfig
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.draft_training import draft_groups, train_draft
from turbogrpo.speculative.history import HistoryDrafts, full_chain_or_neural
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.speculation import Speculation
from turbogrpo.speculative.tree import TreeShape, chain_shape, chain_tree

VOCAB = 16
SHAPE = TreeShape(2, 3, 7)   # a tree for an attention model; the draft's top path of 3 for a hybrid


def speculation(draft: DraftHead, history: HistoryDrafts | None = None, shape: TreeShape = SHAPE) -> Speculation:
    return Speculation(draft, FixedSizing(shape), history=history)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_greedy_with_neural_chains_equals_greedy_plain(model_type, float64_throughout):
    model = build_hybrid(model_type, torch.float64, vocab_size=VOCAB)
    draft = DraftHead(model)
    assert all(type(layer) is LlamaDecoderLayer for layer in draft.layers)   # attention, whatever the policy's layers
    prompts = random_prompts([4, 11, 7], vocab_size=VOCAB, seed=1)
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    plain = generate(model, prompts, num_samples=2, sampling=sampling)
    spec = generate(model, prompts, num_samples=2, sampling=sampling, draft=speculation(draft))
    assert_same_completions(plain, spec)
    assert set(spec.stats.tree_sizes) == {SHAPE.depth + 1}   # one chain per row, every step
    history = HistoryDrafts(min_match=1)
    for _round in range(2):   # the second round: history's whole chains instead of the draft's where they match
        merged = generate(model, prompts, num_samples=2, sampling=sampling, draft=speculation(draft, history))
        assert_same_completions(plain, merged)
    assert set(merged.stats.tree_sizes) == {SHAPE.depth + 1}
    assert merged.stats.num_forwards < spec.stats.num_forwards   # the store's text was drafted right


def test_sampler_logprobs_with_neural_chains_equal_the_trainers(float64_throughout):
    model = build_hybrid("lfm2", torch.float64, vocab_size=VOCAB)
    rollout = generate(model, random_prompts([5, 9], vocab_size=VOCAB, seed=2), num_samples=6, seed=3,
                       sampling=SamplingConfig(max_new_tokens=12, stop_token_ids=[3]),
                       draft=speculation(DraftHead(model, layout="eagle3")))   # the policy's layers tapped too
    assert max(rollout.stats.accepted_lengths) > 1 and "stop" in rollout.finish_reasons
    with torch.no_grad():
        trainer = completion_logprobs(model, rollout.prompts, rollout.tokens_per_group())
    for ours, theirs in zip(rollout.logprobs_per_group(), trainer):
        torch.testing.assert_close(torch.cat(ours).double(), torch.cat(theirs).double(), rtol=0, atol=1e-10)


def test_speculative_conversations_with_neural_chains_feed_replies_through_the_recurrence(float64_throughout):
    """Replies and the draft's chains (history's where they run as deep) in one forward."""
    assert_conversation_logprobs_are_plain(lambda model: speculation(DraftHead(model), HistoryDrafts(min_match=1)))


def trained_draft(model, prompt: torch.Tensor) -> DraftHead:
    """A draft trained on the hybrid's own completions of ``prompt`` (its features from the shared-prefix forward
    of the hybrid, ``draft_groups``), so that its chains are often accepted."""
    torch.manual_seed(0)
    draft = DraftHead(model)
    completions = generate(model, [prompt], num_samples=32, sampling=CASES["T1"], seed=5).tokens_per_group()
    train_draft(draft, draft_groups(model, [prompt], completions), DraftLearningConfig(lr=1e-2), num_epochs=20,
                batch_size=32)
    return draft


def first_three_tokens_pvalue() -> float:
    """Chi-square p-value of the first three tokens of 4,000 samples with the neural draft's chains against the
    policy's exact joint law at temperature 1."""
    model = build_hybrid("qwen3_5_text", torch.float32, vocab_size=V, seed=1, initializer_range=0.3)
    prompt = torch.tensor([1, 5, 2, 7])
    draft = trained_draft(model, prompt)
    spec = generate(model, [prompt] * 500, num_samples=8, sampling=CASES["T1"], seed=1, draft=speculation(draft))
    assert spec.stats.mean_accepted_length > 1.3   # chains really were accepted
    samples = torch.stack([t[:3] for t in spec.tokens])
    return chi_square_pvalue(joint_counts(samples, V), exact_first_three(model, prompt, CASES["T1"]))


def test_first_three_tokens_with_neural_chains_follow_the_policy():
    pvalue = first_three_tokens_pvalue()
    assert pvalue > 1e-3, f"speculative rollouts of a hybrid with a neural draft differ from the policy (p={pvalue:.2e})"


def test_neural_chains_rolled_back_to_the_wrong_state_fail_the_chi_square(monkeypatch):
    """The test has the power to see a wrong rollback (states committed one token past the accepted length)."""
    commit_one_token_too_many(monkeypatch)
    assert first_three_tokens_pvalue() < 1e-9


def test_a_hybrids_draft_copies_what_fits_and_names_the_rest(tmp_path):
    model = build_hybrid("qwen3_5_text", torch.float32, vocab_size=VOCAB)
    draft = DraftHead(model)
    with pytest.warns(UserWarning, match=r"^draft init_from_policy: .*q_proj.weight.*input_layernorm.weight"):
        copied = draft.init_from_policy()
    full_attention = model.model.layers[1]   # the Qwen3.5 layer with softmax attention (its q_proj is gated: wider)
    for name in ("self_attn.k_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
        torch.testing.assert_close(draft.layers[0].state_dict()[name], full_attention.state_dict()[name])
    assert copied == 6
    loaded = DraftHead.load(draft.save(tmp_path / "draft"), model)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), draft.state_dict().values()))


def test_a_step_shape_becomes_its_deepest_chain_and_history_replaces_the_drafts_chain_only_when_as_deep():
    assert chain_shape(TreeShape(4, 4, 16)) == TreeShape(1, 4, 5)
    assert chain_shape(TreeShape(2, 3, 3)) == TreeShape(1, 2, 3)   # within the shape's N - 1 nodes
    neural = chain_tree(torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3]]))
    history_B1L = torch.tensor([[[5, 6, 7]], [[5, -1, -1]]])   # row 1's match runs one token deep only
    merged = full_chain_or_neural(history_B1L, neural)
    assert merged.tokens.tolist() == [[9, 5, 6, 7], [9, 1, 2, 3]]
    assert torch.equal(merged.parents, neural.parents) and torch.equal(merged.ancestors, neural.ancestors)
