"""Forward FLOPs of the standard and the shared-prefix layouts of a pack (the backward scales both alike).

Counted: the linear layers (every token, every layer), attention scores and values (every visible
query-key pair, every layer) and the LM head (completion tokens only, the same in both layouts).
Norms, rotary embeddings and activations are per-token elementwise work, left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @staticmethod
    def of(model_or_config) -> ModelDims:
        """Dimensions of an HF causal LM (or its config)."""
        c = model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        # GPT-2-style configs name the MLP width n_inner (None: 4 x hidden) instead of intermediate_size.
        intermediate = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
        return ModelDims(c.hidden_size, intermediate, c.num_hidden_layers, c.num_attention_heads,
                         getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim, c.vocab_size)

    @property
    def linear_flops_per_token(self) -> int:
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden * q_dim + 2 * self.hidden * kv_dim + q_dim * self.hidden   # q, k, v, o
        mlp = 3 * self.hidden * self.intermediate                                          # gate, up, down
        return 2 * self.num_layers * (attention + mlp)

    @property
    def attention_flops_per_pair(self) -> int:
        return 4 * self.num_heads * self.head_dim * self.num_layers   # q.k and p.v


@dataclass(frozen=True)
class LayoutFlops:
    standard: float
    shared: float

    @property
    def ratio(self) -> float:
        """How many times less work the shared layout does."""
        return self.standard / self.shared


def layout_flops(dims: ModelDims, prompt_lengths, completion_lengths) -> LayoutFlops:
    """Forward FLOPs of both layouts for groups of ``prompt_lengths[g]`` and ``completion_lengths[g]``
    (a list per group), all host ints."""
    standard_tokens = standard_pairs = shared_tokens = shared_pairs = completion_tokens = 0
    for p, lengths in zip(prompt_lengths, completion_lengths):
        shared_tokens += p + sum(lengths)
        shared_pairs += p * (p + 1) // 2
        for s in lengths:
            standard_tokens += p + s
            standard_pairs += (p + s) * (p + s + 1) // 2
            shared_pairs += s * p + s * (s + 1) // 2
            completion_tokens += s
    lm_head = 2 * dims.hidden * dims.vocab * completion_tokens

    def total(tokens: int, pairs: int) -> float:
        return tokens * dims.linear_flops_per_token + pairs * dims.attention_flops_per_pair + lm_head
    return LayoutFlops(standard=total(standard_tokens, standard_pairs), shared=total(shared_tokens, shared_pairs))
