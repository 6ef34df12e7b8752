"""Which model types turbogrpo runs, and how: the rules its checks apply, in one table.

``hook.check_supported`` refuses a model that one of :data:`TOKEN_MIXING_RULES` applies to;
docs/guide/architectures.md is generated from this module and ``output_head.LOGIT_TRANSFORMS`` by
scripts/architectures_docs.py, and tests/test_architectures.py builds a tiny model of every class.

Three classes:

* **shared**: softmax attention through transformers' attention interface. The shared-prefix forward,
  the trie forward and the rollout engine run it exactly. :data:`VERIFIED_SHARED` lists the model types the
  test suite checks against the model's own forward; other attention models run when the checks at first
  use pass (:data:`FIRST_USE_CHECKS`).
* **shared in training, sampled natively**: a hybrid of attention and layers that carry a state along the sequence
  (linear attention, Mamba-2, short convolutions), listed in :data:`SHARED_IN_TRAINING`. The shared-prefix forward
  and the trie forward run it exactly, its attention layers through the plans and its other layers through their
  registered units (``turbogrpo.mixers``); the native rollout engine samples it through the same units, with a state
  cache beside its KV cache (``rollout.states``), and speculates on it with chains, never trees: a neural draft
  head's top path (its body is Llama layers of the policy's width, ``speculative.draft_body``) or history drafts.
  The vLLM engine serves the types it was found to run (``engines.VLLM_HYBRIDS``, engine capability
  ``hybrid_model_types``).
* **tree falls back**: token mixing that turbogrpo's attention plans do not implement (a
  :data:`TOKEN_MIXING_RULES` rule applies). ``tree_logprobs`` runs such a model one row per sequence through
  its own forward (the same numbers, no sharing); the shared-prefix forward and the rollout engine refuse it.
* **refused**: a model whose logits or attention fail the checks at first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Token mixers that are not softmax attention over the whole context: sharing a prefix's K/V (or a
# KV cache laid out by us) would give wrong answers.
NON_ATTENTION_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba", "falcon_h1",
    "lfm2", "qwen3_next", "recurrent_gemma", "granitemoehybrid", "nemotron_h", "minimax", "plamo2",
    "xlstm", "gemma3n", "kimi_linear",
})
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class TokenMixingRule:
    """A way of mixing tokens that turbogrpo's attention plans do not implement."""

    does: Callable[[object], str | None]   # config -> what the model does ("soft-caps ..."), None: rule not met
    known_model_types: tuple[str, ...]     # model types known to meet it (for the docs)
    summary: str                           # the rule in a few words (for the docs)
    stateful: bool = False                 # about layers with a state, which the training forwards run for
                                           # the model types of SHARED_IN_TRAINING


TOKEN_MIXING_RULES: list[TokenMixingRule] = []


def register_token_mixing_rule(summary: str, known_model_types, *, stateful: bool = False) -> Callable:
    """Decorator: register ``does(config) -> str | None`` as a rule (see :class:`TokenMixingRule`)."""
    def register(does: Callable[[object], str | None]) -> Callable:
        TOKEN_MIXING_RULES.append(TokenMixingRule(does, tuple(sorted(known_model_types)), summary, stateful))
        return does
    return register


@register_token_mixing_rule("recurrent, convolutional or linear-attention layers", NON_ATTENTION_MODEL_TYPES,
                            stateful=True)
def _not_attention(config) -> str | None:
    if config.model_type in NON_ATTENTION_MODEL_TYPES:
        return "mixes tokens with recurrent/convolutional/linear-attention layers"
    return None


@register_token_mixing_rule("layer types other than full or sliding-window attention", (), stateful=True)
def _unknown_layer_types(config) -> str | None:
    unknown = set(getattr(config, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES
    return f"has layer types {sorted(unknown)}" if unknown else None


@register_token_mixing_rule("attention logit soft-capping (`attn_logit_softcapping`)", ("gemma2", "vaultgemma"))
def _attention_soft_cap(config) -> str | None:
    return "soft-caps its attention logits" if getattr(config, "attn_logit_softcapping", None) is not None else None


@register_token_mixing_rule("learnt attention sinks", ("gpt_oss",))
def _attention_sinks(config) -> str | None:
    return "adds learnt attention sinks to its softmax" if config.model_type == "gpt_oss" else None


# Hybrid model types whose stateful layers the training forwards (shared prefix, trie) run shared, through the
# units of turbogrpo.mixers, checked against the model's own forward in float64 (log-probs and every gradient,
# tests/mixers), and sampled by the native rollout engine (tests/rollout/test_hybrid.py): model type -> its layers.
# Speculation verifies chains on them (a neural draft's top path, history chains: tests/speculative); vLLM serves
# the types of engines.VLLM_HYBRIDS.
SHARED_IN_TRAINING: dict[str, str] = {
    "qwen3_5_text": "gated DeltaNet (linear attention) and full attention",
    "qwen3_5_moe_text": "gated DeltaNet and full attention, sparse MoE",
    "qwen3_next": "gated DeltaNet (fused projections) and full attention, sparse MoE",
    "olmo_hybrid": "gated DeltaNet (separate projections, negative eigenvalues) and full attention",
    "kimi_linear": "Kimi delta attention (a decay per key channel) and multi-head latent attention, sparse MoE",
    "lfm2": "gated short convolutions and full attention",
    "lfm2_moe": "gated short convolutions and full attention, sparse MoE",
    "nemotron_h": "Mamba-2, full attention and MLP-only layers",
    "granitemoehybrid": "Mamba-2 and full attention, sparse MoE",
    "bamba": "Mamba-2 and full attention",
    "zamba2": "Mamba-2 in every layer, a shared attention block in some",
    "falcon_h1": "Mamba-2 and full attention side by side in every layer, muP multipliers",
}


def hybrid_layers(config) -> str | None:
    """The stateful layers of ``config``'s model, as :data:`SHARED_IN_TRAINING` names them, or None for a model that
    is not such a hybrid (what the native engine's state cache serves)."""
    return SHARED_IN_TRAINING.get(getattr(config, "model_type", None))


# Layer types of hybrid decoders that mix no tokens (a layer given to an MLP alone): no plan call to expect.
CHANNEL_MIXING_LAYER_TYPES = frozenset({"mlp", "moe"})


def unsupported_token_mixing(config, *, training: bool = False) -> str | None:
    """What ``config``'s model does that turbogrpo cannot run (the first rule met), or None.

    ``training``: for the training forwards and the native rollout engine, which also run the stateful layers of
    :data:`SHARED_IN_TRAINING`'s model types; else for every path (speculative rollouts and vLLM too).
    """
    shared_in_training = training and getattr(config, "model_type", None) in SHARED_IN_TRAINING
    for rule in TOKEN_MIXING_RULES:
        what = None if rule.stateful and shared_in_training else rule.does(config)
        if what is not None:
            return what
    return None


# Model types the test suite runs shared (prefix, tree, rollout) and checks against the model's own forward
# in float64 (tests/test_architectures.py, tests/test_output_head.py, tests/prefix, tests/tree):
# model type -> what is particular about it.
VERIFIED_SHARED: dict[str, str] = {
    "llama": "",
    "qwen2": "",
    "qwen3": "q/k norms",
    "mistral": "sliding window",
    "gemma3_text": "sliding and full layers, final logit soft-cap",
    "stablelm": "partial rotary, LayerNorm; its decoder layers drop extra keywords (the plan rides on the mask)",
    "gpt2": "absolute position embeddings",
    "granite": "logits divided by `logits_scaling`",
    "cohere": "logits multiplied by `logit_scale`",
}

# What the first use of any model checks (each refuses in one line naming the model type).
FIRST_USE_CHECKS: dict[str, str] = {
    "logits": "its logits head (LM head and the registered transforms) applied to its last hidden state equals "
              "its own `forward(input_ids).logits` on a few probe tokens, to the dtype's rounding "
              "(`turbogrpo.output_head.check_logits_head`); an unknown transform is refused",
    "attention": "every layer's attention reaches turbogrpo's attention plan, or its linear-attention, Mamba-2 or "
                 "convolution layer a registered unit (`turbogrpo.hook.run_decoder` counts the calls; MLP-only layers "
                 "of a hybrid expect none); a layer that mixes tokens some other way is refused",
    "attention arguments": "no attention call passes `softcap`, `s_aux` or `sinks` to a plan; such a model is "
                           "refused and keeps its own attention implementation",
}
