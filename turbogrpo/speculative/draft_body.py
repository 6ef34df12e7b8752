"""The draft head's decoder layers: which layer class the draft runs, and what it copies from the policy.

The draft's body is attention (its cache is a KV cache, ``draft_decoding.DraftKVCache``), whatever the policy:

* ``policy_layers``: a policy whose layers are all softmax attention (Qwen2/Qwen3/Llama/Mistral): ``num_layers``
  layers of the policy's own class, built from its config cut to that many layers, and its rotary embedding;
* ``attention_layers``: a hybrid (``architectures.SHARED_IN_TRAINING``: gated DeltaNet, Mamba-2 or short
  convolutions beside attention), whose layer classes are not attention layers alone (a Qwen3.5 layer picks its
  mixer by index, a Falcon-H1 layer runs Mamba-2 and attention side by side, Nemotron-H has no positions): Llama
  decoder layers of the policy's width (hidden size, heads, KV heads, head size, MLP size, norm epsilon), with
  rotary positions of their own (the draft attends over its own cache, so its positions need not be the policy's).

``copyable`` says which of a draft layer's tensors ``DraftHead.init_from_policy`` copies from a policy layer: those
whose name and shape agree and whose owning module is of the same class (a hybrid's norms compute ``x * (1 + w)``
where Llama's compute ``x * w``: the same name and shape, not the same function), or a plain ``nn.Linear`` on both.

Legend: Hd hidden size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from turbogrpo.architectures import hybrid_layers
from turbogrpo.hook import ATTENTION_NAME, decoder_of


class DraftBody(NamedTuple):
    """The draft's decoder layers and the rotary embedding that gives their positions."""

    layers: nn.ModuleList
    rotary: nn.Module
    kind: str
    """Key of ``DRAFT_BODIES`` it was built by (``export_vllm`` refuses an "attention" body: a hybrid's draft)."""


def policy_layers(policy: nn.Module, num_layers: int) -> DraftBody:
    """``num_layers`` layers of the policy's own class (an attention model)."""
    config = copy.deepcopy(policy.config)
    layer_types = getattr(config, "layer_types", None)
    config.num_hidden_layers = num_layers
    if layer_types:
        config.layer_types = list(layer_types[:num_layers])
    config._attn_implementation = ATTENTION_NAME
    decoder = decoder_of(policy)
    layers = nn.ModuleList(type(decoder.layers[0])(config, layer_idx=i) for i in range(num_layers))
    return DraftBody(layers, type(decoder.rotary_emb)(config=config), "policy")


def attention_config(policy_config, num_layers: int) -> LlamaConfig:
    """A Llama config of the policy's width for a hybrid's draft (the module docstring)."""
    hidden, heads = policy_config.hidden_size, policy_config.num_attention_heads
    eps = next((v for v in (getattr(policy_config, name, None) for name in ("rms_norm_eps", "layer_norm_epsilon",
                                                                            "norm_eps")) if v is not None), 1e-6)
    rope = getattr(policy_config, "rope_parameters", None) or {}
    config = LlamaConfig(
        vocab_size=policy_config.vocab_size, hidden_size=hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=getattr(policy_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(policy_config, "head_dim", None) or hidden // heads,
        intermediate_size=getattr(policy_config, "intermediate_size", None) or 4 * hidden,
        hidden_act=getattr(policy_config, "hidden_act", None) or "silu", rms_norm_eps=eps,
        max_position_embeddings=getattr(policy_config, "max_position_embeddings", None) or 4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)})
    config._attn_implementation = ATTENTION_NAME
    return config


def attention_layers(policy: nn.Module, num_layers: int) -> DraftBody:
    """``num_layers`` Llama decoder layers of the policy's width (a hybrid)."""
    config = attention_config(policy.config, num_layers)
    layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(num_layers))
    return DraftBody(layers, LlamaRotaryEmbedding(config=config), "attention")


DRAFT_BODIES: dict[str, Callable[[nn.Module, int], DraftBody]] = {"policy": policy_layers,
                                                                   "attention": attention_layers}
"""How a draft's body is built, by kind (``body_kind`` picks one for a policy)."""


def body_kind(policy: nn.Module) -> str:
    """"attention" for a hybrid policy, "policy" for an attention one."""
    return "attention" if hybrid_layers(policy.config) is not None else "policy"


def build_draft_body(policy: nn.Module, num_layers: int) -> DraftBody:
    """The draft body for ``policy`` (on the policy's device and dtype; RoPE frequencies stay float32)."""
    body = DRAFT_BODIES[body_kind(policy)](policy, num_layers)
    reference = next(decoder_of(policy).parameters())
    body.layers.to(device=reference.device, dtype=reference.dtype)
    return body._replace(rotary=body.rotary.to(reference.device))


def copyable(target: nn.Module, source: nn.Module) -> tuple[list[str], list[str]]:
    """(names of ``target``'s tensors that ``source`` has with the same shape in a module of the same kind,
    names of the others): what ``init_from_policy`` copies and what it cannot."""
    source_modules = dict(source.named_modules())
    source_tensors = source.state_dict()
    same, other = [], []
    for name, tensor in target.state_dict().items():
        owner, _, _ = name.rpartition(".")
        theirs = source_modules.get(owner)
        mine = target.get_submodule(owner) if owner else target
        kind_agrees = theirs is not None and (type(theirs) is type(mine) or
                                              (type(mine) is nn.Linear and type(theirs) is nn.Linear))
        fits = name in source_tensors and source_tensors[name].shape == tensor.shape
        (same if kind_agrees and fits else other).append(name)
    return same, other


def source_layer(policy_layers_: nn.ModuleList, draft_layer: nn.Module) -> nn.Module:
    """The policy layer a draft layer copies: the last one that shares the most copyable tensors with it (the
    last layer of an attention model; a hybrid's last full-attention layer)."""
    counts = [len(copyable(draft_layer, layer)[0]) for layer in policy_layers_]
    best = max(counts)
    return policy_layers_[max(i for i, c in enumerate(counts) if c == best)]
