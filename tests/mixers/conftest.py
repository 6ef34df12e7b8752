"""Tiny hybrid models of every family of ``architectures.SHARED_IN_TRAINING``, and the float64 patches that make
their own forward compute in float64 throughout (so that two exact layouts agree to float64 rounding)."""

import functools
import inspect
import textwrap
import types

import pytest
import torch
import transformers

from tests.prefix.conftest import VOCAB
from tests.train.conftest import single_thread  # noqa: F401 (autouse: tiny models run fastest on one thread)

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.05)
# Gated DeltaNet then full attention; two value heads per key head (the kernel's repeat), a convolution of 4.
LINEAR_ATTENTION = dict(head_dim=16, num_hidden_layers=3,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8)
# Eager experts: the grouped matmul has no float64 kernel.
SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, experts_implementation="eager")
# Mamba-2: chunks of 16 tokens (prompts and trie nodes span several), heads in 2 groups of 8 state channels.
MAMBA2 = dict(mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16)

# model type -> (transformers config and model class names, the family's settings on top of SIZES);
# tests/test_architectures.py keeps it equal to architectures.SHARED_IN_TRAINING.
FAMILIES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR_ATTENTION),
    # with a sparse MoE and a shared expert for the MLP
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         LINEAR_ATTENTION | SMALL_MOE | dict(shared_expert_intermediate_size=32)),
    # q, k, v, z (and b, a) from fused projections grouped by key head; a sparse MoE
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   LINEAR_ATTENTION | SMALL_MOE | dict(shared_expert_intermediate_size=32)),
    # separate q, k, v, gate, a, b projections; beta in [0, 2]
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM",
                    LINEAR_ATTENTION | dict(linear_allow_neg_eigval=True, pad_token_id=None, eos_token_id=None)),
    # Kimi delta attention (a decay per key channel) and multi-head latent attention; a dense layer, then MoE
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                         linear_num_heads=4, linear_head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, experts_implementation="eager", pad_token_id=None,
                         bos_token_id=None, eos_token_id=None)),
    # gated short convolutions (width 3) around one attention layer, biased
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(num_hidden_layers=3, full_attn_idxs=[1], conv_bias=True)),
    # a dense first layer, then sparse MoE
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 SMALL_MOE | dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                  num_dense_layers=1, conv_bias=True)),
    # Mamba-2, attention and an MLP-only block (a layer that mixes no tokens)
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(head_dim=16, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention", "mlp", "linear_attention"],
                        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=16)),
    # Granite 4.0-H: Mamba-2 and attention, MoE MLPs with a shared expert
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         MAMBA2 | dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                       mamba_n_heads=8, mamba_d_head=16, num_local_experts=4, num_experts_per_tok=2,
                                       shared_intermediate_size=32, experts_implementation="eager")),
    # Granite 4.0-H's mixer, dense MLPs
    "bamba": ("BambaConfig", "BambaForCausalLM",
              MAMBA2 | dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16)),
    # Mamba-2 in every layer, a shared attention block (on the hidden state and the embeddings) in "hybrid" ones
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=8,
                    mamba_ngroups=2, n_mamba_heads=8, chunk_size=16, pad_token_id=None, bos_token_id=None,
                    eos_token_id=None)),
    # Mamba-2 and attention side by side in every layer, muP multipliers
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  MAMBA2 | dict(head_dim=16, num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                ssm_in_multiplier=0.5, ssm_multipliers=[1.0, 0.5, 2.0, 0.25, 1.5])),
}


def build_hybrid(model_type: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny model of ``model_type``; ``overrides`` go to its config (e.g. ``vocab_size``)."""
    config_class, model_class, settings = FAMILIES[model_type]
    config = getattr(transformers, config_class)(**SIZES | settings | overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(dtype).eval()
    assert model.config.model_type == model_type
    return model


def rewritten(function, replacements: dict[str, str]):
    """transformers' ``function`` (under its hub wrapper and decorators) compiled again from its source with
    ``replacements`` made, in its own module's globals; None where none occurs (nothing to rewrite)."""
    return _rewritten(inspect.unwrap(function), tuple(replacements.items()))


@functools.cache   # once per session: every float64 test patches the same functions
def _rewritten(plain, replacements: tuple[tuple[str, str], ...]):
    source = textwrap.dedent(inspect.getsource(plain))
    source = source[source.index("def "):]   # without its decorators
    if not any(old in source for old, _ in replacements):
        return None
    for old, new in replacements:
        source = source.replace(old, new)
    namespace = dict(plain.__globals__)
    exec(source, namespace)
    compiled = namespace[plain.__name__]
    # Bound to the live module globals, so that it calls the module's functions as patched at the call.
    function = types.FunctionType(compiled.__code__, plain.__globals__, plain.__name__, compiled.__defaults__,
                                  compiled.__closure__)
    function.__kwdefaults__ = compiled.__kwdefaults__
    return function


# What computes in float32 whatever the model's dtype (transformers 5.19), by function name or class-name suffix,
# and the rewrite that makes it compute in its input's dtype (``initial_dtype`` / ``input_dtype`` are set on the
# first lines). Two exact layouts sum a shared token's gradient in different orders; a float32 stage rounds the two
# sums apart (a shared prompt token's gradient summed over its G completions before it, G copies rounded one by
# one in the model's own forward), which would hide float64 agreement:
# - the norms (per token);
# - the kernels of the gated delta rule and the Mamba-2 scan;
# - a gate's .float() (turbogrpo's units keep a float64 model in float64 there, see turbogrpo.mixers.registry);
# - a MoE router's softmax;
# - logits rounded to float32 by the model's own forward (turbogrpo's LM head keeps the model's dtype).
NORM_CASTS = {".float()": "", "torch.float32": "input_dtype"}
FLOAT32_PARTS = {
    "torch_chunk_gated_delta_rule": {"torch.float32": "initial_dtype"},
    "torch_recurrent_gated_delta_rule": {"torch.float32": "initial_dtype"},
    "chunk_kimi_delta_attention": {"torch.float32": "initial_dtype", ".float()": ""},
    "recurrent_kimi_delta_attention": {"torch.float32": "initial_dtype"},
    "mamba2_chunk_scan": {".float()": ""},
    "RMSNorm": NORM_CASTS,
    "RMSNormGated": NORM_CASTS,
    "GatedDeltaNet": {".float()": ""},
    "ForgetGate": {".float()": ""},   # Kimi Linear's decay
    "Mixer": {"self.A_log.float()": "self.A_log"},        # Mamba-2: NemotronHMamba2Mixer, BambaMixer, FalconH1Mixer
    "MambaLayer": {"self.A_log.float()": "self.A_log"},   # Mamba-2: GraniteMoeHybridMambaLayer
    "TopKRouter": {"dtype=torch.float,": "dtype=router_logits.dtype,", ".float()": ""},
    "TopkRouter": {"torch.float32": "hidden_states.dtype"},   # Kimi Linear's
    "ForCausalLM": {".float()": ""},   # Nemotron-H's own forward rounds its logits to float32
}
MODELING_FILES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2", "lfm2_moe",
                  "zamba2", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")


@pytest.fixture
def float64_throughout(monkeypatch):
    """Every part of :data:`FLOAT32_PARTS` in its input's dtype, in every hybrid family's modeling file (the model's
    own forward and turbogrpo's units both look the kernels up there at the call)."""
    import importlib
    for family in MODELING_FILES:
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name, value in vars(modeling).items():
            if isinstance(value, type) and value.__module__ == modeling.__name__:
                casts = next((c for suffix, c in FLOAT32_PARTS.items() if name.endswith(suffix)), None)
                if casts is not None and "forward" in vars(value) and rewritten(value.forward, casts) is not None:
                    monkeypatch.setattr(value, "forward", rewritten(value.forward, casts))
            elif name in FLOAT32_PARTS and callable(value):
                monkeypatch.setattr(modeling, name, rewritten(value, FLOAT32_PARTS[name]))


def random_groups(prompt_lengths, completion_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in prompt_lengths]
    completions = [[torch.randint(0, VOCAB, (s,), generator=g) for s in ss] for ss in completion_lengths]
    return prompts, completions


