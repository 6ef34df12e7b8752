"""What a rollout writes as it decodes: per-completion output buffers, the live rows, and emission.

Emission is written for k tokens per live sequence per step (``emit``), so that a decoder that
accepts several tokens per step (speculative verification) reuses the stop and bookkeeping logic of
the plain decoder, which emits one.

Finished sequences may stay in the batch until the host next looks (``LiveRows.done_B``): ``emit``
gives them nothing, so whatever they draw after their stop is dropped and the outputs are those of
a decoder that removed them at once.

Legend: ``N`` completions, ``B`` live sequences, ``k`` tokens emitted per sequence in a step,
``T`` output columns, ``Hd`` hidden size, ``W`` stop-string window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from turbogrpo.batch import Groups
from turbogrpo.moe_routes import RouteLog
from turbogrpo.rollout.stopping import NO_TOKEN, StopCriteria
from turbogrpo.rollout.types import Rollout, RolloutStats


@dataclass
class OutputBuffers:
    """Per-completion output buffers, written in place as tokens are emitted."""

    tokens_NT: torch.Tensor
    logprobs_NT: torch.Tensor
    hidden_NTH: torch.Tensor | None
    lengths_N: torch.Tensor
    stopped_N: torch.Tensor
    nonfinite: torch.Tensor
    """[] bool: some emitted token's log-prob was not finite (the model's logits held NaN or inf);
    read by the engine at its host check, so the step itself never syncs for it."""

    @staticmethod
    def allocate(num_completions: int, num_columns: int, device: torch.device,
                 hidden_like: torch.Tensor | None, logprob_dtype: torch.dtype = torch.float32) -> OutputBuffers:
        """``num_columns``: max_new_tokens + (most tokens emitted per step); the last k columns take the
        leftovers that finished rows write while they wait to be retired. ``hidden_like``: a
        hidden-state tensor to take size and dtype from, or None to keep no hidden states. ``logprob_dtype``: the
        sampler's distribution's dtype (float32; float64 for a float64 model)."""
        hidden = None
        if hidden_like is not None:
            hidden = hidden_like.new_zeros(num_completions, num_columns, hidden_like.shape[-1])
        return OutputBuffers(
            tokens_NT=torch.full((num_completions, num_columns), NO_TOKEN, dtype=torch.long, device=device),
            logprobs_NT=torch.zeros(num_completions, num_columns, dtype=logprob_dtype, device=device),
            hidden_NTH=hidden,
            lengths_N=torch.zeros(num_completions, dtype=torch.long, device=device),
            stopped_N=torch.zeros(num_completions, dtype=torch.bool, device=device),
            nonfinite=torch.zeros((), dtype=torch.bool, device=device))


@dataclass
class LiveRows:
    """Per row of the decoding batch: which completion it is, how many tokens it has emitted and may
    emit, and whether it has finished (a finished row stays until the batch is next compacted)."""

    completion_B: torch.Tensor
    emitted_B: torch.Tensor
    limit_B: torch.Tensor
    done_B: torch.Tensor

    @staticmethod
    def start(limits_N: torch.Tensor) -> LiveRows:
        """Every completion live, none emitted; ``limits_N``: most new tokens of each completion."""
        num_completions = limits_N.shape[0]
        device = limits_N.device
        return LiveRows(torch.arange(num_completions, device=device),
                        torch.zeros(num_completions, dtype=torch.long, device=device), limits_N,
                        torch.zeros(num_completions, dtype=torch.bool, device=device))

    def keep(self, rows_device: torch.Tensor) -> LiveRows:
        return LiveRows(self.completion_B[rows_device], self.emitted_B[rows_device], self.limit_B[rows_device],
                        self.done_B[rows_device])


def emit(outputs: OutputBuffers, live: LiveRows, tokens_Bk: torch.Tensor, logprobs_Bk: torch.Tensor,
         hidden_BkH: torch.Tensor | None, counts_B: torch.Tensor, criteria: StopCriteria) -> torch.Tensor:
    """Append the first ``counts_B[b]`` of ``tokens_Bk[b]`` to each live sequence, cut at the first stop
    token/string and at the row's limit. ``hidden_BkH``: the hidden state that predicted each token (kept
    only if the outputs have room for it). ``outputs`` needs ``max(limits) + k`` columns. Rows already
    done emit nothing. Updates ``live.done_B`` (no host sync) and returns it: ``[B]`` bool, finished.
    """
    num_rows, num_new = tokens_Bk.shape
    offsets_k = torch.arange(num_new, device=tokens_Bk.device)
    counts_B = torch.minimum(counts_B, live.limit_B - live.emitted_B).masked_fill(live.done_B, 0)
    columns_Bk = live.emitted_B[:, None] + offsets_k
    completions_Bk = live.completion_B[:, None].expand(-1, num_new)
    # Columns past a row's count get leftovers; they lie beyond the final length and are never read.
    outputs.tokens_NT[completions_Bk, columns_Bk] = tokens_Bk
    outputs.logprobs_NT[completions_Bk, columns_Bk] = logprobs_Bk
    if outputs.hidden_NTH is not None:
        outputs.hidden_NTH[completions_Bk, columns_Bk] = hidden_BkH.to(outputs.hidden_NTH.dtype)
    windows = None
    if criteria.window:
        back_W = torch.arange(1 - criteria.window, 1, device=tokens_Bk.device)
        window_columns = columns_Bk[..., None] + back_W  # [B, k, W]
        windows = outputs.tokens_NT[completions_Bk[..., None], window_columns.clamp(min=0)]
        windows = windows.masked_fill(window_columns < 0, NO_TOKEN).flatten(0, 1)
    stop_Bk = criteria(tokens_Bk.flatten(), windows).view(num_rows, num_new) & (offsets_k < counts_B[:, None])
    emitted_Bk = offsets_k < counts_B[:, None]
    outputs.nonfinite |= (~torch.isfinite(logprobs_Bk) & emitted_Bk).any()
    stopped_B = stop_Bk.any(dim=-1)
    counts_B = torch.where(stopped_B, stop_Bk.int().argmax(dim=-1) + 1, counts_B)
    live.emitted_B += counts_B
    outputs.lengths_N[live.completion_B] = live.emitted_B
    outputs.stopped_N[live.completion_B] |= stopped_B
    live.done_B |= stopped_B | (live.emitted_B >= live.limit_B)
    return live.done_B


def collect_rollout(prompts: list[torch.Tensor], num_samples: int, outputs: OutputBuffers, stats: RolloutStats,
                    start: float, route_log: RouteLog | None = None) -> Rollout:
    lengths = outputs.lengths_N.tolist()  # host sync: end of the rollout
    stopped = outputs.stopped_N.tolist()
    stats.num_generated_tokens = sum(lengths)
    stats.wall_time_s = time.perf_counter() - start
    hidden = None
    if outputs.hidden_NTH is not None:
        hidden = [outputs.hidden_NTH[i, :n] for i, n in enumerate(lengths)]
    batch = Groups(prompts, [outputs.tokens_NT[i, :n] for i, n in enumerate(lengths)], [num_samples] * len(prompts),
                   finish_reasons=["stop" if s else "length" for s in stopped],
                   sampler_logps=[outputs.logprobs_NT[i, :n] for i, n in enumerate(lengths)], hidden=hidden,
                   routes=None if route_log is None else route_log.completion_routes(lengths),
                   prompt_routes=None if route_log is None else route_log.prompts)
    return Rollout(batch, stats)
