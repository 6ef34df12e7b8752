"""The draft head: ownership of parameters, save/load, training, and the CLI's data path."""

from dataclasses import replace

import pytest
import torch

from tests.speculative.speculative_helpers import tiny_policy
from turbogrpo.batch import Groups
from turbogrpo.config import DraftLearningConfig
from turbogrpo.speculative.draft import CausalPlan, DraftHead, shift_features
from turbogrpo.speculative.draft_training import (DraftGroup, DraftTrainConfig, draft_groups, draft_loss,
                                                  num_trained, pack_draft_batch, prompt_features, train_draft)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_draft_owns_only_its_body_and_references_the_policy(arch):
    policy = tiny_policy(arch)
    draft = DraftHead(policy, num_layers=2)
    own = {id(p) for p in draft.parameters()}
    assert not own & {id(p) for p in policy.parameters()}
    assert not any(k.startswith(("policy", "embed", "lm_head")) for k in draft.state_dict())
    assert draft.policy.lm_head is policy.lm_head
    assert draft.policy.embed_tokens is policy.model.embed_tokens
    assert type(draft.layers[0]) is type(policy.model.layers[0]) and len(draft.layers) == 2
    ids = torch.randint(64, (2, 5))
    features = torch.randn(2, 5, 32)
    out = draft(features, ids, torch.arange(5).expand(2, 5), CausalPlan())
    assert out.shape == (2, 5, 32) and draft.logits(out).shape == (2, 5, 64)


def test_save_load_roundtrip(tmp_path):
    policy = tiny_policy()
    draft = DraftHead(policy)
    draft.save(tmp_path / "d")
    loaded = DraftHead.load(tmp_path / "d", policy)
    ids, feats, pos = torch.randint(64, (1, 4)), torch.randn(1, 4, 32), torch.arange(4)[None]
    torch.testing.assert_close(loaded(feats, ids, pos, CausalPlan()), draft(feats, ids, pos, CausalPlan()),
                               rtol=0, atol=0)


def test_a_draft_vocabulary_is_chosen_by_frequency_and_saved(tmp_path):
    from turbogrpo.commands.draft_build import choose_draft_tokens
    policy = tiny_policy()
    draft = DraftHead(policy, num_draft_tokens=3)
    coverage = choose_draft_tokens(draft, torch.tensor([5, 5, 5, 3, 3, 7, 9, 1]))  # 7, 9, 1 tie: lowest id
    assert draft.draft_token_ids.tolist() == [1, 3, 5] and coverage == pytest.approx(6 / 8)
    draft.save(tmp_path / "d")
    loaded = DraftHead.load(tmp_path / "d", policy)
    assert loaded.config.num_draft_tokens == 3 and loaded.draft_token_ids.tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="distinct"):
        draft.set_draft_tokens(torch.tensor([1, 1, 2]))


def test_load_rejects_a_draft_of_another_policy(tmp_path):
    DraftHead(tiny_policy()).save(tmp_path / "d")
    with pytest.raises(ValueError, match="hidden_size"):
        DraftHead.load(tmp_path / "d", tiny_policy(hidden_size=48))
    with pytest.raises(ValueError, match="draft_config.json"):
        DraftHead.load(tmp_path / "missing", tiny_policy())


def test_a_draft_whose_config_does_not_match_its_weights_is_named(tmp_path):
    policy = tiny_policy()
    DraftHead(policy, num_layers=2).save(tmp_path / "d")
    config_file = tmp_path / "d" / "draft_config.json"
    config_file.write_text(config_file.read_text().replace('"num_layers": 2', '"num_layers": 1'))
    with pytest.raises(ValueError, match=r"draft '.*d': draft.safetensors does not match draft_config.json \(1 "
                                         r"layers for this policy\): unexpected layers.1.*; save the two files"):
        DraftHead.load(tmp_path / "d", policy)
    config_file.write_text('{"num_layers": 1, "colour": "red"}')
    with pytest.raises(ValueError, match=r"draft config '.*draft_config.json' is not valid \(.*colour"):
        DraftHead.load(tmp_path / "d", policy)
    config_file.write_text('{"num_layers": ')
    with pytest.raises(ValueError, match=r"draft config '.*draft_config.json' is not valid"):
        DraftHead.load(tmp_path / "d", policy)


def test_a_truncated_draft_file_is_named(tmp_path):
    policy = tiny_policy()
    DraftHead(policy).save(tmp_path / "d")
    weights = tmp_path / "d" / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"draft weights '.*draft.safetensors' are truncated or corrupt"):
        DraftHead.load(tmp_path / "d", policy)


def test_a_model_without_rotary_decoder_layers_gets_no_draft():
    from tests.prefix.conftest import build_gpt2
    with pytest.raises(ValueError, match=r"model type 'gpt2' has no rotary-position decoder layers .* set "
                                         r"rollout.speculation = \"off\""):
        DraftHead(build_gpt2())


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="num_layers"):
        DraftHead(tiny_policy(), num_layers=0)
    with pytest.raises(ValueError, match="config key 'draft.lr'"):
        train_draft(DraftHead(tiny_policy()), [], DraftLearningConfig(lr=0))
    with pytest.warns(DeprecationWarning, match="DraftLearningConfig"):
        old = DraftTrainConfig(lr=3e-3, num_epochs=2, batch_size=4)  # deprecated, kept for one release
    assert (old.lr, old.num_epochs, old.batch_size, old.feature_weight) == (3e-3, 2, 4, 1.0)


def test_features_are_shifted_by_one_position():
    features = torch.arange(6.0).view(1, 3, 2)
    assert shift_features(features).tolist() == [[[0, 0], [0, 1], [2, 3]]]


def test_training_lowers_the_loss_and_leaves_the_policy_alone():
    policy = tiny_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(64, (6,), generator=g) for _ in range(4)]
    completions = [[torch.randint(64, (12,), generator=g) for _ in range(4)] for _ in prompts]
    examples = draft_groups(policy, prompts, completions)
    assert examples.sizes == (4,) * 4 and [len(f) for f in examples.hidden] == [13] * 16
    assert examples.prompt_hidden[0].shape == (6, 32) and num_trained(examples.group(0)) == 4 * 12
    draft = DraftHead(policy)
    config = DraftLearningConfig(lr=3e-3)
    with torch.no_grad():
        start = draft_loss(draft, examples, config)[1]
    history = train_draft(draft, examples, config, num_epochs=10, batch_size=8)
    with torch.no_grad():
        end = draft_loss(draft, examples, config)[1]
    assert len(history) == 20
    assert end["loss"] < 0.8 * start["loss"] and end["feature_loss"] < start["feature_loss"]
    assert end["top1_agreement"] > start["top1_agreement"] + 0.1
    assert all(p.grad is None for p in policy.parameters())
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_offline_features_are_the_policys_own_forward_over_each_sequence():
    """draft_groups' shared-prefix features equal a plain causal forward over prompt + completion."""
    policy = tiny_policy()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(64, (n,), generator=g) for n in (4, 7)]
    completions = [[torch.randint(64, (s,), generator=g) for s in (3, 5)] for _ in prompts]
    groups = draft_groups(policy, prompts, completions)
    for prompt, prompt_hidden, group, hidden in zip(groups.prompts, groups.prompt_hidden, groups.nested(),
                                                    groups.split(groups.hidden)):
        for completion, features in zip(group, hidden):
            full = prompt_features(policy, [torch.cat([prompt, completion])])[0]
            torch.testing.assert_close(features, full[len(prompt) - 1:], atol=2e-5, rtol=0)
            torch.testing.assert_close(prompt_hidden, full[:len(prompt)], atol=2e-5, rtol=0)


def test_packed_batch_trains_each_token_whose_next_feature_is_known():
    """Hand-built group: a rollout-style completion (S features) trains S - 1 tokens, a full one S."""
    prompt = torch.tensor([1, 2, 3])
    feats = torch.arange(3 * 2.0).view(3, 2)
    rollout_style = Groups([prompt], [torch.tensor([4, 5, 6])], [1], hidden=[torch.tensor([[10., 0], [11, 0], [12, 0]])],
                           prompt_hidden=[feats])
    batch = pack_draft_batch(rollout_style, requires_grad=False)
    assert batch.tokens_T.tolist() == [1, 2, 3, 4, 5]            # the last token has no target: cut
    assert batch.positions_T.tolist() == [0, 1, 2, 3, 4]
    assert batch.features_TH[:, 0].tolist() == [0, 0, 2, 10, 11]  # f[s-1]: shifted prompt, then f[P-1+j]
    assert batch.targets_MH[:, 0].tolist() == [11, 12]
    full = replace(rollout_style, hidden=[torch.tensor([[10., 0], [11, 0], [12, 0], [13, 0]])])
    assert pack_draft_batch(full, requires_grad=False).targets_MH[:, 0].tolist() == [11, 12, 13]


def test_the_deprecated_draft_group_is_a_one_group_batch():
    prompt, feats = torch.tensor([1, 2, 3]), torch.zeros(3, 2)
    with pytest.warns(DeprecationWarning, match="DraftGroup is deprecated"):
        group = DraftGroup(prompt, feats, [torch.tensor([4, 5])], [torch.zeros(3, 2)])
    assert group.sizes == (1,) and group.prompt_hidden[0] is feats and num_trained(Groups.concat([group, group])) == 4


def test_prompt_features_share_a_common_prefix_exactly():
    policy = tiny_policy()
    g = torch.Generator().manual_seed(2)
    preamble = torch.randint(64, (9,), generator=g)
    prompts = [torch.cat([preamble, torch.randint(64, (n,), generator=g)]) for n in (1, 4, 2)]
    shared = prompt_features(policy, prompts)
    for prompt, features in zip(prompts, shared):
        alone = prompt_features(policy, [prompt, torch.tensor([5, 6])])[0]   # no common prefix: padded path
        torch.testing.assert_close(features, alone, atol=2e-5, rtol=0)


def test_draft_vocabulary_loss_is_the_policys_distribution_renormalised_over_it():
    """With a draft vocabulary the loss reads only its head rows: the target is the policy's distribution
    renormalised over those tokens, and the draft's log-probs are drafting's own (``draft_logprobs``)."""
    policy = tiny_policy()
    draft = DraftHead(policy, num_draft_tokens=8)
    draft.set_draft_tokens(torch.tensor([0, 3, 5, 9, 17, 30, 41, 63]))
    features = torch.randn(5, 32)
    full_probs = draft.logits(features).softmax(-1)[:, draft.draft_token_ids]
    torch.testing.assert_close(draft.vocabulary_logits(features).softmax(-1), full_probs / full_probs.sum(-1, keepdim=True))
    torch.testing.assert_close(draft.vocabulary_logits(features).log_softmax(-1),
                               draft.draft_logprobs(features)[:, draft.draft_token_ids])
    # draft_loss reads those rows only: head rows outside the vocabulary do not move it.
    g = torch.Generator().manual_seed(2)
    groups = draft_groups(policy, [torch.randint(64, (5,), generator=g)], [[torch.randint(64, (7,), generator=g)]])
    config = DraftLearningConfig()
    with torch.no_grad():
        before = draft_loss(draft, groups, config)[1]["logit_loss"]
        outside = torch.ones(64, dtype=torch.bool)
        outside[draft.draft_token_ids] = False
        policy.lm_head.weight[outside] += 5.0
        after = draft_loss(draft, groups, config)[1]["logit_loss"]
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_build_keeps_its_samples_and_holds_prompts_out(tmp_path, monkeypatch):
    """train_on_own_completions samples once into its samples file and reads it back on a rebuild (same
    completions, no sampling); the held-out groups are measured every epoch and never trained on."""
    from turbogrpo.commands import draft_build as build
    from turbogrpo.speculative.built_drafts import DraftRecipe

    policy = tiny_policy()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(64, (5,), generator=g) for _ in range(4)]
    recipe = DraftRecipe(num_prompts=4, num_samples=2, max_new_tokens=6, epochs=2, batch_size=2,
                         num_draft_tokens=16, validation_prompts=1)
    samples = tmp_path / "samples" / "s.safetensors"
    trained_on = []
    from turbogrpo.speculative import draft_training

    real_train = draft_training.train_draft

    def spy(draft, groups, config, **kwargs):
        trained_on.append([p.tolist() for p in groups.prompts])
        return real_train(draft, groups, config, **kwargs)

    monkeypatch.setattr(draft_training, "train_draft", spy)
    record = build.train_on_own_completions(policy, DraftHead(policy, num_draft_tokens=16), prompts, [], recipe,
                                            samples=samples, log=lambda _: None)
    assert samples.is_file()
    assert record["num_held_out_prompts"] == 1 and len(record["per_epoch"]) == 2
    assert all(0 <= e["held_out_top1_agreement"] <= 1 and e["held_out_loss"] > 0 for e in record["per_epoch"])
    assert all(prompts[-1].tolist() not in seen for seen in trained_on) and len(trained_on) == 2
    acceptance = record["held_out_acceptance"]  # on the held-out group, depth 1..report_depth
    assert [row["depth"] for row in acceptance["by_depth"]] == [1, 2, 3, 4]
    assert 0 <= record["held_out_draft_token_coverage"] <= 1
    assert all(1 >= a >= b >= 0 for a, b in zip(acceptance["top1_accepted"], acceptance["top1_accepted"][1:]))
    first = build.read_samples(samples, prompts)
    assert [len(cs) for cs in first] == [2] * 4
    monkeypatch.setattr(build, "sample_completions", lambda *a, **k: pytest.fail("sampled again"))
    build.train_on_own_completions(policy, DraftHead(policy, num_draft_tokens=16), prompts, [], recipe,
                                   samples=samples, log=lambda _: None)
    assert build.read_samples(samples, prompts[::-1]) is None  # other prompts: not these samples
    samples.write_bytes(b"damaged")
    assert build.read_samples(samples, prompts) is None


def test_a_draft_with_weights_that_are_not_finite_is_never_saved(tmp_path):
    draft = DraftHead(tiny_policy())
    with torch.no_grad():
        next(p for p in draft.parameters() if p.requires_grad).view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=r"not saving the draft to .*: its weights are not finite \(inf/NaN in "):
        draft.save(tmp_path / "d")
    assert not (tmp_path / "d").exists()
