"""Run an unmodified Hugging Face decoder with turbogrpo's attention.

transformers looks attention up by name in ``AttentionInterface``. We register one name,
``"turbogrpo"``, whose function does one of two things:

* a call that carries an *attention plan* hands q/k/v to the plan: the shared-prefix training
  forward, the rollout engine's KV cache and tree verification are all plans. The plan travels two
  ways, so that it reaches every layer: as the keyword ``turbogrpo_plan`` (which transformers passes
  down to attention) and on the placeholder 4-D attention mask (:func:`plan_mask`), which
  transformers passes through unchanged. Some decoder layers drop extra keywords before their
  attention (StableLM's); every layer passes its mask, also when activation checkpointing recomputes
  the layer in the backward;
* any other call (``model.generate``, a plain ``model(ids)``) goes to SDPA, so installing the
  hook changes nothing for other users of the model.

A plan is any callable ``plan(module, query, key, value, *, scaling, sliding_window) -> out``
with query ``[B, H, T, D]``, key/value ``[B, Hkv, T, D]`` (RoPE already applied) and
out ``[B, T, H, D]``. Models know nothing of plans; plans know nothing of GRPO.

A hybrid model's other token mixers (a gated DeltaNet, a short convolution: ``turbogrpo.mixers``) are plain
modules that transformers calls directly. :func:`install` routes each registered one through
:func:`_mixer_forward`, which reads the plan off the same placeholder mask (handed to every layer type, see
:func:`run_decoder`) and asks it for its ``recurrent_layout()``: the segment forest of a plan that shares
tokens (the shared-prefix pack, the trie) or the rollout engine's state layout (``rollout.states``), which the
mixer's unit runs; None for rows that are whole sequences, which the module's own forward runs. A plan without
the method (a draft's) runs attention models only.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from turbogrpo.architectures import CHANNEL_MIXING_LAYER_TYPES, SHARED_IN_TRAINING, unsupported_token_mixing
from turbogrpo.mixers import mixer_of

ATTENTION_NAME = "turbogrpo"
PLAN_KWARG = "turbogrpo_plan"   # the keyword carrying the plan, and the attribute carrying it on the mask


class UnsupportedAttention(ValueError):
    """An attention call passes an argument (soft-cap, sinks) that turbogrpo's plans do not implement."""


class AttentionPlan(Protocol):
    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 *, scaling: float, sliding_window: int | None) -> torch.Tensor: ...


def _turbogrpo_attention(module, query, key, value, attention_mask, **kwargs):
    plan = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        plan = getattr(attention_mask, PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise UnsupportedAttention(
                f"{type(module).__name__} passes `{unsupported}` to its attention; turbogrpo's attention "
                "plans implement plain softmax attention only. Use a model without attention "
                f"{unsupported} (Qwen2/Qwen3/Llama/Mistral work).")
    if torch.is_autocast_enabled(query.device.type):
        # Under mixed precision RoPE's float32 tables promote q and k to float32 while v comes out of
        # its projection in the autocast dtype; the plans' kernels need one dtype, as SDPA's autocast gives.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = plan(module, query, key, value, scaling=scaling, sliding_window=kwargs.get("sliding_window"))
    return out, None


AttentionInterface.register(ATTENTION_NAME, _turbogrpo_attention)
# Masks for the SDPA fallback path are built exactly as for "sdpa"; plan calls skip mask building
# by passing a prebuilt placeholder (see `run_decoder`).
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def causal_band(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Causal sliding-window rule over ``length`` consecutive positions as a boolean ``[length, length]``
    (query, key) mask, ``0 <= q - k < window`` as transformers builds it; None when the window hides
    nothing (plain causal attention)."""
    if sliding_window is None or length <= sliding_window:
        return None
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance < sliding_window)


def check_supported(model: nn.Module, *, training: bool = False) -> None:
    """Raise ValueError if ``model``'s token mixing is not plain (full-context or windowed) softmax attention
    (the rules of ``turbogrpo.architectures``); with ``training``, also not a hybrid whose other layers the
    training forwards run (``architectures.SHARED_IN_TRAINING``)."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    what = unsupported_token_mixing(config, training=training)
    if what is not None and model_type in SHARED_IN_TRAINING:
        raise ValueError(
            f"model type '{model_type}' {what}; turbogrpo's training forwards and native rollout engine run it "
            "(their state caches, speculation with chains), and the vLLM engine serves only some hybrids "
            "(docs/guide/architectures.md): use rollout.engine = \"native\" or \"auto\".")
    if what is not None:
        raise ValueError(
            f"model type '{model_type}' {what}; turbogrpo's attention plans (shared prefix, rollout) cannot run it "
            "exactly. tree_logprobs runs it one row per sequence; to train, use a model whose layers are softmax "
            "attention (Qwen2, Qwen3, Llama, Mistral; docs/guide/architectures.md).")


def check_materialized(model: nn.Module) -> None:
    """ValueError when ``model``'s weights are on the meta device (shapes only, no values: built under
    ``init_empty_weights`` or ``device="meta"``), where every forward would fail deep inside torch."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("the model's weights are on the meta device (shapes without values); load real weights "
                         "first (from_pretrained, or to_empty() and load_state_dict) before generating or scoring")


# Decoder attributes that hold a learnt table of absolute positions (GPT-2's wpe, OPT's embed_positions ...).
ABSOLUTE_POSITION_MODULES = ("wpe", "embed_positions", "position_embeddings")


def has_absolute_positions(model: nn.Module) -> bool:
    """Whether ``model`` adds absolute position embeddings to its tokens (GPT-2) rather than rotating q/k
    (RoPE): its outputs then depend on where a sequence starts, not only on token distances. turbogrpo
    counts positions from each prompt's first real token, which such a model also runs exactly."""
    decoder = decoder_of(model)
    return any(isinstance(getattr(decoder, name, None), nn.Embedding) for name in ABSOLUTE_POSITION_MODULES)


def install(model: nn.Module, *, training: bool = False) -> int:
    """Make ``model`` dispatch attention, and its registered token mixers, through turbogrpo (idempotent; its
    own computation for calls without a plan). ``training``: for the training forwards' plans (see
    :func:`check_supported`). Returns the number of mixer modules routed."""
    check_supported(model, training=training)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config._attn_implementation != ATTENTION_NAME:
        base.set_attn_implementation(ATTENTION_NAME)
    if unsupported_token_mixing(base.config) is None:
        return 0   # attention only (the rollout's per-step call): no module to look through
    mixers = [module for module in base.modules() if mixer_of(module) is not None]
    for module in mixers:
        if getattr(module.forward, "__func__", None) is not _mixer_forward:
            module.forward = types.MethodType(_mixer_forward, module)
    return len(mixers)


def _mixer_forward(self: nn.Module, *args, **kwargs):
    """A registered mixer module's forward (bound to the module by :func:`install`): its unit over the plan's
    segment forest when the call carries a plan that shares tokens, its own forward otherwise."""
    plan = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        plan = getattr(kwargs.get("attention_mask"), PLAN_KWARG, None)
    if plan is None:
        return type(self).forward(self, *args, **kwargs)
    kwargs["attention_mask"] = None   # the placeholder that carried the plan masks nothing
    forest = plan.recurrent_layout()
    if forest is None:
        return type(self).forward(self, *args, **kwargs)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return _run_unit(self, hidden_states, forest)


@torch.compiler.disable(recursive=True)
def _run_unit(module: nn.Module, hidden_states: torch.Tensor, forest) -> torch.Tensor:
    # Not traced by a compiled layer: the forest's host ints would specialise the graph on every pack's lengths.
    return mixer_of(module).forward(module, hidden_states, forest)


class _CountingPlan:
    """Wraps a plan to count calls, so a model whose layers bypass the attention interface is caught."""

    def __init__(self, plan: Callable):
        self.plan = plan
        self.num_calls = 0

    def __call__(self, module, query, key, value, **kwargs):
        self.num_calls += 1
        return self.plan(module, query, key, value, **kwargs)

    def recurrent_layout(self):
        """A token mixer's call (``_mixer_forward``): it reached turbogrpo too."""
        self.num_calls += 1
        return self.plan.recurrent_layout()


class _PlanMasks(dict):
    """The attention masks of a hybrid model's forward, by layer type: the plan's placeholder for every type
    (a hybrid decoder takes a dict as prebuilt, and hands its recurrent layers only their type's entry)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def __missing__(self, layer_type: str) -> torch.Tensor:
        return self.mask


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body (embeddings, layers, final norm) of a causal LM, through PEFT wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder()


def embedding_table(model: nn.Module) -> nn.Embedding:
    """The input embedding's table (``num_embeddings``, ``weight``), under an adapter that wraps it (PEFT's LoRA
    embedding has neither attribute)."""
    embedding = model.get_input_embeddings()
    return getattr(embedding, "base_layer", embedding)


def lm_head_of(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_output_embeddings()


def plan_mask(plan: Callable, device: torch.device) -> torch.Tensor:
    """The placeholder attention mask of a plan call, carrying ``plan``: transformers takes a 4-D mask as
    prebuilt and hands the same tensor to every layer's attention, so no ``[T, T]`` mask is made."""
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    setattr(mask, PLAN_KWARG, plan)
    return mask


def run_decoder(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                plan: Callable) -> torch.Tensor:
    """Final hidden states ``[B, T, hidden]`` of ``model`` for ``input_ids``/``position_ids`` ``[B, T]``,
    with every attention layer computed by ``plan``.

    A plan with a ``recurrent_layout()`` method (the training forwards') also runs a hybrid's other token mixers
    (see the module docstring); without one, a hybrid is refused in one line before any work.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    implementation = base.config._attn_implementation
    num_mixers = install(model, training=hasattr(plan, "recurrent_layout"))
    decoder = decoder_of(model)
    counting = _CountingPlan(plan)
    mask = plan_mask(counting, input_ids.device)
    try:
        out = decoder(input_ids=input_ids, position_ids=position_ids,
                      attention_mask=_PlanMasks(mask) if num_mixers else mask, use_cache=False,
                      **{PLAN_KWARG: counting})
    except UnsupportedAttention:
        # Leave the model as it was, so that its own forward (and tree_logprobs' per-sequence fallback)
        # still runs its own attention.
        if implementation != ATTENTION_NAME:
            base.set_attn_implementation(implementation)
        raise
    num_layers = model.config.num_hidden_layers
    num_layers -= sum(t in CHANNEL_MIXING_LAYER_TYPES for t in getattr(model.config, "layer_types", None) or ())
    if counting.num_calls < num_layers:
        raise ValueError(
            f"model type '{model.config.model_type}' ran attention through turbogrpo in only "
            f"{counting.num_calls} of its {num_layers} layers; its other layers mix tokens some other way, "
            "so turbogrpo cannot run it exactly.")
    return out.last_hidden_state
