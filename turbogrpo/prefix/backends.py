"""Attention backends for the shared-prefix layout, registered in one table.

Each backend turns a :class:`PackedGroups` layout into an attention plan for ``hook.run_decoder``:
``plan(module, q [1, H, T, D], k [1, Hkv, T, D], v, *, scaling, sliding_window) -> [1, T, H, D]``.

* ``reference``: one SDPA call with the dense ``[T, T]`` boolean mask. Obviously right, quadratic
  memory in T; used by tests.
* ``cascade``: prompts attend causally among themselves (one batched causal SDPA over the padded
  prompts); completion tokens attend to their group's prompt K/V (one batched unmasked product per
  group, every completion of the group folded into the query axis, so the prompt K/V is read once
  and never copied G times) and causally to their own tokens; the two partials are merged with
  their log-sum-exps. A custom autograd function recomputes the backward part by part.
* ``flex``: FlexAttention with a block mask, compiled; used on CUDA, where it has a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F

from turbogrpo.prefix.kernels import attention_backward, attention_forward, merge_partials
from turbogrpo.prefix.layout import PackedGroups

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


def _repeat_kv(x: torch.Tensor, num_rep: int, dim: int) -> torch.Tensor:
    """Repeat each KV head ``num_rep`` times along ``dim`` (query head h uses KV head h // num_rep)."""
    return x if num_rep == 1 else x.repeat_interleave(num_rep, dim=dim)


@register_backend("reference")
class ReferenceAttention(PrefixAttention):
    def attend(self, query, key, value, scaling):
        num_rep = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(
            query, _repeat_kv(key, num_rep, 1), _repeat_kv(value, num_rep, 1),
            attn_mask=self.layout.dense_mask(), scale=scaling)
        return out.transpose(1, 2)


@register_backend("cascade")
class CascadeAttention(PrefixAttention):
    def attend(self, query, key, value, scaling):
        layout = self.layout
        num_prompt = layout.num_prompt_tokens
        q_THD, k_TKD, v_TKD = (x[0].transpose(0, 1) for x in (query, key, value))
        num_rep = q_THD.shape[1] // k_TKD.shape[1]

        prompts = layout.prompt_padded
        q_prompt = prompts.to_padded(q_THD[:num_prompt]).transpose(1, 2)
        k_prompt = _repeat_kv(prompts.to_padded(k_TKD[:num_prompt]).transpose(1, 2), num_rep, 1)
        v_prompt = _repeat_kv(prompts.to_padded(v_TKD[:num_prompt]).transpose(1, 2), num_rep, 1)
        # Padding sits at the end of each row, so plain causal masking never lets a real query see it.
        out_prompt = F.scaled_dot_product_attention(q_prompt, k_prompt, v_prompt, is_causal=True, scale=scaling)
        out_prompt = prompts.to_flat(out_prompt.transpose(1, 2))

        out_completion = SharedPrefixAttention.apply(
            q_THD[num_prompt:], k_TKD[:num_prompt], v_TKD[:num_prompt],
            k_TKD[num_prompt:], v_TKD[num_prompt:], layout, scaling)
        return torch.cat([out_prompt, out_completion]).unsqueeze(0)


class SharedPrefixAttention(torch.autograd.Function):
    """Completion queries attending to their group's prompt (shared) and causally to themselves.

    Inputs (flat, in the pack's order): ``q_completion [Nq, H, D]``, ``k_prompt, v_prompt [Np, Hkv, D]``,
    ``k_completion, v_completion [Nq, Hkv, D]``. Output ``[Nq, H, D]``.
    """

    @staticmethod
    def forward(ctx, q_completion, k_prompt, v_prompt, k_completion, v_completion, layout, scale):
        parts = _CascadeParts(layout, q_completion, k_prompt, v_prompt, k_completion, v_completion)
        out_shared, lse_shared = attention_forward(*parts.shared_inputs(), parts.prompt_bias,
                                                   causal=False, scale=scale)
        out_own, lse_own = attention_forward(*parts.own_inputs(), None, causal=True, scale=scale)
        out, lse = merge_partials(*parts.shared_to_flat(out_shared, lse_shared),
                                  *parts.own_to_flat(out_own, lse_own))
        out = out.to(q_completion.dtype)
        ctx.save_for_backward(q_completion, k_prompt, v_prompt, k_completion, v_completion,
                              out, lse, lse_shared, lse_own)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_completion, k_prompt, v_prompt, k_completion, v_completion, out, lse, lse_shared, lse_own = \
            ctx.saved_tensors
        parts = _CascadeParts(ctx.layout, q_completion, k_prompt, v_prompt, k_completion, v_completion)
        grad_out = grad_out.contiguous()

        dq_shared, dk_prompt, dv_prompt = attention_backward(
            *parts.shared_from_flat(grad_out, out, lse, lse_shared), parts.prompt_bias,
            causal=False, scale=ctx.scale)
        dq_own, dk_own, dv_own = attention_backward(
            *parts.own_from_flat(grad_out, out, lse, lse_own), None, causal=True, scale=ctx.scale)

        dq = parts.shared_queries_to_flat(dq_shared) + parts.own_queries_to_flat(dq_own)
        dk_prompt, dv_prompt = parts.prompt_keys_to_flat(dk_prompt), parts.prompt_keys_to_flat(dv_prompt)
        dk_completion, dv_completion = parts.own_keys_to_flat(dk_own), parts.own_keys_to_flat(dv_own)
        return dq, dk_prompt, dv_prompt, dk_completion, dv_completion, None, None


class _CascadeParts:
    """Moves flat tensors in and out of the two padded layouts the cascade computes in.

    shared part: ``[Ng, Hkv, Q_max * rep, D]`` queries (a group's completion tokens and the ``rep``
    query heads per KV head folded together) against ``[Ng, Hkv, P_max, D]`` prompt keys;
    own part: ``[Nc, H, S_max, D]`` queries against the completion's own keys, causal.
    """

    def __init__(self, layout: PackedGroups, q, k_prompt, v_prompt, k_completion, v_completion):
        self.layout = layout
        self.groups, self.prompts, self.completions = (
            layout.group_queries_padded, layout.prompt_padded, layout.completions_padded)
        self.q, self.k_prompt, self.v_prompt = q, k_prompt, v_prompt
        self.k_completion, self.v_completion = k_completion, v_completion
        self.num_heads, self.num_kv_heads = q.shape[1], k_prompt.shape[1]
        self.num_rep = self.num_heads // self.num_kv_heads

    # -- shared part --
    @property
    def prompt_bias(self) -> torch.Tensor | None:
        if all(p == self.prompts.width for p in self.layout.prompt_lengths):
            return None
        bias = torch.zeros(self.prompts.valid.shape, dtype=self.q.dtype, device=self.q.device)
        return bias.masked_fill(~self.prompts.valid, float("-inf"))[:, None, None, :]

    def _fold(self, x_NgQH):
        """``[Ng, Q, H, ...]`` -> ``[Ng, Hkv, Q * rep, ...]``."""
        ng, q = x_NgQH.shape[:2]
        rest = x_NgQH.shape[3:]
        x = x_NgQH.reshape(ng, q, self.num_kv_heads, self.num_rep, *rest).transpose(1, 2)
        return x.reshape(ng, self.num_kv_heads, q * self.num_rep, *rest)

    def _unfold(self, x):
        """Inverse of ``_fold``, then back to flat ``[Nq, H, ...]``."""
        ng, _, qr = x.shape[:3]
        rest = x.shape[3:]
        x = x.reshape(ng, self.num_kv_heads, qr // self.num_rep, self.num_rep, *rest).transpose(1, 2)
        return self.groups.to_flat(x.reshape(ng, qr // self.num_rep, self.num_heads, *rest))

    def _shared_valid(self):
        valid = self.groups.valid[:, :, None].expand(-1, -1, self.num_heads)
        return self._fold(valid)

    def shared_inputs(self):
        q = self._fold(self.groups.to_padded(self.q))
        k = self.prompts.to_padded(self.k_prompt).transpose(1, 2)
        v = self.prompts.to_padded(self.v_prompt).transpose(1, 2)
        return q, k, v

    def shared_to_flat(self, out, lse):
        return self._unfold(out), self._unfold(lse)

    def shared_from_flat(self, grad_out, out, lse, lse_shared):
        q, k, v = self.shared_inputs()
        valid = self._shared_valid()
        grad = self._fold(self.groups.to_padded(grad_out)) * valid[..., None]
        out_padded = self._fold(self.groups.to_padded(out))
        # Pad rows keep their own forward lse so that exp(scores - lse) stays finite there.
        lse_padded = torch.where(valid, self._fold(self.groups.to_padded(lse)), lse_shared)
        return grad, q, k, v, out_padded, lse_padded

    def shared_queries_to_flat(self, dq):
        return self._unfold(dq)

    def prompt_keys_to_flat(self, dk):
        return self.prompts.to_flat(dk.transpose(1, 2))

    # -- own part --
    def own_inputs(self):
        q = self.completions.to_padded(self.q).transpose(1, 2)
        k = _repeat_kv(self.completions.to_padded(self.k_completion), self.num_rep, 2).transpose(1, 2)
        v = _repeat_kv(self.completions.to_padded(self.v_completion), self.num_rep, 2).transpose(1, 2)
        return q, k, v

    def own_to_flat(self, out, lse):
        return self.completions.to_flat(out.transpose(1, 2)), self.completions.to_flat(lse.transpose(1, 2))

    def own_from_flat(self, grad_out, out, lse, lse_own):
        q, k, v = self.own_inputs()
        valid = self.completions.valid[:, None, :]
        grad = self.completions.to_padded(grad_out).transpose(1, 2) * valid[..., None]
        out_padded = self.completions.to_padded(out).transpose(1, 2)
        lse_padded = torch.where(valid, self.completions.to_padded(lse).transpose(1, 2), lse_own)
        return grad, q, k, v, out_padded, lse_padded

    def own_queries_to_flat(self, dq):
        return self.completions.to_flat(dq.transpose(1, 2))

    def own_keys_to_flat(self, dk):
        nc, _, s, d = dk.shape
        dk = dk.reshape(nc, self.num_kv_heads, self.num_rep, s, d).sum(2)
        return self.completions.to_flat(dk.transpose(1, 2))


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
