"""Attention backends for the shared-prefix layout, registered in one table.

Each backend turns a :class:`PackedGroups` layout into an attention plan for ``hook.run_decoder``:
``plan(module, q [1, H, T, D], k [1, Hkv, T, D], v, *, scaling, sliding_window) -> [1, T, H, D]``.

* ``reference``: one SDPA call with the dense ``[T, T]`` boolean mask. Obviously right, quadratic
  memory in T; used by tests.
* ``cascade``: prompts attend causally among themselves (one batched causal SDPA over the padded
  prompts); completion tokens attend to their group's prompt K/V (one batched unmasked call with
  all G completions of a group in one query row, so the prompt K/V is read once and never copied
  G times) and causally to their own tokens; the two partials are merged with their
  log-sum-exps. A custom autograd function computes the backward part by part.
* ``flex``: FlexAttention with a block mask, compiled; used on CUDA, where it has a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from turbogrpo.prefix.kernels import attention_backward, attention_forward, merge_partials
from turbogrpo.prefix.layout import PackedGroups, PaddedIndex

BACKENDS: dict[str, type[PrefixAttention]] = {}


def register_backend(name: str) -> Callable[[type], type]:
    def decorate(cls: type) -> type:
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return decorate


def select_backend(name: str, device: torch.device, requires_grad: bool) -> type[PrefixAttention]:
    """Resolve a backend name ("auto" picks the fastest correct one for the device)."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "cascade"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {['auto', *BACKENDS]}")
    backend = BACKENDS[name]
    if not backend.available(device, requires_grad):
        raise ValueError(f"attention backend {name!r} is not available on {device.type}"
                         f"{' with gradients' if requires_grad else ''}; {backend.unavailable_hint}")
    return backend


class PrefixAttention:
    """Base class: an attention plan bound to one pack."""

    name: ClassVar[str]
    unavailable_hint: ClassVar[str] = ""

    def __init__(self, layout: PackedGroups):
        self.layout = layout

    @classmethod
    def available(cls, device: torch.device, requires_grad: bool) -> bool:
        return True

    def __call__(self, module, query, key, value, *, scaling: float, sliding_window: int | None):
        if sliding_window is not None and self.layout.max_sequence_length > sliding_window:
            raise ValueError(
                f"layer {module.layer_idx} uses a sliding window of {sliding_window} tokens but a sequence "
                f"in this pack is {self.layout.max_sequence_length} tokens long; the shared-prefix layout "
                "implements full causal attention only. Shorten the sequences or disable the sliding window.")
        return self.attend(query, key, value, scaling)

    def attend(self, query, key, value, scaling):
        raise NotImplementedError


@register_backend("reference")
class ReferenceAttention(PrefixAttention):
    def attend(self, query, key, value, scaling):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.layout.dense_mask(),
                                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


@register_backend("cascade")
class CascadeAttention(PrefixAttention):
    def attend(self, query, key, value, scaling):
        layout = self.layout
        sizes = [layout.num_prompt_tokens, layout.num_completion_tokens]
        # split/squeeze rather than slicing/indexing: their backward is a cat/view, where a slice's
        # backward would zero-fill a full [T, H, D] buffer per use.
        (q_prompt, q_completion), (k_prompt, k_completion), (v_prompt, v_completion) = (
            x.squeeze(0).transpose(0, 1).split(sizes) for x in (query, key, value))

        prompts = layout.prompt_padded
        # Padding sits at the end of each row, so plain causal masking never lets a real query see it.
        out_prompt = F.scaled_dot_product_attention(
            _rows(prompts, q_prompt), _rows(prompts, k_prompt), _rows(prompts, v_prompt),
            is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        out_completion = SharedPrefixAttention.apply(
            q_completion, k_prompt, v_prompt, k_completion, v_completion, layout, scaling)
        return torch.cat([_unrows(prompts, out_prompt), out_completion]).unsqueeze(0)


def _rows(index: PaddedIndex, flat_NHD: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` flat tokens -> ``[R, H, W, D]`` padded rows, the layout attention kernels take."""
    return index.to_padded(flat_NHD).transpose(1, 2)


def _unrows(index: PaddedIndex, rows_RHW: torch.Tensor) -> torch.Tensor:
    """``[R, H, W, ...]`` -> ``[N, H, ...]`` (drops pad slots)."""
    return index.to_flat(rows_RHW.transpose(1, 2))


class _Part(NamedTuple):
    """One partial attention of the completion queries: which rows the queries and keys form."""

    queries: PaddedIndex
    keys: PaddedIndex
    key_bias: torch.Tensor | None   # additive [R, 1, 1, W_keys] mask for padded keys
    causal: bool


def _completion_parts(layout: PackedGroups, dtype: torch.dtype) -> tuple[_Part, _Part]:
    """shared: a group's completion tokens (all G completions in one row) against its prompt;
    own: each completion's tokens against themselves, causally."""
    prompts = layout.prompt_padded
    bias = None
    if not prompts.is_dense:
        bias = torch.zeros(prompts.valid.shape, dtype=dtype, device=prompts.valid.device)
        bias = bias.masked_fill(~prompts.valid, float("-inf"))[:, None, None, :]
    shared = _Part(layout.group_queries_padded, prompts, bias, causal=False)
    own = _Part(layout.completions_padded, layout.completions_padded, None, causal=True)
    return shared, own


class SharedPrefixAttention(torch.autograd.Function):
    """Completion queries attending to their group's prompt (shared) and causally to themselves.

    Inputs (flat, in the pack's order): ``q_completion [Nq, H, D]``, ``k_prompt, v_prompt [Np, Hkv, D]``,
    ``k_completion, v_completion [Nq, Hkv, D]``. Output ``[Nq, H, D]``. The prompt's K/V enter the
    shared part once per group; nothing is repeated per completion.
    """

    @staticmethod
    def forward(ctx, q_completion, k_prompt, v_prompt, k_completion, v_completion, layout, scale):
        parts = _completion_parts(layout, q_completion.dtype)
        keys = ((k_prompt, v_prompt), (k_completion, v_completion))
        partials, part_lses = [], []
        for part, (k, v) in zip(parts, keys):
            out, lse = attention_forward(_rows(part.queries, q_completion), _rows(part.keys, k),
                                         _rows(part.keys, v), part.key_bias, causal=part.causal, scale=scale)
            partials.append((_unrows(part.queries, out), _unrows(part.queries, lse[..., None])[..., 0]))
            part_lses.append(lse)
        out, lse = merge_partials(*partials[0], *partials[1])
        out = out.to(q_completion.dtype)
        ctx.save_for_backward(q_completion, k_prompt, v_prompt, k_completion, v_completion, out, lse, *part_lses)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_completion, k_prompt, v_prompt, k_completion, v_completion, out, lse, *part_lses = ctx.saved_tensors
        parts = _completion_parts(ctx.layout, q_completion.dtype)
        keys = ((k_prompt, v_prompt), (k_completion, v_completion))
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q_completion)
        grad_keys = []
        for part, (k, v), part_lse in zip(parts, keys, part_lses):
            rows_grad, rows_out = _rows(part.queries, grad_out), _rows(part.queries, out)
            rows_lse = _unrows_lse_inverse(part.queries, lse)
            if not part.queries.is_dense:
                valid = part.queries.valid[:, None, :]
                rows_grad = rows_grad * valid[..., None]
                # Pad rows keep their own forward lse so that exp(scores - lse) stays finite there.
                rows_lse = torch.where(valid, rows_lse, part_lse)
            dq, dk, dv = attention_backward(rows_grad, _rows(part.queries, q_completion), _rows(part.keys, k),
                                            _rows(part.keys, v), rows_out, rows_lse, part.key_bias,
                                            causal=part.causal, scale=ctx.scale)
            grad_q += _unrows(part.queries, dq)
            grad_keys += [_unrows(part.keys, dk), _unrows(part.keys, dv)]
        return grad_q, *grad_keys, None, None


def _unrows_lse_inverse(index: PaddedIndex, lse_NH: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` flat log-sum-exps -> ``[R, H, W]`` rows."""
    return index.to_padded(lse_NH).transpose(1, 2)


_compiled_flex = None


@register_backend("flex")
class FlexAttention(PrefixAttention):
    unavailable_hint = "FlexAttention has no backward on CPU in this torch; use backend='cascade'."

    @classmethod
    def available(cls, device, requires_grad):
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return False
        return device.type == "cuda" or not requires_grad

    def attend(self, query, key, value, scaling):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        global _compiled_flex
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True) if query.is_cuda else flex_attention
        block_mask = self._block_mask(create_block_mask, query.shape[2], query.device)
        out = _compiled_flex(query, key, value, block_mask=block_mask, scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)

    def _block_mask(self, create_block_mask, length, device):
        # Built once per pack and shared by every layer.
        if getattr(self, "_mask", None) is None:
            group, completion = self.layout.segment_ids
            pos = self.layout.position_ids

            def rule(b, h, q_idx, kv_idx):
                return ((group[q_idx] == group[kv_idx]) & (pos[kv_idx] <= pos[q_idx])
                        & ((completion[kv_idx] == -1) | (completion[kv_idx] == completion[q_idx])))

            self._mask = create_block_mask(rule, None, None, length, length, device=device)
        return self._mask
