"""The "eagle3" draft layout (several policy layers), training-time test and the acceptance report.

Losslessness of eagle3 decoding is in ``test_decode.py`` (the chi-square cases "*-eagle3")."""

import pytest
import torch
import torch.nn.functional as F

from tests.speculative.speculative_helpers import tiny_policy, trained_pair
from turbogrpo.config import ConfigError, DraftLearningConfig
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.speculative.decode import TreeStep
from turbogrpo.speculative.draft import CausalPlan, DraftHead, eagle3_layers, shift_features
from turbogrpo.speculative.draft_acceptance import acceptance_by_depth
from turbogrpo.speculative.draft_training import draft_groups, draft_loss, pack_draft_batch
from turbogrpo.speculative.draft_unroll import STEP_DECAY, unrolled_draft_loss
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.speculation import Speculation, generate_speculative
from turbogrpo.speculative.tree import TreeShape

GREEDY = SamplingConfig(max_new_tokens=12, temperature=0.0)


def test_eagle3_reads_the_layers_eagle3_reads():
    assert eagle3_layers(30) == (1, 14, 26)   # SmolLM2-135M: the states entering layers 2, 15 and 27
    assert eagle3_layers(2) == (0, 1)         # few layers: clamped, distinct
    policy = tiny_policy(num_layers=6)
    draft = DraftHead(policy, layout="eagle3")
    assert draft.config.feature_layers == (1, 2) and draft.feature_width == 3 * 32
    assert draft.reduce.weight.shape == (32, 96) and draft.reduce.bias is None
    plain = DraftHead(policy)
    assert plain.config.feature_layers == () and plain.feature_width == 32 and not hasattr(plain, "reduce")


def test_offline_features_are_the_policys_hidden_states_at_those_layers():
    policy = tiny_policy(num_layers=6).double()
    draft = DraftHead(policy, layout="eagle3")
    prompt, completion = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])
    groups = draft_groups(policy, [prompt], [[completion]], draft=draft)
    with torch.no_grad():
        states = policy(torch.cat([prompt, completion])[None], output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is layer i's output; the last is the final (normed) state
    expected = torch.cat([states[i + 1][0] for i in draft.config.feature_layers] + [states[-1][0]], -1)
    torch.testing.assert_close(groups.prompt_hidden[0], expected[:5], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(groups.hidden[0], expected[4:], rtol=1e-10, atol=1e-10)


def test_decoding_reads_the_policys_layers_from_its_own_forwards(monkeypatch):
    """The features an eagle3 draft catches up on during a speculative rollout (plain and tree steps) are the
    policy's layer outputs at the positions that predicted each token, with no forward of their own."""
    policy = tiny_policy(num_layers=4, sharpness=6.0).double()
    draft = DraftHead(policy, layout="eagle3").double()
    kept = {}
    finish = TreeStep.finish

    def keep_then_finish(self, rollout):
        kept["tapped"] = self.tapped.tapped_NTX.clone()
        finish(self, rollout)
    monkeypatch.setattr(TreeStep, "finish", keep_then_finish)
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([2, 7])]
    rollout = generate_speculative(policy, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=10),
                                   seed=0, draft=Speculation(draft, FixedSizing(TreeShape(2, 2, 5))))
    assert not any(layer._forward_hooks for layer in policy.model.layers)  # the tap is gone
    layers = draft.config.feature_layers
    for n, (tokens, group) in enumerate(zip(rollout.tokens, [0, 0, 1, 1])):
        prompt = prompts[group]
        with torch.no_grad():
            states = policy(torch.cat([prompt, tokens])[None], output_hidden_states=True).hidden_states
        expected = torch.cat([states[i + 1][0] for i in layers], -1)[len(prompt) - 1:-1]  # predicted token j
        torch.testing.assert_close(kept["tapped"][n, :len(tokens)], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout", ["eagle3", "turbogrpo"])
def test_greedy_speculative_equals_greedy_plain(layout):
    eagle3 = {"layout": "eagle3", "ttt_steps": 2} if layout == "eagle3" else {}
    policy, draft, prompts = trained_pair(**eagle3)
    plain = generate(policy, prompts[:3], num_samples=2, sampling=GREEDY)
    spec = generate_speculative(policy, prompts[:3], num_samples=2, sampling=GREEDY,
                                draft=Speculation(draft, FixedSizing(TreeShape(3, 4, 12))))
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    assert spec.stats.mean_accepted_length > 1.5


def toy_data(policy, draft):
    prompt, completions = torch.tensor([3, 1, 4]), [torch.tensor([9, 2, 6, 5]), torch.tensor([8, 8])]
    return draft_groups(policy, [prompt], [completions], draft=draft)


def chain_prediction(draft, tokens, features, root, depth):
    """By hand, as decoding drafts: the draft's feature at root + depth - 1 for a chain from ``root``, the
    context up to the root fed the policy's features, each later node its parent's prediction; one causal
    forward per node over the explicit sequence."""
    inputs = draft.input_features(shift_features(features[None])[0][:root + 1])
    for node in range(depth):
        end = root + node + 1
        predicted = draft(inputs[None], tokens[None, :end], torch.arange(end)[None], CausalPlan())[0, -1]
        inputs = torch.cat([inputs, predicted[None]])
    return predicted


@pytest.mark.parametrize("layout", ["eagle3", "turbogrpo"])
def test_training_time_test_loss_is_the_hand_computed_chain_loss(layout):
    policy = tiny_policy(num_layers=4).double()
    torch.manual_seed(1)
    draft = DraftHead(policy, layout=layout).double()
    groups = toy_data(policy, draft)
    config = DraftLearningConfig(ttt_steps=3, feature_weight=1.0, logit_weight=0.1)
    loss, metrics = unrolled_draft_loss(draft, pack_draft_batch(groups, requires_grad=True, hidden_size=32), config)
    prompt = groups.prompts[0]
    total = 0.0
    for step in range(3):
        predicted, targets = [], []
        for completion, features in zip(groups.completions, groups.hidden):
            tokens = torch.cat([prompt, completion])
            feats = torch.cat([groups.prompt_hidden[0], features[1:]])    # f[s] for s < len(tokens)
            for j in range(len(completion)):  # every completion token is trained (its next feature is known)
                s = len(prompt) + j
                predicted.append(chain_prediction(draft, tokens, feats, s - step, step + 1))
                targets.append(features[j + 1, -32:])
        predicted, targets = torch.stack(predicted), torch.stack(targets)
        feature_loss = F.smooth_l1_loss(predicted, targets)
        cross_entropy = -(draft.logits(targets).softmax(-1) * draft.logits(predicted).log_softmax(-1)).sum(-1).mean()
        total = total + STEP_DECAY ** step * (feature_loss + 0.1 * cross_entropy)
    expected = total / sum(STEP_DECAY ** t for t in range(3))
    torch.testing.assert_close(loss, expected.float().to(loss.dtype), rtol=1e-6, atol=1e-8)
    assert set(metrics) >= {"loss", "top1_agreement", "top1_agreement_depth3"}


def test_one_unrolled_step_is_teacher_forcing():
    policy = tiny_policy(num_layers=4).double()
    draft = DraftHead(policy, layout="eagle3").double()
    groups = toy_data(policy, draft)
    config = DraftLearningConfig()
    unrolled, _ = unrolled_draft_loss(draft, pack_draft_batch(groups, requires_grad=True, hidden_size=32),
                                      DraftLearningConfig(ttt_steps=1))
    teacher, _ = draft_loss(draft, groups, config)
    torch.testing.assert_close(unrolled, teacher, rtol=1e-9, atol=1e-12)


def test_acceptance_at_depth_one_is_the_overlap_of_the_two_distributions():
    policy = tiny_policy(num_layers=4, sharpness=3.0).double()
    draft = DraftHead(policy).double()
    groups = toy_data(policy, draft)
    report = acceptance_by_depth(draft, groups, 2)
    # Depth 1 by hand: the teacher-forced prediction at each completion token with a known next token
    overlaps, top1 = [], []
    prompt = groups.prompts[0]
    for completion, features in zip(groups.completions, groups.hidden):
        tokens = torch.cat([prompt, completion])
        feats = torch.cat([groups.prompt_hidden[0], features[1:]])
        for j in range(len(completion) - 1):
            s = len(prompt) + j
            q = draft.logits(chain_prediction(draft, tokens, feats, s, 1)).softmax(-1)
            p = draft.logits(features[j + 1]).softmax(-1)
            overlaps.append(torch.minimum(p, q).sum().detach())
            top1.append(float(q.argmax() == completion[j + 1]))
    assert report["num_roots"][0] == len(overlaps)
    assert report["expected_acceptance"][0] == pytest.approx(float(torch.stack(overlaps).mean()), rel=1e-6)  # q in float32
    assert report["top1_accepted"][0] == pytest.approx(sum(top1) / len(top1))
    assert report["top1_accepted"][1] <= report["top1_accepted"][0]
    assert report["tokens_per_verification_sampled"] == pytest.approx(1 + sum(report["sampled_accepted"]))


def test_init_from_policy_copies_the_last_layer():
    policy = tiny_policy(num_layers=3)
    draft = DraftHead(policy, layout="eagle")  # its first layer drops the input norm: the rest is copied
    assert draft.init_from_policy() == len(policy.model.layers[-1].state_dict()) - 1
    for name, tensor in draft.layers[0].state_dict().items():
        torch.testing.assert_close(tensor, policy.model.layers[-1].state_dict()[name])


def test_save_load_keeps_the_layers_it_reads(tmp_path):
    policy = tiny_policy(num_layers=6)
    draft = DraftHead(policy, layout="eagle3")
    loaded = DraftHead.load(draft.save(tmp_path / "d"), policy)
    assert loaded.config == draft.config and torch.equal(loaded.reduce.weight, draft.reduce.weight)


def test_bad_settings_are_one_line_errors(tmp_path):
    from turbogrpo.speculative.built_drafts import DraftRecipe
    from turbogrpo.speculative.export_vllm import export_vllm_draft

    for settings, key in (({"ttt_steps": 0}, "draft.ttt_steps"), ({"ttt_steps": 2.5}, "draft.ttt_steps"),
                          ({"layout": "eagle4"}, "draft.layout"),
                          ({"init_from_policy": True, "path": "smollm2-gsm8k"}, "draft.")):
        with pytest.raises(ConfigError, match=key) as err:
            DraftLearningConfig(**settings).check("draft")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="--layout must be one of"):
        DraftRecipe(4, 2, 8, 1, 2, layout="eagle4").check()
    with pytest.raises(ValueError, match="--ttt-steps must be >= 1"):
        DraftRecipe(4, 2, 8, 1, 2, ttt_steps=0).check()
    policy = tiny_policy(num_layers=4)
    with pytest.raises(ValueError, match="reduces the policy's layers") as err:
        export_vllm_draft(DraftHead(policy, layout="eagle3"), tmp_path / "out")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="feature_layers"):
        DraftHead(policy, layout="turbogrpo", feature_layers=(1,))
    with pytest.raises(ValueError, match="runner"):
        TreeStep(DraftHead(policy, layout="eagle3"), FixedSizing(TreeShape(1, 2, 3)), runner="compiled")
