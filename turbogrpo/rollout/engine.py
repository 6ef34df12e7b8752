"""The rollout loop: prefill each prompt once, then decode all live sequences together.

    prefill (one forward over the distinct prompts)
      -> every sample draws its own first token from its prompt's logits
      -> loop: forward the live sequences' newest tokens, draw the next ones, drop finished sequences

The policy runs as the user's own ``transformers`` model object (through ``turbogrpo.hook``), so a
rollout right after an optimizer step already uses the new weights.

Emission is written for k tokens per live sequence per step (``_emit``), so that a decoder that
accepts several tokens per step (speculative verification) reuses the stop and bookkeeping logic;
the plain decoder emits one.

Legend: ``N`` completions, ``B`` live sequences, ``k`` tokens emitted per sequence in a step,
``T`` output columns, ``V`` vocabulary, ``Hd`` hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from turbogrpo.hook import lm_head_of
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.plans import forward_new_tokens, prefill
from turbogrpo.rollout.sampling import SamplingConfig, sample_with_logprobs
from turbogrpo.rollout.stopping import NO_TOKEN, StopCriteria
from turbogrpo.rollout.types import Rollout, RolloutStats


def generate(model: nn.Module, prompts: list[torch.Tensor], *, num_samples: int, sampling: SamplingConfig,
             seed: int | None = None, draft: object | None = None, return_hidden: bool = False) -> Rollout:
    """Sample ``num_samples`` completions for each prompt with ``model``'s current weights.

    ``prompts``: 1-D int64 token id tensors, one per group. ``seed`` makes the draws reproducible
    (a generator on the model's device); ``None`` uses torch's global generator. ``return_hidden``
    keeps the policy's final hidden state for every generated token. ``draft`` (a
    ``turbogrpo.speculative`` draft head or ``Speculation``) turns on lossless speculative decoding.
    """
    _check_inputs(model, prompts, num_samples, sampling)
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    prompts = [p.to(device=device, dtype=torch.long) for p in prompts]
    with torch.no_grad():
        if draft is not None:
            # Imported here: the speculative decoder is built on this engine's pieces.
            from turbogrpo.speculative.decode import speculative_rollout
            return speculative_rollout(model, prompts, num_samples, sampling, generator, return_hidden, draft)
        return _plain_rollout(model, prompts, num_samples, sampling, generator, return_hidden)


@dataclass
class _Outputs:
    """Per-completion output buffers, written in place as tokens are emitted."""

    tokens_NT: torch.Tensor
    logprobs_NT: torch.Tensor
    hidden_NTH: torch.Tensor | None
    lengths_N: torch.Tensor
    stopped_N: torch.Tensor

    @staticmethod
    def allocate(num_completions: int, num_columns: int, device: torch.device,
                 hidden_like: torch.Tensor | None) -> _Outputs:
        """``num_columns``: max_new_tokens + (most tokens emitted per step) - 1. ``hidden_like``: a
        hidden-state tensor to take size and dtype from, or None to keep no hidden states."""
        hidden = None
        if hidden_like is not None:
            hidden = hidden_like.new_zeros(num_completions, num_columns, hidden_like.shape[-1])
        return _Outputs(
            tokens_NT=torch.full((num_completions, num_columns), NO_TOKEN, dtype=torch.long, device=device),
            logprobs_NT=torch.zeros(num_completions, num_columns, dtype=torch.float32, device=device),
            hidden_NTH=hidden,
            lengths_N=torch.zeros(num_completions, dtype=torch.long, device=device),
            stopped_N=torch.zeros(num_completions, dtype=torch.bool, device=device))


@dataclass
class _Live:
    """Per live sequence: which completion it is and how many tokens it has emitted."""

    completion_B: torch.Tensor
    emitted_B: torch.Tensor

    def keep(self, rows_device: torch.Tensor) -> _Live:
        return _Live(self.completion_B[rows_device], self.emitted_B[rows_device])


def _plain_rollout(model: nn.Module, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig,
                   generator: torch.Generator | None, return_hidden: bool) -> Rollout:
    start = time.perf_counter()
    device = prompts[0].device
    num_completions = len(prompts) * num_samples
    max_new = sampling.max_new_tokens
    # Every emitted token but the last is fed back, so max_new - 1 slots would do; max_new keeps
    # the capacity >= 1 when max_new_tokens = 1.
    cache = GroupedKVCache([len(p) for p in prompts], num_samples, capacity=max_new, device=device)
    criteria = StopCriteria(sampling, device)
    lm_head = lm_head_of(model)
    stats = RolloutStats()

    prompt_hidden_GH = prefill(model, cache, prompts)
    stats.num_forwards += 1
    # One row per sample, so that every sample draws its own first token from its prompt's logits.
    logits_BV = lm_head(prompt_hidden_GH).float().repeat_interleave(num_samples, dim=0)
    hidden_BH = prompt_hidden_GH.repeat_interleave(num_samples, dim=0)
    outputs = _Outputs.allocate(num_completions, max_new, device, prompt_hidden_GH if return_hidden else None)
    live = _Live(torch.arange(num_completions, device=device),
                 torch.zeros(num_completions, dtype=torch.long, device=device))
    while True:
        tokens_B, logprobs_B = sample_with_logprobs(logits_BV, sampling, generator)
        finished_B = _emit(outputs, live, tokens_B[:, None], logprobs_B[:, None], hidden_BH[:, None],
                           torch.ones_like(tokens_B), criteria, max_new)
        # Host sync, once per step: which sequences finished decides the next step's batch.
        finished = finished_B.tolist()
        if all(finished):
            break
        if any(finished):
            live, tokens_B = _drop_finished(finished, cache, live, tokens_B)
        stats.live_batch_sizes.append(cache.num_live)
        hidden_BH = forward_new_tokens(model, cache, tokens_B[:, None])[:, 0]
        cache.commit_all(1)
        stats.num_forwards += 1
        logits_BV = lm_head(hidden_BH).float()
    return _collect(prompts, num_samples, outputs, stats, start)


def _drop_finished(finished: list[bool], cache: GroupedKVCache, live: _Live,
                   tokens_B: torch.Tensor) -> tuple[_Live, torch.Tensor]:
    """Compact the cache and the per-sequence state to the unfinished rows."""
    rows = [row for row, done in enumerate(finished) if not done]
    rows_device = torch.tensor(rows, dtype=torch.long, device=tokens_B.device)
    cache.keep(rows)
    return live.keep(rows_device), tokens_B[rows_device]


def _emit(outputs: _Outputs, live: _Live, tokens_Bk: torch.Tensor, logprobs_Bk: torch.Tensor,
          hidden_BkH: torch.Tensor | None, counts_B: torch.Tensor, criteria: StopCriteria,
          max_new: int) -> torch.Tensor:
    """Append the first ``counts_B[b]`` of ``tokens_Bk[b]`` to each live sequence, cut at the first stop
    token/string and at ``max_new``. ``hidden_BkH``: the hidden state that predicted each token (kept
    only if the outputs have room for it). ``outputs`` needs ``max_new + k - 1`` columns.
    Returns ``[B]`` bool: the sequence finished.
    """
    num_rows, num_new = tokens_Bk.shape
    offsets_k = torch.arange(num_new, device=tokens_Bk.device)
    counts_B = torch.minimum(counts_B, max_new - live.emitted_B)
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
    stopped_B = stop_Bk.any(dim=-1)
    counts_B = torch.where(stopped_B, stop_Bk.int().argmax(dim=-1) + 1, counts_B)
    live.emitted_B += counts_B
    outputs.lengths_N[live.completion_B] = live.emitted_B
    outputs.stopped_N[live.completion_B] = stopped_B
    return stopped_B | (live.emitted_B >= max_new)


def _collect(prompts: list[torch.Tensor], num_samples: int, outputs: _Outputs, stats: RolloutStats,
             start: float) -> Rollout:
    lengths = outputs.lengths_N.tolist()  # host sync: end of the rollout
    stopped = outputs.stopped_N.tolist()
    stats.num_generated_tokens = sum(lengths)
    stats.wall_time_s = time.perf_counter() - start
    hidden = None
    if outputs.hidden_NTH is not None:
        hidden = [outputs.hidden_NTH[i, :n] for i, n in enumerate(lengths)]
    return Rollout(
        prompts=prompts, num_samples=num_samples,
        tokens=[outputs.tokens_NT[i, :n] for i, n in enumerate(lengths)],
        logprobs=[outputs.logprobs_NT[i, :n] for i, n in enumerate(lengths)],
        finish_reasons=["stop" if s else "length" for s in stopped],
        group_index=[i // num_samples for i in range(len(lengths))],
        hidden=hidden, stats=stats)


_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _check_inputs(model: nn.Module, prompts: list[torch.Tensor], num_samples: int,
                  sampling: SamplingConfig) -> None:
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of 1-D token id tensors")
    vocab_size = model.get_input_embeddings().num_embeddings
    max_positions = getattr(model.config, "max_position_embeddings", None)
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, torch.Tensor):
            raise ValueError(f"prompts[{index}] must be a 1-D tensor of token ids, got {type(prompt).__name__}")
        if prompt.dim() != 1 or prompt.dtype not in _TOKEN_DTYPES:
            raise ValueError(f"prompts[{index}] must be a 1-D integer tensor of token ids, got {prompt.dtype} "
                             f"of shape {tuple(prompt.shape)}")
        if prompt.numel() == 0:
            raise ValueError(f"prompts[{index}] is empty; every prompt needs at least one token")
        if max_positions is not None and prompt.numel() + sampling.max_new_tokens > max_positions:
            raise ValueError(
                f"prompts[{index}] has {prompt.numel()} tokens; with sampling.max_new_tokens="
                f"{sampling.max_new_tokens} it needs {prompt.numel() + sampling.max_new_tokens} positions, more "
                f"than the model's max_position_embeddings={max_positions}")
    all_ids = torch.cat([p.reshape(-1).long() for p in prompts])
    low, high = torch.aminmax(all_ids)
    if int(low) < 0 or int(high) >= vocab_size:  # host sync: input validation, once per rollout
        raise ValueError(f"prompts hold token ids in [{int(low)}, {int(high)}]; allowed is [0, {vocab_size})")
    bad_stops = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ValueError(f"sampling.stop_token_ids {bad_stops} are outside the vocabulary [0, {vocab_size})")
