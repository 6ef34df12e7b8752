"""A draft head as a folder vLLM's EAGLE speculative decoding loads (``speculative_config={"method": "eagle",
"model": folder}``): ``config.json`` + ``model.safetensors`` under vLLM's names.

vLLM 0.32's EAGLE-1 drafter for Llama-style targets (``vllm/model_executor/models/llama_eagle.py``,
``EagleLlamaForCausalLM``) computes, for the pair (target hidden state h[t], token x[t+1]) at position t:

    hidden = fc([embed(x[t+1]), h[t]])                  fc: 2Hd -> Hd, no bias
    layers: vLLM's LlamaDecoderLayer, the first without input_layernorm
    output = hidden + residual                          no final norm; the target's LM head gives the logits

with the target's embeddings and LM head (shared when the folder has none), h the target's final post-norm
hidden state, and its own predicted state fed back while drafting. turbogrpo's draft in layout "eagle"
(``draft.py``) is that function: its pair (f[s-1], x[s]) is vLLM's (h[t], x[t+1]) at the same position t =
s - 1. The other layout differs in three ways, none of which the folder can express, so it is refused (never
exported approximately): a fuse bias, an input norm in the first layer, and the first prompt token's pair
in its context. vLLM's EAGLE-3 (``llama_eagle3.py``) is further from ours (three fused target layers, a
2Hd-wide first attention, a final norm) and is not targeted; an "eagle3" draft is refused in one line.

The draft's layers are the policy's own decoder class; vLLM builds the drafter's layers as Llama's from the
folder's config, so a policy is exportable when its layer is a Llama layer with the right bias settings
(``LAYER_MAPS``): Llama (no biases) and Qwen2 without sliding windows (q/k/v biases: ``qkv_bias``).

Legend: Hd hidden size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from turbogrpo.files import save_tensors, write_text_atomically
from turbogrpo.speculative.draft import DraftHead

VLLM_CONFIG_FILE = "config.json"
VLLM_WEIGHTS_FILE = "model.safetensors"
VLLM_ARCHITECTURE = "LlamaForCausalLM"
"""The folder's architecture: vLLM's EAGLEConfig turns it into ``EagleLlamaForCausalLM`` for method "eagle"."""

LAYER_MAPS: dict[str, Callable[[object], dict | str]] = {
    # policy model_type -> Llama config fields that make vLLM's LlamaDecoderLayer the policy's layer, or why not
    "llama": lambda config: {"attention_bias": bool(getattr(config, "attention_bias", False)),
                             "mlp_bias": bool(getattr(config, "mlp_bias", False))},
    "qwen2": lambda config: (
        "its layers use sliding-window attention, which vLLM's EAGLE Llama layer does not"
        if getattr(config, "use_sliding_window", False) else
        # Qwen2: q/k/v have biases, o_proj none (vLLM's Llama: qkv_bias for q/k/v, attention_bias for o_proj)
        {"attention_bias": False, "qkv_bias": True, "mlp_bias": False}),
}
"""Policy model types whose decoder layer vLLM's EAGLE drafter builds exactly (as a Llama layer), with the
config fields that say how; a string says why not."""


def _layout_difference(draft: DraftHead) -> str | None:
    layout = draft.layout
    if draft.config.feature_layers:
        # vLLM's EAGLE-3 takes the three layers into a 2Hd-wide first attention and ends in a norm; ours reduces
        # them with the final feature to Hd before the fuse and has no final norm: no weight mapping exists.
        return (f"layout {layout.name!r} reduces the policy's layers {list(draft.config.feature_layers)} and its final "
                "feature to one before the fuse, which neither vLLM's EAGLE nor its EAGLE-3 drafter computes; train "
                "a draft with `turbogrpo draft train --layout eagle` for vLLM")
    problems = ([f"its fuse has a bias (vLLM's fc has none)"] if layout.fuse_bias else []) + \
               (["its first layer normalizes its input (vLLM's first layer has no input_layernorm)"]
                if layout.first_layer_norm else []) + \
               (["it sees the first prompt token's pair, for which vLLM's drafter has no slot"]
                if layout.context_start == 0 else [])
    return (f"its layout {layout.name!r} is not vLLM's EAGLE: {'; '.join(problems)}; train a draft with "
            "`turbogrpo draft train --layout eagle` (or [draft] layout = \"eagle\")") if problems else None


def _vocabulary_difference(draft: DraftHead) -> str | None:
    return (f"it proposes from a draft vocabulary of {draft.config.num_draft_tokens} tokens, vLLM's EAGLE from "
            "the whole LM head; train it with --draft-tokens 0") if draft.config.num_draft_tokens else None


def _layer_difference(draft: DraftHead) -> str | None:
    model_type = draft.config.model_type
    if draft.body_kind == "attention":   # a hybrid's draft: Llama layers, but vLLM's EAGLE on a hybrid was not tried
        return (f"the policy is a hybrid ({model_type!r}): its draft's chains run on turbogrpo's native engine only "
                "(vLLM's EAGLE drafter on a hybrid target is not tried)")
    mapped = LAYER_MAPS[model_type](_policy_config(draft)) if model_type in LAYER_MAPS else \
        f"vLLM's EAGLE drafter builds Llama layers, and a {model_type!r} layer is not one (exportable: {', '.join(LAYER_MAPS)})"
    return mapped if isinstance(mapped, str) else None


def _logits_difference(draft: DraftHead) -> str | None:
    names = [type(t).__name__ for t, _ in draft.policy.head.transforms]
    return (f"the policy transforms its logits ({', '.join(names)}), which vLLM's EAGLE drafter does not"
            if names else None)


EXPORT_CHECKS: tuple[Callable[[DraftHead], str | None], ...] = (
    _layout_difference, _vocabulary_difference, _layer_difference, _logits_difference)
"""Each returns why vLLM's EAGLE drafter would propose differently from ``draft`` (None: it would not)."""


def export_problem(draft: DraftHead) -> str | None:
    """The first reason ``draft`` cannot be exported exactly (None: it can)."""
    return next((problem for check in EXPORT_CHECKS if (problem := check(draft)) is not None), None)


def _policy_config(draft: DraftHead):
    return draft.layers[0].self_attn.config


def vllm_config(draft: DraftHead) -> dict:
    """The folder's ``config.json``: the policy's config as a Llama config of the draft's layers."""
    config = _policy_config(draft)
    fields = config.to_dict()
    for key in ("auto_map", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
                "_attn_implementation", "_name_or_path", "quantization_config"):
        fields.pop(key, None)
    fields.update(LAYER_MAPS[draft.config.model_type](config))
    fields.update(model_type="llama", architectures=[VLLM_ARCHITECTURE], num_hidden_layers=draft.config.num_layers,
                  head_dim=draft.layers[0].self_attn.head_dim, dtype=str(next(draft.parameters()).dtype).removeprefix("torch."))
    return fields


def vllm_weights(draft: DraftHead) -> dict[str, torch.Tensor]:
    """The draft's weights under the names vLLM's ``EagleLlamaForCausalLM.load_weights`` reads (it adds the
    ``model.`` prefix and fuses q/k/v and gate/up itself); no embeddings or LM head: vLLM shares the target's."""
    weights = {"fc.weight": draft.fuse.weight}
    weights.update({f"layers.{name}": tensor for name, tensor in draft.layers.state_dict().items()})
    return {name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()}


def export_vllm_draft(draft: DraftHead, folder: str | Path) -> Path:
    """Write ``draft`` into ``folder`` as vLLM's EAGLE drafter (module docstring); a ValueError naming the
    difference when vLLM would propose differently (nothing is written then)."""
    problem = export_problem(draft)
    if problem is not None:
        raise ValueError(f"cannot export this draft to vLLM's EAGLE exactly: {problem}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(vllm_weights(draft), folder / VLLM_WEIGHTS_FILE)
    write_text_atomically(folder / VLLM_CONFIG_FILE, json.dumps(vllm_config(draft), indent=2, default=str))
    return folder
