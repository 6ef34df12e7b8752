"""The policy's weights as a separate engine loads them: checkpoint names, LoRA adapters merged, and only
the layers an optimizer step can change.

A tied LM head (the embedding's weight) that LoRA adapts, on the head or on the embedding, is no longer one
matrix: the trained model's head and embedding differ. Such a policy is served untied (``needs_untied``): the
engine's config says ``tie_word_embeddings = false`` and every checkpoint carries ``lm_head.weight`` beside the
embedding, each with its own adapter merged.

A fused engine layer (vLLM's ``qkv_proj`` of ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj``) is
processed once all of its parts have arrived, so a part is never sent alone: ``trainable_weights``
widens the set to whole fused groups (``fused_groups``, the engine model's ``packed_modules_mapping``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn


def base_model(policy: nn.Module) -> nn.Module:
    """The Hugging Face model under a PEFT wrapper (the policy itself without one)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA layers by module name (each has ``base_layer`` and ``get_delta_weight``)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "base_layer") and callable(getattr(m, "get_delta_weight", None))}


def _merged(param: torch.Tensor, layer: nn.Module | None) -> torch.Tensor:
    """``param`` (a weight) with ``layer``'s active LoRA adapters merged in (``W + B A * scale``)."""
    if layer is None:
        return param.detach()
    own = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))  # (an embedding's adapters are named so)
    return (param + sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in own)).detach()


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    """``module``'s name in ``model`` (a LoRA wrapper's, where one wraps it), or None."""
    return next((name for name, m in model.named_modules() if m is module), None) if module is not None else None


def tied_head(model: nn.Module) -> str | None:
    """The name of ``model``'s LM head where it is tied to the embedding (one weight), else None."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    weight_of = lambda m: getattr(getattr(m, "base_layer", m), "weight", None)  # noqa: E731
    if head is None or embedding is None or weight_of(head) is None or weight_of(head) is not weight_of(embedding):
        return None
    return _module_name(model, head)


def _untied_head(model: nn.Module) -> str | None:
    """The name of ``model``'s tied LM head where LoRA adapts it or the embedding (merged, the two differ), else
    None."""
    head = tied_head(model)
    adapted = set(_lora_layers(model))
    return head if head is not None and (head in adapted or _module_name(model, model.get_input_embeddings())
                                         in adapted) else None


def needs_untied(policy: nn.Module) -> bool:
    """Whether an engine must serve ``policy`` untied: its LM head is tied and LoRA adapts the head or the
    embedding (merged, the two differ)."""
    return _untied_head(base_model(policy)) is not None


def checkpoint_weights(policy: nn.Module, modules: set[str] | None = None) -> dict[str, torch.Tensor]:
    """``{checkpoint name: tensor}`` of the policy's weights with LoRA adapters merged in (``W + B A * scale``
    of the active adapters; the policy itself is left as it is), of the modules named in ``modules``
    (None: all). Tied weights appear once, under their first name, except a tied head an adapter makes differ
    (``needs_untied``): then the head appears too, with its own adapter merged."""
    model = base_model(policy)
    lora = _lora_layers(model)
    weights = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                continue
            module, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
            if modules is not None and module not in modules:
                continue
            weights[f"{module}.{leaf}"] = _merged(param, lora.get(module) if leaf == "weight" else None)
        head = _untied_head(model)
        if head is not None and (modules is None or head in modules):
            weights[f"{head}.weight"] = _merged(getattr(model.get_output_embeddings(), "base_layer",
                                                        model.get_output_embeddings()).weight, lora.get(head))
    return weights


def trainable_modules(policy: nn.Module, fused_groups: Mapping[str, Sequence[str]]) -> set[str]:
    """Checkpoint names of the modules whose weights an optimizer step changes (those with a trainable
    parameter, or with LoRA adapters), widened to whole fused groups."""
    model = base_model(policy)
    lora = set(_lora_layers(model))
    changed = {name.replace(".base_layer.", ".").rpartition(".")[0]
               for name, param in model.named_parameters() if param.requires_grad and ".lora_" not in name}
    changed |= lora
    part_of = {part: parts for parts in fused_groups.values() for part in parts}
    widened = set()
    for module in changed:
        parent, dot, leaf = module.rpartition(".")
        widened.update(f"{parent}{dot}{part}" for part in part_of.get(leaf, (leaf,)))  # top level: no parent
    return widened
