"""Attention backends for the trie layout, registered in one table.

The rule (:mod:`turbogrpo.tree.trie`): a token attends to the tokens on its own path at or above
it, at its depth position; under a sliding window only to those fewer than ``window`` depth
positions above it (the window is measured along the path, not in the flat order).

* ``cascade`` (CPU default): the prefix cascade, one level per node depth. The trie's nodes are cut
  into runs of at most ``MAX_RUN`` tokens (a chain of runs is the same trie). Part "own": every run
  attends causally to itself. Part "level j", for every run depth j: the run's descendants (a
  contiguous preorder range) attend to the run's tokens with no mask, all of a run's descendants
  in one query row, so a run's K/V is read once per level and never copied per descendant. The
  parts are merged by their log-sum-exps and differentiated part by part
  (``prefix.backends.MergedPartsAttention``). Rows of a part are batched into padded calls,
  bucketed by length (powers of two) so that padding at most doubles a row. Memory is linear in
  the tokens: the largest mask is a window's ``[rows, queries, min(run, window)]`` band, and a
  query far below a run's window is not given that run's keys at all.
  (On the CPU each call is the flash kernel, which never holds a call's full score matrix; on CUDA
  the calls run ``prefix.kernels``' matmul path, which does, ``[R, H, Wq, Wk]`` per call: use
  ``flex`` there for big tries.)
* ``reference``: one SDPA call with the dense ``[N, N]`` boolean mask. Obviously right, quadratic
  memory; for tests and small tries.
* ``flex``: FlexAttention with the rule as a ``mask_mod`` over per-token vectors (``k <= q <
  subtree_end[k]``; no dense mask is built), compiled on CUDA, where it has a backward.

Chosen for the CPU by measurement (``bench/tree.py --kernels``, results/tree_kernels.json; 2-core
AMD EPYC shared with other jobs, load average 3.4-4.2, one thread, medians of 5 alternated runs):
one attention layer (8 heads / 2 KV heads, head dim 64) forward + backward took 0.086 s in the
cascade against 0.207 s with the dense mask at 1,152 trie tokens, and 0.45 s against 2.09 s at
3,840 (the dense mask's work and memory grow as N^2, the cascade's as the ancestor pairs). In the
whole bench model at 1,152 tokens, where the linear layers dominate, the cascade's forward +
backward took 5.7 s against 7.8 s, and forward only 1.7 s (cascade), 1.9 s (dense), 3.5 s (flex,
uncompiled on the CPU). A depth-first walk keeping one path's K/V live (AReaL-DTA) was not built:
it trades the cascade's batched calls for a call per node. GPU speeds are unmeasured.

Shape legend: N trie tokens, H query heads, Hkv key/value heads, D head dim, R rows of a padded
call, Wq / Wk their query / key width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from turbogrpo.hook import causal_band
from turbogrpo.mixers.forest import SegmentForest
from turbogrpo.prefix.backends import BACKENDS as PREFIX_BACKENDS
from turbogrpo.prefix.backends import MergedPartsAttention, PlanCache, _additive, registered_backend, registrar
from turbogrpo.prefix.compile import eager_plan
from turbogrpo.prefix.kernels import attention_backward, attention_forward
from turbogrpo.prefix.layout import upload
from turbogrpo.tree.trie import TokenTrie

TREE_BACKENDS: dict[str, TreeAttention] = {}
AUTO = "auto"
# Longest run of one trie node that the cascade attends as one piece: bounds the windowed masks
# (a run's own band is MAX_RUN x MAX_RUN) while costing one more level per MAX_RUN prompt tokens.
MAX_RUN = 512


register_tree_backend = registrar(TREE_BACKENDS)
"""Class decorator: register one instance of the class in ``TREE_BACKENDS`` under ``name``."""


def tree_backend_names() -> tuple[str, ...]:
    return (AUTO, *TREE_BACKENDS)


# Fastest first, per device type; the first that can run here is used by backend="auto". CUDA's order
# is the natural choice (one fused kernel, no dense mask), not a measurement: no GPU measured it yet.
AUTO_TREE_BACKENDS = {"cuda": ("flex", "cascade"), "cpu": ("cascade",)}


def select_tree_backend(name: str, device: torch.device, requires_grad: bool) -> TreeAttention:
    if name == AUTO:
        for candidate in AUTO_TREE_BACKENDS.get(device.type, ("cascade",)):
            if TREE_BACKENDS[candidate].available(device, requires_grad):
                return TREE_BACKENDS[candidate]
        return TREE_BACKENDS["cascade"]
    return registered_backend(TREE_BACKENDS, name, device, requires_grad, "tree attention backend")


class TreeAttention:
    """Base class of a backend: ``plan(trie, device)`` gives the attention plan of one trie."""

    name: ClassVar[str]
    unavailable_hint: ClassVar[str] = ""

    def available(self, device: torch.device, requires_grad: bool) -> bool:
        return True

    def plan(self, trie: TokenTrie, device: torch.device) -> TreePlan:
        return TreePlan(self, trie, device)

    def attend(self, plan: TreePlan, query, key, value, scaling, sliding_window):
        raise NotImplementedError


class TreePlan(PlanCache):
    """A backend bound to one trie: what ``hook.run_decoder`` calls in every attention layer; its index
    tensors and masks are built once per trie (``PlanCache``)."""

    def __init__(self, backend: TreeAttention, trie: TokenTrie, device: torch.device):
        super().__init__()
        self.backend, self.trie, self.device = backend, trie, device

    @eager_plan
    def __call__(self, module, query, key, value, *, scaling: float, sliding_window: int | None):
        if sliding_window is not None and self.trie.max_depth <= sliding_window:
            sliding_window = None   # the window hides nothing in this trie
        return self.backend.attend(self, query, key, value, scaling, sliding_window)

    def recurrent_layout(self) -> SegmentForest:
        """What the trie's recurrent layers run over (``turbogrpo.mixers``): every node once, from its
        parent's final state."""
        trie = self.trie
        return self.cached("segment_forest", lambda: SegmentForest.build(trie.node_start, trie.node_length,
                                                                          trie.node_parent, self.device))


@register_tree_backend("reference")
class DenseMaskAttention(TreeAttention):
    def attend(self, plan, query, key, value, scaling, sliding_window):
        mask = plan.cached(("dense", sliding_window), lambda: upload(plan.trie.dense_mask(sliding_window), plan.device))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


@register_tree_backend("cascade")
class LevelCascadeAttention(TreeAttention):
    def attend(self, plan, query, key, value, scaling, sliding_window):
        parts = plan.cached(("parts", sliding_window, query.dtype),
                            lambda: cascade_parts(plan.trie, plan.device, query.dtype, sliding_window))
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))   # [N, H, D] / [N, Hkv, D]
        out = MergedPartsAttention.apply(parts, scaling, q, *(k, v) * len(parts))
        return out.unsqueeze(0)


@register_tree_backend("flex")
class FlexTreeAttention(TreeAttention):
    """One FlexAttention call per layer; the kernels are the prefix flex backend's (compiled once per
    device type), the block mask is built once per trie from per-token vectors."""

    unavailable_hint = "FlexAttention has no backward on CPU in this torch; use backend='cascade'."

    def available(self, device, requires_grad):
        return PREFIX_BACKENDS["flex"].available(device, requires_grad)

    def attend(self, plan, query, key, value, scaling, sliding_window):
        flex_attention, create_block_mask = PREFIX_BACKENDS["flex"].kernels(query.device)

        def build():
            n = plan.trie.num_tokens
            return create_block_mask(ancestor_rule(plan.trie, plan.device, sliding_window), None, None, n, n,
                                     device=plan.device)
        block_mask = plan.cached(("block_mask", sliding_window), build)
        out = flex_attention(query, key, value, block_mask=block_mask, scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


def ancestor_rule(trie: TokenTrie, device: torch.device, sliding_window: int | None = None) -> Callable:
    """The trie's attention rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``: the key
    is at or above the query on its path (preorder intervals), within the window in depth."""
    subtree_end = upload(trie.subtree_end_of_token, device)
    position = upload(trie.position_ids, device)

    def rule(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    if sliding_window is None:
        return rule

    def windowed_rule(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx) & (position[q_idx] - position[kv_idx] < sliding_window)
    return windowed_rule


# ---------------------------------------------------------------- the cascade's parts

class RowIndex(NamedTuple):
    """Rows of flat token indices laid out as a padded ``[R, W]`` grid.

    ``gather`` ``[R, W]`` flat index per slot (pads point at 0); ``valid`` ``[R, W]``; ``flat`` ``[n]``
    the flat index of every real slot, row by row; ``slots`` ``[n]`` where those sit in ``R * W``.
    """

    gather: torch.Tensor
    valid: torch.Tensor
    flat: torch.Tensor
    slots: torch.Tensor

    @staticmethod
    def build(rows: list[torch.Tensor], device: torch.device) -> RowIndex:
        width = max(r.numel() for r in rows)
        gather = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            gather[i, :r.numel()] = r
            valid[i, :r.numel()] = True
        slots = torch.nonzero(valid.flatten()).squeeze(1)
        return RowIndex(*(upload(t, device) for t in (gather, valid, torch.cat(rows), slots)))

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``[N, H, ...]`` -> ``[R, H, W, ...]``."""
        return flat[self.gather].transpose(1, 2)

    def real(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, H, W, ...]`` -> ``[n, H, ...]``: the real slots, in :attr:`flat` order."""
        return rows.transpose(1, 2).flatten(0, 1)[self.slots]


class _Block(NamedTuple):
    """One padded attention call: rows of queries against rows of keys."""

    queries: RowIndex
    keys: RowIndex
    bias: torch.Tensor | None          # additive: [R, 1, 1, Wk] padded keys, [R, 1, Wq, Wk] a window, [Wq, Wk] a band
    causal: bool
    hidden_rows: torch.Tensor | None   # [R, 1, Wq] real queries that see no key of this block (a window)

    def forward(self, q, k, v, scale):
        out, lse = attention_forward(self.queries.to_rows(q), self.keys.to_rows(k), self.keys.to_rows(v),
                                     self.bias, causal=self.causal, scale=scale)
        if self.hidden_rows is not None:
            # Such a row's output is 0 and its log-sum-exp -inf (CPU flash reports 0), so merging ignores it.
            lse = lse.masked_fill(self.hidden_rows, float("-inf"))
            out = out.masked_fill(self.hidden_rows[..., None], 0.0)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, own_lse_rows, scale):
        valid = self.queries.valid[:, None, :]
        rows_grad = self.queries.to_rows(grad_out) * valid[..., None]
        # Pad slots keep their own forward lse so that exp(scores - lse) stays finite there.
        rows_lse = torch.where(valid, self.queries.to_rows(lse), own_lse_rows)
        return attention_backward(rows_grad, self.queries.to_rows(q), self.keys.to_rows(k), self.keys.to_rows(v),
                                  self.queries.to_rows(out), rows_lse, self.bias, causal=self.causal, scale=scale)


class _BlocksPart(NamedTuple):
    """One part of ``MergedPartsAttention``: blocks whose queries are disjoint, as ``[N]``-wide results.

    Queries no block covers get output 0 and log-sum-exp -inf, which the merge ignores (the first
    part, "own", covers every query, so a merge never meets two -inf).
    """

    blocks: tuple[_Block, ...]
    num_tokens: int

    def forward(self, q, k, v, scale):
        out = lse = None
        own_lses = []
        for block in self.blocks:
            block_out, block_lse = block.forward(q, k, v, scale)
            if out is None:
                out = block_out.new_zeros(self.num_tokens, *q.shape[1:])
                lse = block_lse.new_full((self.num_tokens, q.shape[1]), float("-inf"))
            out[block.queries.flat] = block.queries.real(block_out)
            lse[block.queries.flat] = block.queries.real(block_lse[..., None])[..., 0]
            own_lses.append(block_lse.flatten())
        # One residual tensor (MergedPartsAttention saves it for the backward): the blocks' own lses.
        return out, lse, torch.cat(own_lses)

    def backward(self, grad_out, q, k, v, out, lse, own_lses, scale):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        shapes = [(b.queries.gather.shape[0], q.shape[1], b.queries.gather.shape[1]) for b in self.blocks]
        pieces = own_lses.split([r * h * w for r, h, w in shapes])
        for block, own_lse, shape in zip(self.blocks, pieces, shapes):
            own_lse = own_lse.view(shape)
            block_dq, block_dk, block_dv = block.backward(grad_out, q, k, v, out, lse, own_lse, scale)
            dq.index_add_(0, block.queries.flat, block.queries.real(block_dq).to(dq.dtype))
            dk.index_add_(0, block.keys.flat, block.keys.real(block_dk).to(dk.dtype))
            dv.index_add_(0, block.keys.flat, block.keys.real(block_dv).to(dv.dtype))
        return dq, dk, dv


class _Run(NamedTuple):
    """A piece of at most MAX_RUN tokens of one trie node: flat ``[start, end)``, its level among runs,
    the end of its descendants' preorder range, and the depth of its first token."""

    start: int
    end: int
    level: int
    subtree_end: int
    depth: int


def trie_runs(trie: TokenTrie, max_run: int | None = None) -> list[_Run]:
    """The trie's nodes cut into chains of runs of at most ``max_run`` tokens (default :data:`MAX_RUN`)."""
    max_run = max_run or MAX_RUN
    runs, last_level = [], {}
    for n, (start, length, parent) in enumerate(zip(trie.node_start, trie.node_length, trie.node_parent)):
        level = last_level[parent] + 1 if parent >= 0 else 0
        depth = int(trie.position_ids[start])
        for offset in range(0, length, max_run):
            piece = min(max_run, length - offset)
            runs.append(_Run(start + offset, start + offset + piece, level, trie.subtree_end[n], depth + offset))
            level += 1
        last_level[n] = level - 1
    return runs


def cascade_parts(trie: TokenTrie, device: torch.device, dtype: torch.dtype,
                  sliding_window: int | None = None, max_run: int | None = None) -> tuple[_BlocksPart, ...]:
    """The cascade's parts for one trie: "own" first (every query), then one part per run level."""
    runs = trie_runs(trie, max_run)
    positions = trie.position_ids
    own = [_own_block(rows, sliding_window, device, dtype)
           for rows in _buckets([torch.arange(r.start, r.end) for r in runs])]
    parts = [_BlocksPart(tuple(own), trie.num_tokens)]
    for level in range(max(r.level for r in runs) + 1):
        pairs = []   # (query flat indices, key flat indices) of each row of this level
        for run in runs:
            if run.level != level or run.subtree_end == run.end:
                continue
            keys, queries = torch.arange(run.start, run.end), torch.arange(run.end, run.subtree_end)
            if sliding_window is not None:
                # Only the run's last window - 1 keys are within reach of a token below it, and only
                # the queries less than window - 1 depth positions below its end reach them.
                last_depth = run.depth + run.end - run.start - 1
                keys = keys[positions[keys] > last_depth - sliding_window]
                queries = queries[positions[queries] < last_depth + sliding_window]
                if keys.numel() == 0 or queries.numel() == 0:
                    continue
            pairs.append((queries, keys))
        blocks = [_level_block(rows, trie.position_ids, sliding_window, device, dtype)
                  for rows in _buckets(pairs, size=lambda pair: pair[0].numel())]
        if blocks:
            parts.append(_BlocksPart(tuple(blocks), trie.num_tokens))
    return tuple(parts)


def _buckets(rows: list, size: Callable = lambda r: r.numel()) -> list[list]:
    """Rows grouped by the power of two just above their size, so a padded row is at most twice its size."""
    groups: dict[int, list] = {}
    for row in rows:
        groups.setdefault(max(size(row) - 1, 0).bit_length(), []).append(row)
    return [groups[b] for b in sorted(groups)]


def _own_block(rows: list[torch.Tensor], sliding_window, device, dtype) -> _Block:
    """Each run against itself, causally (depths within a run are consecutive, so a window is a band)."""
    index = RowIndex.build(rows, device)
    band = causal_band(index.gather.shape[1], sliding_window, device)
    return _Block(index, index, None if band is None else _additive(band, dtype), causal=True, hidden_rows=None)


def _level_block(pairs, positions: torch.Tensor, sliding_window, device, dtype) -> _Block:
    """Each run's descendants (one query row) against the run's tokens, unmasked but for padding / window."""
    queries = RowIndex.build([q for q, _ in pairs], device)
    keys = RowIndex.build([k for _, k in pairs], device)
    if sliding_window is None:
        all_full = all(k.numel() == keys.gather.shape[1] for _, k in pairs)
        bias = None if all_full else _additive(keys.valid, dtype)[:, None, None, :]
        return _Block(queries, keys, bias, causal=False, hidden_rows=None)
    device_positions = upload(positions, device)
    distance = device_positions[queries.gather][:, :, None] - device_positions[keys.gather][:, None, :]
    visible = keys.valid[:, None, :] & ((distance < sliding_window) | ~queries.valid[:, :, None])
    return _Block(queries, keys, _additive(visible, dtype)[:, None], causal=False,
                  hidden_rows=~visible.any(-1)[:, None])

