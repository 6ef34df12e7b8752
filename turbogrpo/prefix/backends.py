"""Attention backends for the shared-prefix layout, registered in one table.

Each backend is one long-lived object in :data:`BACKENDS` (state that outlives a pack, such as
compiled kernels, lives on it). ``backend.plan(layout)`` binds it to one :class:`PackedGroups`
pack and gives the attention plan for ``hook.run_decoder``:
``plan(module, q [1, H, T, D], k [1, Hkv, T, D], v, *, scaling, sliding_window) -> [1, T, H, D]``.

* ``reference``: one SDPA call with the dense ``[T, T]`` boolean mask. Obviously right, quadratic
  memory in T; used by tests.
* ``cascade``: prompts attend causally among themselves (one batched causal SDPA over the padded
  prompts); completion tokens attend to their group's prompt K/V (one batched unmasked call with
  all G completions of a group in one query row, so the prompt K/V is read once and never copied
  G times) and causally to their own tokens; the two partials are merged with their
  log-sum-exps. A custom autograd function (:class:`MergedPartsAttention`) computes the
  backward part by part.
* ``varlen``: the cascade's parts on variable-length packed segments (cu_seqlens) instead of
  padded rows, so nothing is padded: torch's flash-attention varlen kernel on CUDA (float16 /
  bfloat16), a per-segment reference loop elsewhere.
* ``flex``: FlexAttention with a block mask, compiled; used on CUDA, where it has a backward.

:func:`backend_names` lists what ``backend=`` accepts (for config validation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from turbogrpo.hook import causal_band
from turbogrpo.mixers.forest import SegmentForest
from turbogrpo.prefix.compile import eager_plan
from turbogrpo.prefix.kernels import (attention_backward, attention_forward, flash_varlen_available, merge_partials,
                                      varlen_backward, varlen_forward)
from turbogrpo.prefix.layout import PackedGroups, PaddedIndex, VarlenSegments

BACKENDS: dict[str, PrefixAttention] = {}
AUTO = "auto"


def registrar(table: dict) -> Callable[[str], Callable[[type], type]]:
    """``register(name)``: a class decorator that puts one instance of the class into ``table`` under
    ``name`` (and names the class so)."""
    def register(name: str) -> Callable[[type], type]:
        def decorate(cls: type) -> type:
            cls.name = name
            table[name] = cls()
            return cls
        return decorate
    return register


register_backend = registrar(BACKENDS)
"""Class decorator: register one instance of the class in ``BACKENDS`` under ``name``."""


def backend_names() -> tuple[str, ...]:
    """Every value ``backend=`` accepts: "auto" and the registered backends."""
    return (AUTO, *BACKENDS)


def select_backend(name: str, device: torch.device, requires_grad: bool) -> PrefixAttention:
    """Resolve a registered backend name, checking it can run here ("auto" is resolved before this,
    by ``turbogrpo.prefix.auto``)."""
    return registered_backend(BACKENDS, name, device, requires_grad, "attention backend")


def registered_backend(table: dict, name: str, device: torch.device, requires_grad: bool, what: str):
    """``table[name]`` where it can run on ``device`` (with gradients, if ``requires_grad``); a ValueError
    naming ``what`` and the choices otherwise."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {[AUTO, *table]}")
    backend = table[name]
    if not backend.available(device, requires_grad):
        raise ValueError(f"{what} {name!r} is not available on {device.type}"
                         f"{' with gradients' if requires_grad else ''}; {backend.unavailable_hint}")
    return backend


class PrefixAttention:
    """Base class of a backend: ``plan(layout)`` gives the attention plan of one pack.

    ``attend(plan, q, k, v, scaling, sliding_window)``: ``sliding_window`` is None unless the layer's
    window is shorter than the pack's longest sequence; backends with ``supports_sliding_window``
    apply it (``0 <= q_pos - k_pos < window``, as transformers does), the others are never called with one.
    """

    name: ClassVar[str]
    unavailable_hint: ClassVar[str] = ""
    supports_sliding_window: ClassVar[bool] = False

    def available(self, device: torch.device, requires_grad: bool) -> bool:
        return True

    def plan(self, layout: PackedGroups) -> PackPlan:
        return PackPlan(self, layout)

    def attend(self, plan: PackPlan, query, key, value, scaling, sliding_window):
        raise NotImplementedError


class PlanCache:
    """What a backend builds once per pack (or trie) and every attention layer shares: ``cached(key,
    build)`` returns ``build()``'s value, built at the first call with ``key``."""

    def __init__(self):
        self._cache: dict = {}

    def cached(self, key, build: Callable):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


class PackPlan(PlanCache):
    """A backend bound to one pack: what ``hook.run_decoder`` calls in every attention layer; its masks
    are built once per pack (``PlanCache``)."""

    def __init__(self, backend: PrefixAttention, layout: PackedGroups):
        super().__init__()
        self.backend, self.layout = backend, layout

    @eager_plan
    def __call__(self, module, query, key, value, *, scaling: float, sliding_window: int | None):
        if sliding_window is not None and self.layout.max_sequence_length <= sliding_window:
            sliding_window = None   # the window hides nothing in this pack
        if sliding_window is not None and not self.backend.supports_sliding_window:
            windowed = [name for name, backend in BACKENDS.items() if backend.supports_sliding_window]
            raise ValueError(
                f"layer {module.layer_idx} uses a sliding window of {sliding_window} tokens but a sequence "
                f"in this pack is {self.layout.max_sequence_length} tokens long, and attention backend "
                f"{self.backend.name!r} implements full causal attention only; use one of {windowed} "
                "(or backend='auto', which picks one).")
        return self.backend.attend(self, query, key, value, scaling, sliding_window)

    def recurrent_layout(self) -> SegmentForest:
        """What the pack's recurrent layers run over (``turbogrpo.mixers``): prompts once, completions from
        their prompt's final state."""
        return self.layout.segment_forest


@register_backend("reference")
class ReferenceAttention(PrefixAttention):
    supports_sliding_window = True

    def attend(self, plan, query, key, value, scaling, sliding_window):
        mask = plan.cached(("dense", sliding_window), lambda: plan.layout.dense_mask(sliding_window))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


@register_backend("cascade")
class CascadeAttention(PrefixAttention):
    supports_sliding_window = True

    def attend(self, plan, query, key, value, scaling, sliding_window):
        layout = plan.layout
        (q_prompt, q_completion), (k_prompt, k_completion), (v_prompt, v_completion) = (
            _split_prompt_completion(layout, x) for x in (query, key, value))

        prompts = layout.prompt_padded
        # Padding sits at the end of each row, so causal masking (banded under a sliding window) never
        # lets a real query see it.
        band = causal_band(prompts.width, sliding_window, query.device)
        out_prompt = F.scaled_dot_product_attention(
            _rows(prompts, q_prompt), _rows(prompts, k_prompt), _rows(prompts, v_prompt), attn_mask=band,
            is_causal=band is None, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        parts = plan.cached(("parts", sliding_window, query.dtype),
                            lambda: _padded_completion_parts(layout, query.dtype, sliding_window))
        out_completion = MergedPartsAttention.apply(
            parts, scaling, q_completion, k_prompt, v_prompt, k_completion, v_completion)
        return torch.cat([_unrows(prompts, out_prompt), out_completion]).unsqueeze(0)


@register_backend("varlen")
class VarlenAttention(PrefixAttention):
    """The cascade on packed segments (cu_seqlens) instead of padded rows: no padding at all.

    Prompts attend causally among themselves (one segment per prompt); completion queries attend
    to their group's prompt (one query segment per group) and causally to their own tokens (one
    segment per completion), merged by log-sum-exp. On CUDA each part is one flash-attention varlen
    call; elsewhere a per-segment reference loop (see ``kernels.varlen_forward``).
    """

    unavailable_hint = ("it needs torch's flash-attention varlen ops (torch.ops.aten._flash_attention_forward), "
                        "which this torch build lacks; use backend='flex' or 'cascade'.")

    def available(self, device, requires_grad):
        # Off CUDA the segment-loop reference runs anywhere (slow, but exact: the tests use it).
        return device.type != "cuda" or flash_varlen_available()

    def attend(self, plan, query, key, value, scaling, sliding_window):
        layout = plan.layout
        (q_prompt, q_completion), (k_prompt, k_completion), (v_prompt, v_completion) = (
            _split_prompt_completion(layout, x) for x in (query, key, value))
        prompts = _VarlenPart(layout.prompt_segments, layout.prompt_segments, causal=True)
        out_prompt = MergedPartsAttention.apply((prompts,), scaling, q_prompt, k_prompt, v_prompt)
        out_completion = MergedPartsAttention.apply(
            _varlen_completion_parts(layout), scaling, q_completion, k_prompt, v_prompt, k_completion, v_completion)
        return torch.cat([out_prompt, out_completion]).unsqueeze(0)


class PaddedCausalAttention:
    """The standard layout's attention plan: every completion with its own prompt copy, right-padded
    into ``[B, T]`` rows.

    Padding sits after every real token of its row, so causal masking alone keeps real queries off
    it (pad queries compute values nobody reads): no padding mask is built or inspected, which keeps
    the baseline free of host syncs and on the fastest SDPA kernel. A layer with a sliding window
    shorter than ``T`` gets the banded causal mask (``q - k < window``, as transformers builds it).
    """

    def __init__(self, length: int):
        self.length = length

    @eager_plan
    def __call__(self, module, query, key, value, *, scaling: float, sliding_window: int | None):
        band = causal_band(self.length, sliding_window, query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=band, is_causal=band is None,
                                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)

    def recurrent_layout(self) -> None:
        """None: every row is one whole sequence from position 0, which a recurrent layer's own forward runs
        (right padding follows every real token, so it never reaches one)."""
        return None


def _split_prompt_completion(layout: PackedGroups, x_1HTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, H, T, D]`` -> flat ``[Np, H, D]`` prompt and ``[Nq, H, D]`` completion token views."""
    # split/squeeze rather than slicing/indexing: their backward is a cat/view, where a slice's
    # backward would zero-fill a full [T, H, D] buffer per use.
    return x_1HTD.squeeze(0).transpose(0, 1).split([layout.num_prompt_tokens, layout.num_completion_tokens])


def _rows(index: PaddedIndex, flat_NHD: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` flat tokens -> ``[R, H, W, D]`` padded rows, the layout attention kernels take."""
    return index.to_padded(flat_NHD).transpose(1, 2)


def _unrows(index: PaddedIndex, rows_RHW: torch.Tensor) -> torch.Tensor:
    """``[R, H, W, ...]`` -> ``[N, H, ...]`` (drops pad slots)."""
    return index.to_flat(rows_RHW.transpose(1, 2))


class _PaddedPart(NamedTuple):
    """One partial attention over padded rows: which rows the queries and keys form.

    ``forward(q [Nq, H, D], k, v [Nk, Hkv, D], scale) -> (out [Nq, H, D], lse [Nq, H], residual)``
    and ``backward(grad_out, q, k, v, out, lse, residual, scale) -> (dq, dk, dv)`` work on flat
    tokens; ``residual`` is whatever the backward needs from this part's own forward.
    """

    queries: PaddedIndex
    keys: PaddedIndex
    key_bias: torch.Tensor | None   # additive mask: [R, 1, 1, W_keys] for padded keys, [R, 1, W_q, W_keys] windowed
    causal: bool
    hidden_rows: torch.Tensor | None = None   # [R, 1, W_q] queries that see no key of this part (a window)

    def forward(self, q, k, v, scale):
        out, lse = attention_forward(_rows(self.queries, q), _rows(self.keys, k), _rows(self.keys, v),
                                     self.key_bias, causal=self.causal, scale=scale)
        if self.hidden_rows is not None:
            # Such a row's output is 0; its log-sum-exp is -inf (CPU flash reports 0), so merging ignores it.
            lse = lse.masked_fill(self.hidden_rows, float("-inf"))
        return _unrows(self.queries, out), _unrows(self.queries, lse[..., None])[..., 0], lse

    def backward(self, grad_out, q, k, v, out, lse, part_lse_rows, scale):
        rows_grad, rows_out = _rows(self.queries, grad_out), _rows(self.queries, out)
        rows_lse = _rows(self.queries, lse)  # [N, H] -> [R, H, W], like any per-token tensor
        if not self.queries.is_dense:
            valid = self.queries.valid[:, None, :]
            rows_grad = rows_grad * valid[..., None]
            # Pad rows keep their own forward lse so that exp(scores - lse) stays finite there.
            rows_lse = torch.where(valid, rows_lse, part_lse_rows)
        dq, dk, dv = attention_backward(rows_grad, _rows(self.queries, q), _rows(self.keys, k),
                                        _rows(self.keys, v), rows_out, rows_lse, self.key_bias,
                                        causal=self.causal, scale=scale)
        return _unrows(self.queries, dq), _unrows(self.keys, dk), _unrows(self.keys, dv)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    # Merging half-precision partials in half precision would round the result a second time.
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _VarlenPart(NamedTuple):
    """One partial attention over packed segments (same interface as :class:`_PaddedPart`)."""

    queries: VarlenSegments
    keys: VarlenSegments
    causal: bool

    def forward(self, q, k, v, scale):
        out, lse = varlen_forward(q, k, v, *self._segments(), causal=self.causal, scale=scale, **self._lengths())
        return out, lse, None

    def backward(self, grad_out, q, k, v, out, lse, _residual, scale):
        return varlen_backward(grad_out, q, k, v, out, lse, *self._segments(), causal=self.causal, scale=scale,
                               **self._lengths())

    def _segments(self):
        return (self.queries.cu_seqlens, self.keys.cu_seqlens, self.queries.max_length, self.keys.max_length)

    def _lengths(self):
        return dict(lengths_q=self.queries.lengths, lengths_k=self.keys.lengths)


def _padded_completion_parts(layout: PackedGroups, dtype: torch.dtype,
                             sliding_window: int | None = None) -> tuple[_PaddedPart, _PaddedPart]:
    """shared: a group's completion tokens (all G completions in one row) against its prompt;
    own: each completion's tokens against themselves, causally. Under a sliding window both parts
    also hide keys ``window`` or more positions behind the query."""
    prompts, completions = layout.prompt_padded, layout.completions_padded
    if sliding_window is None:
        bias = None if prompts.is_dense else _additive(prompts.valid, dtype)[:, None, None, :]
        shared = _PaddedPart(layout.group_queries_padded, prompts, bias, causal=False)
        own = _PaddedPart(completions, completions, None, causal=True)
        return shared, own
    key_positions = torch.arange(prompts.width, device=layout.device)
    query_positions = layout.group_query_positions_padded                      # [Ng, Q_max]
    visible = prompts.valid[:, None, :] & (query_positions[:, :, None] - key_positions < sliding_window)
    shared = _PaddedPart(layout.group_queries_padded, prompts, _additive(visible, dtype)[:, None], causal=False,
                         hidden_rows=~visible.any(-1)[:, None])                 # bias [Ng, 1, Q_max, P_max]
    band = causal_band(completions.width, sliding_window, layout.device)
    own = _PaddedPart(completions, completions, None if band is None else _additive(band, dtype), causal=True)
    return shared, own


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> additive float mask (0 kept, -inf hidden)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


def _varlen_completion_parts(layout: PackedGroups) -> tuple[_VarlenPart, _VarlenPart]:
    """The same two parts as :func:`_padded_completion_parts`, as packed segments."""
    shared = _VarlenPart(layout.group_query_segments, layout.prompt_segments, causal=False)
    own = _VarlenPart(layout.completion_segments, layout.completion_segments, causal=True)
    return shared, own


class MergedPartsAttention(torch.autograd.Function):
    """Queries attending to several disjoint key sets ("parts"), merged by their log-sum-exps.

    ``apply(parts, scale, q [N, H, D], k_1, v_1, k_2, v_2, ...)`` with ``k_i, v_i [N_i, Hkv, D]`` the
    keys of ``parts[i]``; returns ``[N, H, D]``. The backward runs each part's backward with the
    *merged* output and log-sum-exp, which gives exactly that part's share of the gradients (see
    kernels.py). With one part this is a plain attention with a hand-written backward.
    """

    @staticmethod
    def forward(ctx, parts, scale, q, *keys_values):
        keys = zip(keys_values[::2], keys_values[1::2])
        out = lse = None
        residuals = []
        for part, (k, v) in zip(parts, keys):
            part_out, part_lse, residual = part.forward(q, k, v, scale)
            residuals.append(residual)
            if out is None:
                out, lse = part_out, part_lse
            else:
                out, lse = merge_partials(_at_least_float32(out), lse, _at_least_float32(part_out), part_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, *keys_values, *residuals)
        ctx.parts, ctx.scale = parts, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, *rest = ctx.saved_tensors
        num_kv = 2 * len(ctx.parts)
        keys_values, residuals = rest[:num_kv], rest[num_kv:]
        keys = zip(keys_values[::2], keys_values[1::2])
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q)
        grad_keys = []
        for part, (k, v), residual in zip(ctx.parts, keys, residuals):
            dq, dk, dv = part.backward(grad_out, q, k, v, out, lse, residual, ctx.scale)
            grad_q += dq
            grad_keys += [dk, dv]
        return None, None, grad_q, *grad_keys


@register_backend("flex")
class FlexAttention(PrefixAttention):
    """One FlexAttention call per layer over the whole pack, with a block mask of the attention rule.

    The backend holds its kernels: ``flex_attention`` and ``create_block_mask`` compiled once per
    device type (on ``compile_devices``; eager elsewhere, where flex runs its math reference), with
    dynamic shapes, so packs of any length reuse one graph instead of compiling per length. The
    block mask is built once per pack (:meth:`plan`) and shared by every layer.
    """

    unavailable_hint = "FlexAttention has no backward on CPU in this torch; use backend='cascade'."

    def __init__(self, compiler="inductor", compile_devices=("cuda",)):
        self.compiler = compiler                # torch.compile backend (tests count compiles with their own)
        self.compile_devices = compile_devices
        self._kernels: dict[str, tuple[Callable, Callable]] = {}   # device type -> (flex, create_block_mask)

    def available(self, device, requires_grad):
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return False
        return device.type == "cuda" or not requires_grad

    def kernels(self, device: torch.device) -> tuple[Callable, Callable]:
        if device.type not in self._kernels:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            if device.type in self.compile_devices:
                flex_attention = torch.compile(flex_attention, backend=self.compiler, dynamic=True)
                create_block_mask = torch.compile(create_block_mask, backend=self.compiler, dynamic=True)
            self._kernels[device.type] = (flex_attention, create_block_mask)
        return self._kernels[device.type]

    supports_sliding_window = True

    def plan(self, layout):
        plan = PackPlan(self, layout)
        self.block_mask(plan, None)   # built with the pack, before the first layer runs
        return plan

    def block_mask(self, plan: PackPlan, sliding_window: int | None):
        """The pack's block mask under ``sliding_window`` (None: full causal), built once per pack."""
        def build():
            _, create_block_mask = self.kernels(plan.layout.device)
            length = plan.layout.num_prompt_tokens + plan.layout.num_completion_tokens
            return create_block_mask(attention_rule(plan.layout, sliding_window), None, None, length, length,
                                     device=plan.layout.device)
        return plan.cached(("block_mask", sliding_window), build)

    def attend(self, plan, query, key, value, scaling, sliding_window):
        flex_attention, _ = self.kernels(query.device)
        out = flex_attention(query, key, value, block_mask=self.block_mask(plan, sliding_window), scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


def attention_rule(layout: PackedGroups, sliding_window: int | None = None) -> Callable:
    """The layout's attention rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
    group, completion = layout.segment_ids
    pos = layout.position_ids

    def rule(b, h, q_idx, kv_idx):
        return ((group[q_idx] == group[kv_idx]) & (pos[kv_idx] <= pos[q_idx])
                & ((completion[kv_idx] == -1) | (completion[kv_idx] == completion[q_idx])))

    if sliding_window is None:
        return rule

    def windowed_rule(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx) & (pos[q_idx] - pos[kv_idx] < sliding_window)
    return windowed_rule
