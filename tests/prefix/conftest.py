import types

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ARCHITECTURES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    # Gemma 3: sliding and full attention layers, q/k norms, a query scale of its own, scaled embeddings.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
VOCAB = 97


def build_model(arch: str, dtype=torch.float32, seed: int = 0, **overrides):
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256, initializer_range=0.2, **overrides)
    model = model_cls(config).to(dtype)
    if dtype == torch.float64:
        full_precision_norms(model)
    return model


def build_gpt2(dtype=torch.float32, seed: int = 0, vocab: int = VOCAB):
    """A tiny GPT-2: absolute position embeddings (wpe), no intermediate_size, layers in ``transformer.h``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0, initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to(dtype).eval()


def full_precision_norms(model):
    """HF RMSNorms compute in float32 even in a float64 model; their rounding would hide float64
    agreement (both layouts round differently-summed gradients to float32), so float64 tests run the
    norm in the model's dtype. The norm is per-token, so this does not touch what is being tested."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def gemma_forward(self, x):   # Gemma's norm scales by (1 + weight) and names its epsilon eps
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(gemma_forward if name.startswith("Gemma") else forward, module)


def random_groups(prompt_lengths, completion_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in prompt_lengths]
    completions = [[torch.randint(0, VOCAB, (s,), generator=g) for s in ss] for ss in completion_lengths]
    return prompts, completions


# Packs: G in {1, 2, 5}, prompts of different lengths in one pack, completions of length 1.
PACKS = {
    "mixed": ([5, 11, 3], [[4, 1, 7, 2, 9], [3], [2, 6]]),
    "single": ([8], [[1, 5]]),
    "g5-equal-prompts": ([6, 6], [[3, 3, 1, 8, 2], [5, 1]]),
}


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param
