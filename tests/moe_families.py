"""Tiny mixture-of-experts models of every family ``turbogrpo.moe_routes`` knows, for the routing-replay tests and
bench/routing_replay.py (float64 where asked; eager experts: the grouped matmul has no float64 kernel)."""

import torch
import transformers

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
              experts_implementation="eager", pad_token_id=None, bos_token_id=None, eos_token_id=VOCAB - 1)
SOFTMAX_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)

FAMILIES = {
    # model type -> (config class, model class, the family's settings on top of COMMON)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", SOFTMAX_MOE | dict(norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", SOFTMAX_MOE | dict(shared_expert_intermediate_size=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", SOFTMAX_MOE),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
    # DeepSeek-V3 style: grouped sigmoid routing with a score-correction bias, one shared expert beside
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         moe_intermediate_size=16, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
                         rope_interleave=False, num_key_value_heads=4)),
    # gated DeltaNet then full attention, a sparse MoE with a gated shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    SOFTMAX_MOE | dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                       shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)),
}


def tiny_moe(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A randomly initialised tiny model of ``family`` (a key of ``FAMILIES``); the global RNG is left alone."""
    config_name, model_name, settings = FAMILIES[family]
    config = getattr(transformers, config_name)(**(COMMON | settings | overrides))
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # a bias that moves the choice, as trained models have
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.to(dtype).eval()
