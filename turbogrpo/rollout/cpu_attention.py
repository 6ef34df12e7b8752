"""The own-completion and prompt parts of a compiled CPU decoding step as one hand-written kernel.

A plain decoding step's own-completion attention is, per row and KV head, M = r * n queries (3 for SmolLM2) against
that row's L generated keys and values. Inductor compiles ``attention.reduced_partial_attention`` into one fused
kernel, but it reduces each (query, key) dot product over the head dim on its own (a horizontal vector sum per
score), converts and scales the queries again for every key, and reads each key and value row once per query
(``TORCH_LOGS=output_code``). This kernel reads each key and value row once for all M queries, with the
queries held in registers as float32: scores, then a vectorised softmax per query, then the weighted sum of the
values, accumulated in float32 (the merge dtype of both float32 and bf16) -- the same arithmetic as
``reduced_partial_attention``, in one pass over memory.

The kernel is C++ over ATen's portable vector types (``at::vec``: AVX-512, AVX2 or plain loops, whichever
inductor picked for this CPU), built by inductor's own compiler driver with the flags of inductor's kernels, and
cached on disk by inductor like them (the first call of a process loads it; the first on a machine compiles it, a
few seconds). It runs where the compiled step runs (``partial_attention_for`` and ``prompt_attention_for`` pick it
inside a compiled CPU graph only, where that compiler is known to work), for float32 and bf16 and head dims 64, 128
and 256, on x86 CPUs with AVX2 or AVX-512; anything else keeps the matmul or reduced form. Its speed is in
``attention.KERNEL_ITEMS`` and ``attention.prompt_attention_for``.

A group's prompt part has many queries per KV head (3 per live sample for SmolLM2): the kernel takes them in chunks
of at most 8, each chunk's queries in registers, re-reading the chunk's keys from cache.

The graph sees an opaque library op (``torch.ops.turbogrpo.own_attention(query, key, value, bias, scale)``, with a
fake kernel for its shapes), which the compiled step's Python wrapper calls once per layer;
``attention.kernel_partial_attention`` calls it where ``supported``.
"""

from __future__ import annotations

import functools

import torch

HEAD_DIMS = (64, 128, 256)
DTYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
// cpp_prefix.h brings ATen's vectors only where inductor compiles for a vector ISA; the kernel uses them anyway.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// Two float vectors (2 W elements) from p: loaded, or converted from a reduced float type.
template <typename T> static inline void load2(const T* p, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, 2 * W));
}
template <> inline void load2<float>(const float* p, Vec& a, Vec& b) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + W);
}

constexpr int64_t AHEAD = 16, MAX_QUERIES = 8;
template <typename T> static inline void prefetch_row(const T* p, int64_t D) {
    for (int64_t byte = 0; byte < D * (int64_t)sizeof(T); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(p) + byte);
}

// One (row, KV head): M queries [M, D] against L keys and values [L, D]; scores go through `scores` [M, L].
template <typename T, int M, int D>
static void attend(const T* q, int64_t qm, const T* k, int64_t kl, const T* v, int64_t vl,
                   const float* bias, int64_t bm, int64_t L, float scale, float* scores, float* out, int64_t om,
                   float* lse, int64_t lm) {
    constexpr int C = D / (2 * W);  // pairs of float vectors per row
    Vec qa[M][C], qb[M][C];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) {
            load2(q + m * qm + c * 2 * W, qa[m][c], qb[m][c]);
            qa[m][c] = qa[m][c] * Vec(scale);
            qb[m][c] = qb[m][c] * Vec(scale);
        }
    for (int64_t l = 0; l < std::min(AHEAD, L); ++l) prefetch_row(k + l * kl, D);
    for (int64_t l = 0; l < L; ++l) {
        // Each (row, head)'s keys and values are short streams the hardware prefetchers meet cold: ask for the
        // key row AHEAD rows on, and the value row the second pass reads, now.
        if (l + AHEAD < L) prefetch_row(k + (l + AHEAD) * kl, D);
        prefetch_row(v + l * vl, D);
        Vec acc[M];
        for (int m = 0; m < M; ++m) acc[m] = Vec(0.f);
        for (int c = 0; c < C; ++c) {
            Vec ka, kb;
            load2(k + l * kl + c * 2 * W, ka, kb);
            for (int m = 0; m < M; ++m) {
                acc[m] = at::vec::fmadd(qa[m][c], ka, acc[m]);
                acc[m] = at::vec::fmadd(qb[m][c], kb, acc[m]);
            }
        }
        for (int m = 0; m < M; ++m)
            scores[m * L + l] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc[m])
                                + (bias ? bias[m * bm + l] : 0.f);
    }
    float total[M], top[M];
    for (int m = 0; m < M; ++m) {
        float* s = scores + m * L;
        // As reduced_partial_attention: the max clamped to the lowest float (a row that sees no key gets
        // weights 0, total clamped to the smallest normal, output 0 and a very negative log-sum-exp).
        top[m] = std::max(at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, L),
                          std::numeric_limits<float>::lowest());
        const float shift = top[m];
        at::vec::map([shift](Vec x) { return (x - Vec(shift)).exp(); }, s, s, L);
        total[m] = std::max(at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, L),
                            std::numeric_limits<float>::min());
    }
    Vec oa[M][C], ob[M][C];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) oa[m][c] = ob[m][c] = Vec(0.f);
    for (int64_t l = 0; l < L; ++l) {
        for (int c = 0; c < C; ++c) {
            Vec va, vb;
            load2(v + l * vl + c * 2 * W, va, vb);
            for (int m = 0; m < M; ++m) {
                const Vec w(scores[m * L + l]);
                oa[m][c] = at::vec::fmadd(w, va, oa[m][c]);
                ob[m][c] = at::vec::fmadd(w, vb, ob[m][c]);
            }
        }
    }
    for (int m = 0; m < M; ++m) {
        const Vec inverse(1.f / total[m]);
        for (int c = 0; c < C; ++c) {
            (oa[m][c] * inverse).store(out + m * om + c * 2 * W);
            (ob[m][c] * inverse).store(out + m * om + c * 2 * W + W);
        }
        lse[m * lm] = top[m] + std::log(total[m]);
    }
}

// Each (row, KV head)'s M queries in chunks of at most MAX_QUERIES, as even as they go (24 -> 8 + 8 + 8, 12 -> 6 + 6):
// a chunk's queries stay in registers, and a chunk past the first reads its keys and values again from cache.
template <typename T, int D>
static void attend_all(const T* q, const T* k, const T* v, const float* bias, float* out, float* lse,
                       int64_t X, int64_t H, int64_t M, int64_t L, const int64_t* s, float scale) {
    // s: query (x, h, m), key (x, h, l), value (x, h, l), bias (x, h, m), out (x, h, m), lse (x, h, m) strides
    using Attend = void (*)(const T*, int64_t, const T*, int64_t, const T*, int64_t, const float*, int64_t, int64_t,
                            float, float*, float*, int64_t, float*, int64_t);
    static constexpr Attend by_size[] = {attend<T, 1, D>, attend<T, 2, D>, attend<T, 3, D>, attend<T, 4, D>,
                                         attend<T, 5, D>, attend<T, 6, D>, attend<T, 7, D>, attend<T, 8, D>};
    const int64_t chunks = (M + MAX_QUERIES - 1) / MAX_QUERIES, base = M / chunks, extra = M % chunks;
    #pragma omp parallel
    {
        std::vector<float> scores((base + 1) * L);
        #pragma omp for
        for (int64_t item = 0; item < X * H * chunks; ++item) {
            const int64_t chunk = item % chunks, x = item / chunks / H, h = item / chunks % H;
            const int64_t m0 = chunk * base + std::min(chunk, extra), m = base + (chunk < extra);
            by_size[m - 1](q + x * s[0] + h * s[1] + m0 * s[2], s[2], k + x * s[3] + h * s[4], s[5],
                           v + x * s[6] + h * s[7], s[8], bias ? bias + x * s[9] + h * s[10] + m0 * s[11] : nullptr,
                           s[11], L, scale, scores.data(), out + x * s[12] + h * s[13] + m0 * s[14], s[14],
                           lse + x * s[15] + h * s[16] + m0 * s[17], s[17]);
        }
    }
}

extern "C" void kernel(const DTYPE* q, const DTYPE* k, const DTYPE* v, const float* bias, float* out, float* lse,
                       int64_t X, int64_t H, int64_t M, int64_t L, int64_t D, int64_t has_bias, float scale,
                       int64_t q0, int64_t q1, int64_t q2, int64_t k0, int64_t k1, int64_t k2,
                       int64_t v0, int64_t v1, int64_t v2, int64_t b0, int64_t b1, int64_t b2,
                       int64_t o0, int64_t o1, int64_t o2, int64_t l0, int64_t l1, int64_t l2) {
    const float* b = has_bias ? bias : nullptr;
    const int64_t strides[] = {q0, q1, q2, k0, k1, k2, v0, v1, v2, b0, b1, b2, o0, o1, o2, l0, l1, l2};
    #define CASE(d) if (D == d) return attend_all<DTYPE, d>(q, k, v, b, out, lse, X, H, M, L, strides, scale);
    CASE(64) CASE(128) CASE(256)
}
"""


@functools.cache
def _kernel(dtype: torch.dtype):
    """The compiled kernel for queries, keys and values of ``dtype`` (inductor's code cache: on disk per machine)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    ctype = DTYPES[dtype]
    argtypes = [f"const {ctype}*"] * 3 + ["const float*", "float*", "float*"] + ["int64_t"] * 6 + ["float"] + \
        ["int64_t"] * 18
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, _SOURCE.replace("DTYPE", ctype))


X86_VECTORS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
"""Whether ATen runs AVX2 or AVX-512 kernels on this CPU, where this kernel was built and tested (ARM's vectors were
never tried)."""


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (``query [X, K, M, D]``, ``key``/``value [X, K, L, D]``) on
    this CPU."""
    return (query.device.type == "cpu" and query.dtype in DTYPES and key.dtype == value.dtype == query.dtype
            and X86_VECTORS
            and query.shape[-1] in HEAD_DIMS
            and query.stride(-1) == 1 and key.stride(-1) == 1)


_LIBRARY = torch.library.Library("turbogrpo", "FRAGMENT")
_LIBRARY.define("own_attention(Tensor query, Tensor key, Tensor value, Tensor? bias, float scale) -> (Tensor, Tensor)")


def _own_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, num_heads, num_queries, head_dim = query.shape
    num_slots = key.shape[2]
    out = query.new_empty((num_rows, num_heads, num_queries, head_dim), dtype=torch.float32)
    lse = query.new_empty((num_rows, num_heads, num_queries, 1), dtype=torch.float32)
    value = value if value.stride(-1) == 1 else value.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).expand(num_rows, num_heads, num_queries, num_slots)
        if bias.stride(-1) != 1:
            bias = bias.contiguous()
    _kernel(query.dtype)(query, key, value, bias if bias is not None else out, out, lse, num_rows, num_heads,
                         num_queries, num_slots, head_dim, int(bias is not None), float(scale),
                         *query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
                         *(bias.stride()[:3] if bias is not None else (0, 0, 0)), *out.stride()[:3], *lse.stride()[:3])
    return out, lse


_LIBRARY.impl("own_attention", _own_attention, "CPU")


@torch.library.register_fake("turbogrpo::own_attention")
def _own_attention_shapes(query, key, value, bias, scale):
    shape = query.shape
    return (query.new_empty(shape, dtype=torch.float32), query.new_empty((*shape[:-1], 1), dtype=torch.float32))
