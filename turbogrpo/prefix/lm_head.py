"""Log-probs (and entropies) of target tokens from final hidden states, chunk by chunk over the LM head.

The LM head runs on chunks of rows sized by a memory budget of the device (:func:`logit_chunk_rows`).
With gradients, the chunks' logits are kept for the backward when all ``[N, V]`` of them fit the
device's budget for saved logits (:func:`recomputes_logits`); beyond it each chunk runs under
activation checkpointing, so the ``[N, V]`` logits are never all in memory and the backward
recomputes one chunk's logits at a time (a fourth LM-head matmul: a third more LM-head work). The per-chunk math (log-sum-exp, target log-prob,
entropy; and the gradient ``onehot(t) - softmax(z)``) is a handful of elementwise passes over
``[n, V]``: compiled on CUDA, where Inductor fuses each direction into one or two kernels, eager on
the CPU (see :func:`logprob_kernels`).

Shape legend: N rows (tokens), n rows of one chunk, Hd hidden size, V vocabulary.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Transient bytes of one chunk per logit element: the logits in the model's dtype, plus two float32
# [n, V] buffers alive at once (the float32 logits, then the gradient or the probabilities).
_EXTRA_BYTES_PER_LOGIT = 8

# Device memory a chunk may use. CUDA: 1/64 of the device (2.2 GB on an H200, about 2**27.7 bf16
# logits: the issue-10 profile measured 2**28 elements 12% faster than 2**24 at vocab 152k, where
# 2**24 meant launching ~110-row matmuls). CPU: 2**24 float32 logits' worth (192 MiB), the size the
# CPU benchmark was tuned at; larger chunks only leave the caches sooner there.
_CPU_CHUNK_BYTES = 2 ** 24 * (4 + _EXTRA_BYTES_PER_LOGIT)
_CUDA_MEMORY_FRACTION = 1 / 64
# CPU GEMMs of a few dozen rows run far below the machine's matmul rate, and a large vocabulary shrinks
# the budget's chunks to that: at Gemma 3's 262k it gave 64 rows. Measured on a 2-core AMD EPYC (N=1024
# rows, Hd=640, V=262144, float32 forward + backward, 3 runs each): 64-row chunks 16.6-20.9 s, 256-row
# 11.1-14.1 s, one 1024-row chunk 9.5-11.8 s. So a CPU chunk has at least this many rows, while they
# fit the saved-logits budget below.
_CPU_MIN_CHUNK_ROWS = 256

# Memory all of a call's logits may hold between forward and backward (instead of recomputing them):
# 1/16 of the device's memory (1.5 GiB of the 24 GiB CPU machine, about 7,600 float32 rows at vocab
# 49k; 8.7 GB of an H200). Measured on the CPU (SmolLM2-135M, 1,024 completion tokens, one
# thread): the recompute was 58 of 983 GFLOP of a forward+backward.
_SAVED_LOGITS_FRACTION = 1 / 16


def logit_chunk_rows(num_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows of ``[rows, V]`` logits to materialise at once: the device's chunk budget divided by a
    row's transient bytes (on the CPU at least ``_CPU_MIN_CHUNK_ROWS`` while they fit the saved-logits
    budget), at least 1 and at most ``num_rows``."""
    row_bytes = vocab * (torch.finfo(dtype).bits // 8 + _EXTRA_BYTES_PER_LOGIT)
    rows = _chunk_budget_bytes(device) // row_bytes
    if device.type == "cpu":
        fitting = int(_device_memory_bytes(device) * _SAVED_LOGITS_FRACTION) // row_bytes
        rows = max(rows, min(_CPU_MIN_CHUNK_ROWS, fitting))
    return max(1, min(num_rows, rows))


def recomputes_logits(num_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a backward recomputes each chunk's logits (checkpointing) rather than keeping all
    ``[num_rows, vocab]`` of them: only when they exceed the device's saved-logits budget."""
    logit_bytes = num_rows * vocab * torch.finfo(dtype).bits // 8
    return logit_bytes > _device_memory_bytes(device) * _SAVED_LOGITS_FRACTION


@functools.cache
def _chunk_budget_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(_device_memory_bytes(device) * _CUDA_MEMORY_FRACTION)
    return _CPU_CHUNK_BYTES


@functools.cache
def _device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        # Host-side driver query of a constant, cached: no stream sync.
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def lm_head_logprobs(hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                     *, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N]`` of ``targets [N]`` and entropies ``[N]`` (None without ``with_entropy``) from
    hidden states ``[N, Hd]`` at the given temperature."""
    num_rows, (vocab, dtype) = hidden.shape[0], (lm_head.weight.shape[0], lm_head.weight.dtype)
    rows = logit_chunk_rows(num_rows, vocab, dtype, hidden.device)
    recompute = (torch.is_grad_enabled() and hidden.requires_grad
                 and recomputes_logits(num_rows, vocab, dtype, hidden.device))
    logps, entropies = [], []
    for h, t in zip(hidden.split(rows), targets.split(rows)):
        if recompute:
            lp, ent = checkpoint(_chunk_logprobs, h, t, lm_head, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, t, lm_head, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies).detach() if with_entropy else None


def _chunk_logprobs(hidden, targets, lm_head, temperature, with_entropy):
    return TargetLogprobs.apply(lm_head(hidden), targets, temperature, with_entropy)


class TargetLogprobs(torch.autograd.Function):
    """``logits [n, V]`` -> (log-prob of ``targets [n]`` under ``softmax(logits / T)``, entropy or None).

    Computed in float32 from the row log-sum-exps; the backward rebuilds the softmax from the saved
    log-sum-exps in one pass, ``d logp_t / d z = onehot(t) - softmax(z)``, instead of keeping a full
    ``[n, V]`` log-softmax for autograd and scattering the gather's gradient into a zero-filled one.
    The entropy is a detached metric.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy):
        kernels = logprob_kernels(logits.device.type)
        logps, lse, entropy = kernels.forward(logits, targets, temperature, with_entropy)
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        kernels = logprob_kernels(logits.device.type)
        return kernels.backward(logits, targets, lse, grad_logps, ctx.temperature), None, None, None


def logprobs_forward(logits, targets, temperature: float, with_entropy: bool):
    """``logits [n, V]``, ``targets [n]`` -> ``(logps [n], lse [n], entropy [n] or None)``, float32."""
    scaled = _scaled_logits(logits, temperature)
    if with_entropy:
        # One exp pass serves both: e = exp(z - max), lse = max + log(sum e), H = lse - (e . z) / sum e
        # (torch.logsumexp and then exp(z - lse) for the entropy would run it twice).
        row_max = scaled.amax(dim=-1)
        exps = torch.sub(scaled, row_max[:, None]).exp_()
        total = exps.sum(dim=-1)
        lse = row_max + total.log()
        entropy = lse - torch.linalg.vecdot(exps, scaled) / total
    else:
        lse, entropy = torch.logsumexp(scaled, dim=-1), None
    logps = scaled.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logps, lse, entropy


def logprobs_backward(logits, targets, lse, grad_logps, temperature: float):
    """Gradient ``[n, V]`` (logits' dtype) of ``sum(grad_logps * logps)`` with respect to ``logits``."""
    grad = torch.sub(_scaled_logits(logits, temperature), lse[:, None]).exp_()
    grad.mul_(-grad_logps[:, None])
    grad.scatter_add_(-1, targets[:, None], grad_logps[:, None])
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits / temperature


class LogprobKernels(NamedTuple):
    forward: object    # same signature as logprobs_forward
    backward: object   # same signature as logprobs_backward


@functools.cache
def logprob_kernels(device_type: str) -> LogprobKernels:
    """The per-chunk math for a device type. CUDA: compiled with dynamic shapes (the last chunk is
    shorter; one graph serves every row count), which fuses the float32 cast, log-sum-exp, gather
    and entropy into a reduction kernel and the gradient into one pointwise pass, instead of ~8
    launches each way. CPU: eager. Compiled, the chunk math ran 5.2x faster there (0.51 s against
    2.69 s forward+backward with entropy at 1024 x 16384 float32, one thread, loaded 2-core machine)
    but the first call compiled for 78 s, per process and per graph variant (entropy on/off,
    temperature 1 or not): more than a CPU run of the bench or the test suite ever wins back."""
    if device_type != "cuda":
        return LogprobKernels(logprobs_forward, logprobs_backward)
    return LogprobKernels(_CompiledOrEager(logprobs_forward), _CompiledOrEager(logprobs_backward))


class _CompiledOrEager:
    """``torch.compile(fn)``, falling back to ``fn`` for good (with a warning) if compiling fails, so a
    torch build without a working Inductor/Triton still runs."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except (torch._dynamo.exc.TorchDynamoException, ImportError) as error:  # the compiler, not the math
                warnings.warn(f"turbogrpo: compiling {self.fn.__name__} failed ({type(error).__name__}: {error}); "
                              "running it eagerly", stacklevel=2)
                self.compiled = None
        return self.fn(*args)
