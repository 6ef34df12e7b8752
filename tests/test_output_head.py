"""Models whose forward transforms the LM head's logits (Granite divides by logits_scaling, Cohere multiplies by
logit_scale) score and sample exactly as their own forward everywhere, and a transform turbogrpo does not know
is refused by the load check at every entry point.

Every parity assertion compares against the model's own ``forward(...).logits`` in float64; a head without
the transform misses by ~0.1-0.4 nats (``test_a_head_without_the_transform_is_far_off``)."""

import pytest
import torch
from transformers import (CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                          LlamaForCausalLM)

from tests.prefix.conftest import full_precision_norms
from turbogrpo import output_head
from turbogrpo.output_head import LogitsHead, check_logits_head, logits_head, probe_difference
from turbogrpo.prefix import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.tree import build_trie, tree_logprobs

VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TRANSFORMED = {
    "granite": lambda: GraniteForCausalLM(GraniteConfig(logits_scaling=4.0, **SIZES)),
    "cohere": lambda: CohereForCausalLM(CohereConfig(logit_scale=0.25, **SIZES)),
}


class TripledLlama(LlamaForCausalLM):
    """A model whose forward transforms its logits in a way turbogrpo cannot know (x3)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out


def build(make, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = make().to(dtype).eval()
    if dtype == torch.float64:
        full_precision_norms(model)
    with torch.no_grad():   # larger logits than the default init, so that a missing transform shows plainly
        model.get_output_embeddings().weight.mul_(20)
    return model


def tripled():
    torch.manual_seed(0)
    return TripledLlama(LlamaConfig(**SIZES)).double().eval()


@pytest.fixture(params=sorted(TRANSFORMED))
def model(request):
    return build(TRANSFORMED[request.param])


def own_logprobs(model, sequence, targets_from):
    """log p(sequence[t]) for t >= targets_from, from the model's own forward."""
    with torch.no_grad():
        logits = model(sequence[None]).logits[0]
    return logits.log_softmax(-1)[targets_from - 1:-1].gather(-1, sequence[targets_from:, None]).squeeze(-1)


def groups(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (7, 4)]
    completions = [[torch.randint(3, VOCAB, (n,), generator=g) for n in ns] for ns in ([3, 5, 1], [6, 2])]
    return prompts, completions


@pytest.mark.parametrize("share_prefix", [True, False])
def test_completion_logprobs_equal_the_models_own_forward(model, share_prefix):
    prompts, completions = groups()
    got = completion_logprobs(model, prompts, completions, share_prefix=share_prefix, backend="cascade")
    for prompt, group, group_logps in zip(prompts, completions, got):
        for completion, logps in zip(group, group_logps):
            truth = own_logprobs(model, torch.cat([prompt, completion]), prompt.numel())
            torch.testing.assert_close(logps, truth, rtol=0, atol=1e-12)


def test_tree_logprobs_equal_the_models_own_forward(model):
    prompts, completions = groups()
    sequences = [torch.cat([p, c]) for p, cs in zip(prompts, completions) for c in cs]
    sequences.append(torch.cat([sequences[0], sequences[1][7:]]))   # shares a turn with sequence 0
    masks = [torch.arange(s.numel()) >= 4 for s in sequences]
    result = tree_logprobs(model, build_trie(sequences, masks))
    assert result.layout == "tree"
    truth = torch.cat([own_logprobs(model, s, 4) for s in sequences])
    torch.testing.assert_close(result.logps, truth, rtol=0, atol=1e-12)


def assert_sampler_logprobs_are_the_models(model, rollout, prompts, num_samples):
    for index, (tokens, logps) in enumerate(zip(rollout.tokens, rollout.logprobs)):
        prompt = prompts[index // num_samples]
        truth = own_logprobs(model, torch.cat([prompt, tokens]), prompt.numel())
        torch.testing.assert_close(logps, truth, rtol=0, atol=1e-12 if model.dtype == torch.float64 else 1e-4)


def test_the_samplers_logprobs_are_the_models_own(model):
    """In float64: the rollout's attention and its distribution run in the model's dtype (float32 at least)."""
    prompts = groups()[0]
    rollout = generate(model, prompts, num_samples=3, sampling=SamplingConfig(max_new_tokens=6), seed=0)
    assert_sampler_logprobs_are_the_models(model, rollout, prompts, 3)


def test_speculative_decoding_verifies_with_the_models_own_logits(model):
    """Greedy speculative equals greedy plain, and at temperature 1 the verifier's log-probs (and so its
    draws) are the model's own. The draft proposes from the transformed logits too."""
    from turbogrpo.speculative import DraftHead, generate_speculative
    prompts = groups()[0]
    draft = DraftHead(model).to(model.dtype)  # the draft in the policy's dtype (float64 here)
    hidden = torch.randn(3, model.config.hidden_size, dtype=model.dtype)
    torch.testing.assert_close(draft.logits(hidden), logits_head(model)(hidden), rtol=0, atol=0)
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    plain = generate(model, prompts, num_samples=2, sampling=greedy)
    spec = generate_speculative(model, prompts, num_samples=2, sampling=greedy, draft=draft)
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    sampled = generate_speculative(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=8),
                                   draft=draft, seed=1)
    assert_sampler_logprobs_are_the_models(model, sampled, prompts, 2)


def test_a_head_without_the_transform_is_far_off(model):
    """What the parity tests above guard against: the LM head alone misses by a tenth of a nat or more, and the
    load check refuses a model whose transform is not registered."""
    prompts, completions = groups()
    sequence = torch.cat([prompts[0], completions[0][1]])
    with torch.no_grad():
        hidden = model.get_decoder()(sequence[None]).last_hidden_state[0]
        bare = LogitsHead(model.get_output_embeddings(), ())(hidden).log_softmax(-1)
        transformed = logits_head(model)(hidden).log_softmax(-1)
    truth = model(sequence[None]).logits[0].log_softmax(-1)
    assert (bare - truth).abs().max() > 0.1
    torch.testing.assert_close(transformed, truth, rtol=0, atol=1e-12)


def test_the_load_check_refuses_a_known_family_whose_transform_is_not_registered(monkeypatch):
    monkeypatch.setattr(output_head, "LOGIT_TRANSFORMS", [])
    model = build(TRANSFORMED["granite"])
    assert probe_difference(model)[0] > 0.1
    with pytest.raises(ValueError, match=r"^model type 'granite' transforms its logits after the LM head in a way "
                                         r"turbogrpo does not know \(max \|diff\| [0-9.e+-]+ on a probe"):
        check_logits_head(model)


def test_the_load_check_runs_once_per_model(monkeypatch):
    model = build(TRANSFORMED["cohere"], dtype=torch.float32)
    check_logits_head(model)
    calls = []
    monkeypatch.setattr(output_head, "probe_difference", lambda m: calls.append(m) or (0.0, 0.0))
    prompts, completions = groups()
    completion_logprobs(model, prompts, completions)
    generate(model, prompts, num_samples=1, sampling=SamplingConfig(max_new_tokens=2))
    assert calls == []
    check_logits_head(build(TRANSFORMED["cohere"]))   # another model object is probed
    assert len(calls) == 1


def test_the_probe_leaves_training_mode_and_gradients_alone():
    model = build(TRANSFORMED["granite"]).train()
    model.model.layers[0].eval()
    check_logits_head(model)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert all(p.grad is None for p in model.parameters())


UNKNOWN = "model type 'llama' transforms its logits after the LM head in a way turbogrpo does not know"


@pytest.mark.parametrize("entry", ["completion_logprobs", "unshared", "tree_logprobs", "generate", "draft"])
def test_an_unknown_transform_is_refused_at_every_entry_point(entry):
    from turbogrpo.speculative import DraftHead
    model = tripled()
    prompts, completions = groups()
    calls = {
        "completion_logprobs": lambda: completion_logprobs(model, prompts, completions),
        "unshared": lambda: completion_logprobs(model, prompts, completions, share_prefix=False),
        "tree_logprobs": lambda: tree_logprobs(model, build_trie([torch.cat([prompts[0], completions[0][0]])],
                                                                 [torch.arange(10) >= 7])),
        "generate": lambda: generate(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=3)),
        "draft": lambda: DraftHead(model),
    }
    with pytest.raises(ValueError, match=UNKNOWN):
        calls[entry]()


def test_an_unknown_transform_stops_a_training_run_at_its_build(monkeypatch):
    from turbogrpo.config import LoraConfig, ModelConfig
    from turbogrpo.train import setup
    monkeypatch.setattr(setup, "load_model_and_tokenizer", lambda path, **_: (tripled(), None))
    from turbogrpo.train.precision import run_precision
    precision = run_precision("float32", False, torch.device("cpu"))
    with pytest.raises(ValueError, match=UNKNOWN):
        setup.load_policy(ModelConfig(path="tripled"), LoraConfig(), torch.device("cpu"), precision)


@pytest.fixture(scope="module")
def tokenizer():
    from turbogrpo.models import demo_model_path, load_model_and_tokenizer
    return load_model_and_tokenizer(demo_model_path())[1]


def trl_trainer(model, tokenizer, tmp_path, trainer_class=None):
    trl = pytest.importorskip("trl", minversion="1.16")
    from datasets import Dataset
    from turbogrpo.integrations.trl import SharedPrefixGRPOTrainer
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", seed=0,
                          num_generations=2, per_device_train_batch_size=2, max_completion_length=4, bf16=False,
                          beta=0.0)
    return (trainer_class or SharedPrefixGRPOTrainer)(
        model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args, train_dataset=Dataset.from_dict({"prompt": ["t1 t2"]}))


def test_the_trl_drop_in_shares_and_equals_the_models_own_forward(model, tokenizer, tmp_path):
    """The drop-in shares these models (it used to fall back) and gives the model's own float64 log-probs; TRL's
    own fused head applies the same transforms, in float32."""
    import trl
    trainer = trl_trainer(model, tokenizer, tmp_path)
    prompts, completions = groups()
    rows = [(p, c) for p, cs in zip(prompts, completions) for c in cs]
    width, keep = max(p.numel() for p, _ in rows), max(c.numel() for _, c in rows)
    input_ids = torch.zeros(len(rows), width + keep, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, (p, c) in enumerate(rows):   # TRL's layout: prompts left-padded, completions right-padded
        input_ids[r, width - p.numel():width], mask[r, width - p.numel():width] = p, 1
        input_ids[r, width:width + c.numel()], mask[r, width:width + c.numel()] = c, 1
    ours = trainer._get_per_token_logps_and_entropies(model, input_ids, mask, keep)[0]
    trls = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, keep)[0]
    assert trainer.shared_prefix_stats.num_shared_calls == 1 and trainer.shared_prefix_stats.num_fallback_calls == 0
    for r, (p, c) in enumerate(rows):
        truth = own_logprobs(model, torch.cat([p, c]), p.numel())
        torch.testing.assert_close(ours[r, :c.numel()], truth, rtol=0, atol=1e-12)
        torch.testing.assert_close(trls[r, :c.numel()].double(), truth, rtol=0, atol=1e-5)


def test_the_trl_drop_in_refuses_an_unknown_transform(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=UNKNOWN):
        trl_trainer(tripled(), tokenizer, tmp_path)
    import trl
    from turbogrpo.integrations.trl import enable_shared_prefix
    trainer = trl_trainer(tripled(), tokenizer, tmp_path / "patched", trainer_class=trl.GRPOTrainer)
    with pytest.raises(ValueError, match=UNKNOWN):
        enable_shared_prefix(trainer)


def test_the_transforms_run_inside_the_captured_decoding_step():
    """On CUDA the plain step runs as one torch.compile(fullgraph=True) graph (CUDA graphs); the "dynamo" runner
    captures the same graph on the CPU: the logits head's transforms must trace into it and give the eager draws."""
    from turbogrpo.rollout import DecodeSchedule
    model, prompts = build(TRANSFORMED["granite"], dtype=torch.float32), groups()[0]
    sampling = SamplingConfig(max_new_tokens=4)
    eager = generate(model, prompts, num_samples=2, sampling=sampling, seed=0)
    captured = generate(model, prompts, num_samples=2, sampling=sampling, seed=0,
                        schedule=DecodeSchedule(2, "pow2", "dynamo"))
    assert [t.tolist() for t in captured.tokens] == [t.tolist() for t in eager.tokens]
    assert_sampler_logprobs_are_the_models(model, captured, prompts, 2)
