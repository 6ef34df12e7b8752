"""Tiny hybrid models of every family of ``architectures.SHARED_IN_TRAINING``, and the float64 patches that make
their own forward compute in float64 throughout (so that two exact layouts agree to float64 rounding)."""

import inspect
import textwrap
import types

import pytest
import torch
from transformers import (Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM, Qwen3_5ForCausalLM,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from tests.prefix.conftest import VOCAB

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.05)

LINEAR_ATTENTION = dict(head_dim=16, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                       "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
# Eager experts: the grouped matmul has no float64 kernel.
SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, experts_implementation="eager")


def qwen3_5(dtype):
    """Gated DeltaNet then full attention; two value heads per key head (the kernel's repeat), short conv of 4."""
    config = Qwen3_5TextConfig(**SIZES, **LINEAR_ATTENTION)
    return Qwen3_5ForCausalLM(config).to(dtype)


def lfm2(dtype):
    """Gated short convolutions (width 3) around one attention layer, biased."""
    config = Lfm2Config(**SIZES, num_hidden_layers=3, full_attn_idxs=[1], conv_bias=True)
    return Lfm2ForCausalLM(config).to(dtype)


def qwen3_5_moe(dtype):
    """Qwen3.5's layers with a sparse MoE (and a shared expert) for the MLP."""
    config = Qwen3_5MoeTextConfig(**SIZES, **LINEAR_ATTENTION, **SMALL_MOE, shared_expert_intermediate_size=32)
    return Qwen3_5MoeForCausalLM(config).to(dtype)


def qwen3_next(dtype):
    """Qwen3-Next: q, k, v, z (and b, a) from fused projections grouped by key head; a sparse MoE."""
    config = Qwen3NextConfig(**SIZES, **LINEAR_ATTENTION, **SMALL_MOE, shared_expert_intermediate_size=32)
    return Qwen3NextForCausalLM(config).to(dtype)


def lfm2_moe(dtype):
    """LFM2's layers, a dense first layer then sparse MoE."""
    config = Lfm2MoeConfig(**SIZES, **SMALL_MOE, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                           num_dense_layers=1, conv_bias=True)
    return Lfm2MoeForCausalLM(config).to(dtype)


# model type -> builder; tests/test_architectures.py keeps it equal to architectures.SHARED_IN_TRAINING.
FAMILIES = {"qwen3_5_text": qwen3_5, "qwen3_5_moe_text": qwen3_5_moe, "qwen3_next": qwen3_next, "lfm2": lfm2,
            "lfm2_moe": lfm2_moe}


def build_hybrid(model_type: str, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[model_type](dtype).eval()
    assert model.config.model_type == model_type
    if dtype == torch.float64:
        norms_in_model_dtype(model)
    return model


def norms_in_model_dtype(model):
    """The families' RMSNorms (plain, zero-centred, gated) compute in float32 whatever the model's dtype; in a
    float64 model run them in float64 (each is per token, so this touches nothing the tests check)."""
    def rms(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def zero_centred(self, x):   # Qwen3.5 / Qwen3-Next: the weight starts at 0 and scales by 1 + weight
        return rms(x, self.eps) * (1.0 + self.weight)

    def gated(self, x, gate):
        return self.weight * rms(x, self.variance_epsilon) * torch.nn.functional.silu(gate)

    def plain(self, x):
        return self.weight * rms(x, self.variance_epsilon)

    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNormGated"):
            module.forward = types.MethodType(gated, module)
        elif name.endswith("RMSNorm"):
            module.forward = types.MethodType(zero_centred if name.startswith("Qwen3") else plain, module)


def rewritten(function, replacements: dict[str, str]):
    """transformers' ``function`` (under its hub wrapper and decorators) compiled again from its source with
    ``replacements`` made (each must occur), in its own module's globals."""
    plain = inspect.unwrap(function)
    source = textwrap.dedent(inspect.getsource(plain))
    source = source[source.index("def "):]   # without its decorators
    for old, new in replacements.items():
        assert old in source, (plain.__qualname__, old)
        source = source.replace(old, new)
    namespace = dict(plain.__globals__)
    exec(source, namespace)
    return namespace[plain.__name__]


# The float32 casts of the gated DeltaNet's own forward and kernels (transformers 5.19), made casts to the input's
# dtype: ``initial_dtype`` is the kernels' first line. The gate's .float() is what turbogrpo's unit does for
# float64 models (turbogrpo.mixers.gated_delta).
# A MoE router's softmax runs in float32 too: a shared prompt token's gradient, summed over its G completions
# before that float32 backward, rounds differently from G copies rounded one by one.
KERNEL_CASTS = {"torch.float32": "initial_dtype"}
GATE_CASTS = {"self.A_log.float()": "self.A_log", "a.float()": "a"}
ROUTER_CASTS = {"dtype=torch.float,": "dtype=router_logits.dtype,"}
GATED_DELTA_FILES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def classes_of(modeling, suffix: str):
    return [cls for cls in vars(modeling).values()
            if isinstance(cls, type) and cls.__name__.endswith(suffix) and cls.__module__ == modeling.__name__]


@pytest.fixture
def float64_kernels(monkeypatch):
    """The gated DeltaNet in the model's dtype, in every family's modeling file: its kernels (which the model's own
    forward and turbogrpo's unit both look up there at the call), its gate and its MoE router."""
    import importlib
    for family in GATED_DELTA_FILES:
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(modeling, name, rewritten(getattr(modeling, name), KERNEL_CASTS))
        for cls in classes_of(modeling, "GatedDeltaNet"):
            monkeypatch.setattr(cls, "forward", rewritten(cls.forward, GATE_CASTS))
        for cls in classes_of(modeling, "TopKRouter"):
            monkeypatch.setattr(cls, "forward", rewritten(cls.forward, ROUTER_CASTS))


def random_groups(prompt_lengths, completion_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in prompt_lengths]
    completions = [[torch.randint(0, VOCAB, (s,), generator=g) for s in ss] for ss in completion_lengths]
    return prompts, completions


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models run fastest on one thread (see tests/train/conftest.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
