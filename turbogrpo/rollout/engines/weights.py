"""The policy's weights as a separate engine loads them: checkpoint names, LoRA adapters merged, and only
the layers an optimizer step can change.

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


def checkpoint_weights(policy: nn.Module, modules: set[str] | None = None) -> dict[str, torch.Tensor]:
    """``{checkpoint name: tensor}`` of the policy's weights with LoRA adapters merged in (``W + B A * scale``
    of the active adapters; the policy itself is left as it is), of the modules named in ``modules``
    (None: all). Tied weights appear once, under their first name."""
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
            layer = lora.get(module)
            if layer is not None and leaf == "weight":
                param = param + sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            weights[f"{module}.{leaf}"] = param.detach()
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
