"""The draft's "eagle" layout and its export to vLLM's EAGLE drafter (``speculative/export_vllm.py``).

The exported folder is read back here the way vLLM's ``EagleLlamaForCausalLM`` (vllm 0.32,
``model_executor/models/llama_eagle.py``) reads it: ``fc`` without bias over ``[embed(x[t+1]), h[t]]``, the
folder's Llama layers (the first without ``input_layernorm``), no final norm, the target's LM head; the
layers are transformers' Llama layers built from the folder's config.json. That reference equals our
DraftHead in float64 (1e-10) on a Llama and on a Qwen2 (q/k/v biases) policy. The same comparison against
vLLM's own drafter inside a running engine is in tests/rollout/test_vllm_speculation.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.speculative.speculative_helpers import tiny_policy, trained_pair
from turbogrpo.config import DraftLearningConfig
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.speculative.draft import CausalPlan, DraftHead
from turbogrpo.speculative.draft_decoding import DraftKVCache, catch_up, draft_prompt_lengths, prefill_draft
from turbogrpo.speculative.draft_training import draft_groups, pack_draft_batch, train_draft
from turbogrpo.speculative.export_vllm import export_vllm_draft
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.speculation import Speculation, generate_speculative
from turbogrpo.speculative.tree import TreeShape


def policy_features(policy, tokens_n):
    """The policy's final post-norm hidden states ``[n, Hd]`` (the draft's features, vLLM's EAGLE input)."""
    with torch.no_grad():
        return policy(tokens_n[None], output_hidden_states=True).hidden_states[-1][0]


def vllm_eagle_reference(folder, policy, tokens_n, features_nH):
    """vLLM's EAGLE drafter (module docstring) from the exported ``folder``: its logits ``[n, V]`` for the pairs
    (h[t] = ``features_nH[t]``, x[t+1] = ``tokens_n[t]``) at positions t = 0..n-1, in float64."""
    config = LlamaConfig.from_pretrained(folder)
    config._attn_implementation = "sdpa"  # causal without a mask; eager's softmax is float32
    weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    assert set(weights) == {"fc.weight"} | {k for k in weights if k.startswith("layers.")}  # no head, no embeddings
    layers = []
    for i in range(config.num_hidden_layers):
        layer = LlamaDecoderLayer(config, layer_idx=i)
        if getattr(config, "qkv_bias", False):  # vLLM's Llama layer: q/k/v biases, none on o_proj (Qwen2's)
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(layer.self_attn, name)
                setattr(layer.self_attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        layer = layer.double()
        if i == 0:  # llama_eagle.py: the first layer has no input_layernorm
            layer.input_layernorm = nn.Identity()
        layer.load_state_dict({k.removeprefix(f"layers.{i}."): v for k, v in weights.items()
                               if k.startswith(f"layers.{i}.")}, strict=True)
        layers.append(layer)
    n = len(tokens_n)
    positions = torch.arange(n)[None]
    with torch.no_grad():
        embedded = policy.get_input_embeddings()(tokens_n[None]).double()
        hidden = torch.cat([embedded, features_nH[None].double()], -1) @ weights["fc.weight"].T
        rotary = LlamaRotaryEmbedding(config)(hidden, positions)
        for layer in layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return hidden[0] @ policy.lm_head.weight.double().T


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_exported_folder_is_the_drafts_function_in_vllms_eagle_form(tmp_path, arch):
    policy = tiny_policy(arch, seed=4, sharpness=4.0).double()
    draft = DraftHead(policy, num_layers=2, layout="eagle")
    with torch.no_grad():  # a random draft with visible weights everywhere (HF initialises norms to 1, biases to 0)
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = export_vllm_draft(draft, tmp_path / "eagle")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 2 and config.get("qkv_bias", False) == (arch == "qwen2")
    x = torch.randint(64, (12,), generator=torch.Generator().manual_seed(0))
    f = policy_features(policy, x)
    # Ours: pairs (f[s-1], x[s]) for s = 1..n-1 at positions s - 1; vLLM's: (h[t], x[t+1]) at t.
    with torch.no_grad():
        ours = draft.logits(draft(f[None, :-1], x[None, 1:], torch.arange(11)[None], CausalPlan()))[0]
    reference = vllm_eagle_reference(folder, policy, x[1:], f[:-1])
    torch.testing.assert_close(ours, reference, atol=1e-10, rtol=0)
    assert not torch.allclose(ours[1:], ours[:-1])  # the positions really differ


def test_the_turbogrpo_layout_and_a_draft_vocabulary_are_refused_with_the_difference(tmp_path):
    policy = tiny_policy("llama", seed=1)
    with pytest.raises(ValueError, match=r"fuse has a bias.*no input_layernorm.*first prompt token's pair.*--layout eagle"):
        export_vllm_draft(DraftHead(policy), tmp_path / "a")
    with pytest.raises(ValueError, match="draft vocabulary of 8 tokens"):
        export_vllm_draft(DraftHead(policy, num_draft_tokens=8, layout="eagle"), tmp_path / "b")
    mistral = tiny_policy("mistral", seed=2, sliding_window=6)
    with pytest.raises(ValueError, match="'mistral' layer is not one"):
        export_vllm_draft(DraftHead(mistral, layout="eagle"), tmp_path / "c")
    windowed = tiny_policy("qwen2", seed=2, use_sliding_window=True, sliding_window=6)
    with pytest.raises(ValueError, match="sliding-window"):
        export_vllm_draft(DraftHead(windowed, layout="eagle"), tmp_path / "d")
    from tests.mixers.conftest import build_hybrid
    with pytest.raises(ValueError, match=r"the policy is a hybrid \('lfm2'\): its draft's chains run on turbogrpo's"):
        export_vllm_draft(DraftHead(build_hybrid("lfm2", torch.float32), layout="eagle"), tmp_path / "e")
    assert not any(tmp_path.iterdir())  # nothing written for a refused draft


def test_the_eagle_layout_has_vllms_parameters_and_survives_save_and_load(tmp_path):
    policy = tiny_policy("llama", seed=1)
    draft = DraftHead(policy, layout="eagle")
    names = set(draft.state_dict())
    assert "fuse.bias" not in names and "layers.0.input_layernorm.weight" not in names
    assert "fuse.bias" in DraftHead(policy).state_dict()
    loaded = DraftHead.load(draft.save(tmp_path), policy)
    assert loaded.layout.name == "eagle"
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)


def test_decoding_caches_skip_the_first_pair_as_the_one_shot_forward_does():
    """prefill + catch-up (the rollout's path) give the features of a causal forward over pairs s >= 1."""
    policy = tiny_policy("qwen2", seed=3)
    draft = DraftHead(policy, layout="eagle")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(64, (n,), generator=g) for n in (6, 9)]
    completions = [torch.randint(64, (4,), generator=g) for _ in prompts]
    cache = DraftKVCache(draft_prompt_lengths(draft, prompts), 1, capacity=8, device=torch.device("cpu"))
    assert draft_prompt_lengths(draft, prompts) == [5, 8]
    prompt_features = nn.utils.rnn.pad_sequence([policy_features(policy, p) for p in prompts], batch_first=True)
    full = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    full_features = [policy_features(policy, s) for s in full]
    with torch.no_grad():
        prefill_draft(draft, cache, prompts, prompt_features)
        pending_features = torch.stack([f[len(p) - 1:len(p) + 3] for f, p in zip(full_features, prompts)])
        root = catch_up(draft, cache, pending_features, torch.stack(completions), torch.tensor([4, 4]))
        for b, (sequence, features) in enumerate(zip(full, full_features)):
            n = len(sequence) - 1
            one_shot = draft(features[None, :-1], sequence[None, 1:], torch.arange(n)[None], CausalPlan())[0, -1]
            torch.testing.assert_close(root[b], one_shot, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        draft_prompt_lengths(draft, [torch.tensor([3])])


def test_an_eagle_draft_trains_skipping_the_first_pair_and_speculates_losslessly():
    policy, _, prompts = trained_pair()
    greedy = SamplingConfig(max_new_tokens=20, temperature=0.0)
    draft = DraftHead(policy, layout="eagle")
    completions = generate(policy, prompts, num_samples=4, sampling=SamplingConfig(max_new_tokens=20, temperature=0.7),
                           seed=0).tokens_per_group()
    groups = draft_groups(policy, prompts, completions)
    batch = pack_draft_batch(groups, requires_grad=False, context_start=1)
    assert batch.num_prompt_tokens == sum(len(p) - 1 for p in prompts)
    train_draft(draft, groups, DraftLearningConfig(lr=1e-2), num_epochs=25, batch_size=20)
    plain = generate(policy, prompts, num_samples=2, sampling=greedy)
    spec = generate_speculative(policy, prompts, num_samples=2, sampling=greedy, seed=0,
                                draft=Speculation(draft, FixedSizing(TreeShape(1, 4, 5))))
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    assert spec.stats.num_forwards < 0.8 * plain.stats.num_forwards  # the trained eagle draft is accepted
