"""Attention over part of the keys, with its log-sum-exp, and the merge of two such parts ("cascade").

Softmax attention over keys ``A ∪ B`` equals the partial attentions over ``A`` and over ``B`` mixed
with weight ``exp(lse_A) / (exp(lse_A) + exp(lse_B)) = sigmoid(lse_A - lse_B)``. The decode plan uses
it to attend to a group's shared prompt K/V and a sequence's own generated K/V without ever laying
them side by side. Written with as few kernels as possible: decoding runs these once per layer and
step, and small steps (the long tail of a rollout) are bound by per-kernel overhead.

Four implementations of a part: matrix products with the softmax by hand (any device, any mask), a
fused kernel that returns the log-sum-exp (``PARTIAL_ATTENTION``, per device; rows must see a key), and, inside a
compiled CPU step, broadcast products reduced over the head dim and the keys (``reduced_partial_attention``: any
mask), or for many rows, and for the prompt part, a hand-written kernel that streams each row's keys and values
once for all its queries (``kernel_partial_attention``, ``kernel_prompt_attention``, ``cpu_attention``).

Shapes: ``...`` batch dimensions, ``X`` batch, ``K`` key/value heads, ``M`` queries, ``L`` keys,
``D`` head dim.
"""

from __future__ import annotations

import torch

from turbogrpo.rollout import cpu_attention


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs and log-sum-exps are kept in: float32 at least (merging half-precision
    parts in half precision would round the result a second time), float64 for a float64 model."""
    # A plain comparison, not torch.promote_types: this runs per layer and step, outside any op count.
    return torch.float64 if dtype == torch.float64 else torch.float32


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query [X, K, M, D]`` over keys and values ``[X, K, L, D]``, scores
    multiplied by ``scale``, by matrix products.

    ``bias`` (0 or ``-inf``, broadcastable to ``[X, K, M, L]``) hides keys. Returns the output
    ``[X, K, M, D]`` and the log-sum-exp of the scores ``[X, K, M, 1]``, both in ``merge_dtype``. A row that sees
    no key gets output 0 and a hugely negative lse, so that it drops out of a merge.
    """
    # bmm on (X*K)-batched views: torch.matmul's 4-D path costs several times more per call on small
    # shapes, and decoding makes two such calls per part, layer and step. The keys' transpose is a
    # view: BLAS reads the operand transposed, no copy.
    num_x, num_k, num_queries, _ = query.shape
    dtype = merge_dtype(query.dtype)
    scores = torch.bmm((query * scale).flatten(0, 1), key.flatten(0, 1).transpose(1, 2)).to(dtype)
    scores = scores.view(num_x, num_k, num_queries, -1)
    if bias is not None:
        scores += bias
    # The softmax by hand (in place, four passes over the scores) yields the lse on the way; a
    # clamped max and total keep rows that see no key at output 0 instead of NaN.
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)
    weights = scores.sub_(row_max).exp_()
    total = weights.sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).tiny)
    out = torch.bmm(weights.to(value.dtype).flatten(0, 1), value.flatten(0, 1)).to(dtype)
    return out.view(num_x, num_k, num_queries, -1) / total, row_max + total.log()


def reduced_partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` written as broadcast products reduced over the head dim and over the keys, for a
    compiled step only (eagerly it would materialise ``[X, K, M, L, D]``): inductor fuses the scores, the softmax and
    the output into one kernel that streams each row's keys and values once from memory, where a batch of
    M-row matrix products (M = the r * n queries of a KV head, 3 for SmolLM2) packs and re-reads them. SmolLM2's 30
    layers at 1-64 rows x 64-256 slots, out of cache, compiled (2-core AMD EPYC): 1.29-1.86x the faster of flash
    and the matmuls in float32, 1.56-2.1x in bf16 (64 x 256: 50.8 ms against 69.9 in float32, 47.0 against 73.5 in
    bf16; ``bench/decode_ops.py --parts own_attention_compiled``). Same arguments and results."""
    dtype = merge_dtype(query.dtype)
    # [X, K, M, 1, D] * [X, K, 1, L, D] summed over D: the scores, accumulated in the merge dtype.
    scores = ((query * scale).unsqueeze(3) * key.unsqueeze(2)).sum(-1, dtype=dtype)
    if bias is not None:
        scores = scores + bias
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).min)
    weights = (scores - row_max).exp()
    total = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    # [X, K, M, L, 1] * [X, K, 1, L, D] summed over L: the output.
    out = (weights.unsqueeze(-1) * value.unsqueeze(2)).sum(3, dtype=dtype)
    return out / total, row_max + total.log()


def fused_partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` in one fused kernel that also returns the log-sum-exp (the CPU flash
    attention behind SDPA). Every row must see at least one key: a fully hidden row gets lse 0,
    not -inf. ``bias`` must have the query's dtype."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale)
    dtype, lse = merge_dtype(query.dtype), lse.unsqueeze(-1)
    return out.to(dtype), (lse if lse.dtype == dtype else lse.to(dtype))  # the kernel's lse is float32 below float64


PARTIAL_ATTENTION = {"cpu": fused_partial_attention}
"""Device type -> its fused partial attention; other devices, and masks that may hide every key of
a row (sliding windows), use ``partial_attention``."""


def partial_attention_for(device: torch.device, may_hide_all: bool, num_batch_heads: int | None = None,
                          queries_per_head: int | None = None, dtype: torch.dtype | None = None):
    """The partial attention to use on ``device`` for ``num_batch_heads`` (X * K) products of
    ``queries_per_head`` (M) queries each (None: unknown, as for the prompt part), in ``dtype`` (the queries').

    CPU flash attention has a fixed cost per (batch, head) item, so for many items of few queries (the
    own-completion part of a wide plain decoding step) the batched matmuls win. ``python bench/decode_ops.py
    --threads 2 --parts own_attention`` (2-core AMD EPYC): 32 rows x 3 KV heads x 3 queries over 16-128
    keys 205-392 us a call by flash against 90-298 us by matmuls (1.3-2.3x), 16 rows 1.21x, 8 rows 1.14x,
    4 rows 0.70x, 1 row 0.56x; 48 queries (a tree) 0.61-1.09x. A compiled CPU step's few-query parts take
    ``reduced_partial_attention``, or from ``KERNEL_ITEMS`` products ``kernel_partial_attention`` (measured on the
    CPU only; other devices keep their choice)."""
    if (device.type == "cpu" and queries_per_head is not None and queries_per_head <= FEW_QUERIES
            and torch.compiler.is_compiling()):
        if num_batch_heads is not None and num_batch_heads >= KERNEL_ITEMS.get(dtype, KERNEL_ITEMS[torch.float32]):
            return kernel_partial_attention
        return reduced_partial_attention  # one streaming kernel under inductor (its docstring)
    if may_hide_all:
        return partial_attention
    fused = PARTIAL_ATTENTION.get(device.type, partial_attention)
    if num_batch_heads is not None and num_batch_heads >= MANY_ITEMS and queries_per_head <= FEW_QUERIES:
        return partial_attention
    return fused


def prompt_attention_for(device: torch.device, may_hide_all: bool):
    """The partial attention of the prompt part (a group's live samples' queries, stacked, over its prompt's keys).
    Inside a compiled CPU step ``kernel_prompt_attention``; elsewhere ``partial_attention_for``'s choice.

    SmolLM2's 30 layers, 8 groups x 1-8 samples over 143 prompt keys, compiled (2-core AMD EPYC, ``python
    bench/decode_ops.py --threads 2 --parts many_queries_compiled``, ``decode_ops_many_queries_kernel``): the kernel
    over flash 1.17x (float32) and 1.70x (bf16) at 8 x 8, 1.99-3.0x at 8 x 1, 1.18-1.67x at one group; over the
    matmuls 0.97x at 8 x 8 in float32, 1.3-3.0x elsewhere. A tree's own part (48 queries) keeps its choice: the
    kernel ran it at 0.84-0.90x in float32."""
    if device.type == "cpu" and torch.compiler.is_compiling():
        return kernel_prompt_attention
    return partial_attention_for(device, may_hide_all)


def kernel_partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reduced_partial_attention``'s result by ``cpu_attention``'s kernel, which reads each row's keys and values
    once for all of its queries, where it takes the shapes and dtype (else ``reduced_partial_attention``). Both
    accumulate in float32 from the same products, as inductor compiles the reduced form; ``bias`` float32.
    SmolLM2's 30 layers out of cache, compiled (2-core AMD EPYC, ``bench/decode_ops.py --parts
    own_attention_compiled``): see ``KERNEL_ITEMS``."""
    return _kernel_or(reduced_partial_attention, query, key, value, bias, scale)


def kernel_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention``'s result by ``cpu_attention``'s kernel where it takes the shapes and dtype (else by
    ``partial_attention``: many queries per KV head, where the reduced form would multiply out every (query, key,
    dim) product); ``bias`` float32. Any mask: a row that sees no key gets output 0."""
    return _kernel_or(partial_attention, query, key, value, bias, scale)


def _kernel_or(fallback, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not cpu_attention.supported(query, key, value):
        return fallback(query, key, value, bias, scale)
    return torch.ops.turbogrpo.own_attention(query, key, value, bias, scale)


MANY_ITEMS, FEW_QUERIES = 24, 8
"""Where ``partial_attention_for`` prefers the matmuls to a fused kernel: at least this many (batch, head)
products of at most this many queries each."""
KERNEL_ITEMS = {torch.bfloat16: 24, torch.float32: 48}
"""Query dtype -> (row, KV head) products from which a compiled CPU step's few-query part runs
``kernel_partial_attention`` (other dtypes: float32's); below, the op's call from the graph (~17 us) costs more than
the kernel saves over the fused reduced form. SmolLM2's 30 layers out of cache (2-core AMD EPYC,
``decode_ops_own_attention_kernel``): bf16 1.6x the reduced form at 8 rows (24 products) x 256 slots, 1.18x at 4,
0.90x at 1; float32 0.92-0.99x at 8-16 rows, 1.19-1.36x from 16 rows x 256 slots. One compiled step late in a
rollout (``step_variants``, prompt part by flash in both): bf16 126 against 154 ms at 64 rows (1.22x), 1.05x at 16;
float32 1.04x at 64, 1.0x at 16."""


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from the parts' outputs ``[..., M, D]`` and
    log-sum-exps ``[..., M, 1]``."""
    return torch.lerp(out_b, out_a, torch.sigmoid(lse_a - lse_b))
