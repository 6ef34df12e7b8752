"""Tiny hybrid models of every family of ``architectures.SHARED_IN_TRAINING``, and the float64 patches that make
their own forward compute in float64 throughout (so that two exact layouts agree to float64 rounding)."""

import inspect
import textwrap
import types

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from tests.prefix.conftest import VOCAB

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.05)


def qwen3_5(dtype):
    """Gated DeltaNet then full attention; two value heads per key head (the kernel's repeat), short conv of 4."""
    config = Qwen3_5TextConfig(**SIZES, head_dim=16, num_hidden_layers=3,
                               layer_types=["linear_attention", "full_attention", "linear_attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8)
    return Qwen3_5ForCausalLM(config).to(dtype)


def lfm2(dtype):
    """Gated short convolutions (width 3) around one attention layer, biased."""
    config = Lfm2Config(**SIZES, num_hidden_layers=3, full_attn_idxs=[1], conv_bias=True)
    return Lfm2ForCausalLM(config).to(dtype)


# model type -> builder; tests/test_architectures.py keeps it equal to architectures.SHARED_IN_TRAINING.
FAMILIES = {"qwen3_5_text": qwen3_5, "lfm2": lfm2}


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

    forwards = {
        "Qwen3_5RMSNorm": lambda self, x: rms(x, self.eps) * (1.0 + self.weight),
        "Qwen3_5RMSNormGated": lambda self, x, gate: self.weight * rms(x, self.variance_epsilon) * torch.nn.functional.silu(gate),
        "Lfm2RMSNorm": lambda self, x: self.weight * rms(x, self.variance_epsilon),
    }
    for module in model.modules():
        forward = forwards.get(type(module).__name__)
        if forward is not None:
            module.forward = types.MethodType(forward, module)
        else:
            assert not type(module).__name__.endswith(("RMSNorm", "RMSNormGated")), type(module).__name__


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
KERNEL_CASTS = {"torch.float32": "initial_dtype"}
GATE_CASTS = {"self.A_log.float()": "self.A_log", "a.float()": "a"}
GATED_DELTA_FILES = ("qwen3_5",)


@pytest.fixture
def float64_kernels(monkeypatch):
    """The gated DeltaNet in the model's dtype, in every family's modeling file: its kernels (which the model's own
    forward and turbogrpo's unit both look up there at the call) and its gate."""
    import importlib
    for family in GATED_DELTA_FILES:
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(modeling, name, rewritten(getattr(modeling, name), KERNEL_CASTS))
        for cls in vars(modeling).values():
            if isinstance(cls, type) and cls.__name__.endswith("GatedDeltaNet") and cls.__module__ == modeling.__name__:
                monkeypatch.setattr(cls, "forward", rewritten(cls.forward, GATE_CASTS))


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
