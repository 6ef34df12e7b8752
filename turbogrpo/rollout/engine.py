"""The rollout loop: prefill each prompt once, then decode all live sequences together.

    prefill (one forward over the distinct prompts)
      -> every sample draws its own first token from its prompt's logits
      -> loop: forward the live sequences' newest tokens, draw the next ones, drop finished sequences

The policy runs as the user's own ``transformers`` model object (through ``turbogrpo.hook``), so a
rollout right after an optimizer step already uses the new weights.

Output buffers and emission live in ``outputs.py``, shared with the speculative decoder.

Legend: ``N`` completions, ``B`` live sequences, ``k`` tokens emitted per sequence in a step,
``T`` output columns, ``V`` vocabulary, ``Hd`` hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from turbogrpo.hook import lm_head_of
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.outputs import LiveRows, OutputBuffers, collect_rollout, emit
from turbogrpo.rollout.plans import forward_new_tokens, prefill
from turbogrpo.rollout.sampling import SamplingConfig, sample_with_logprobs
from turbogrpo.rollout.stopping import StopCriteria
from turbogrpo.rollout.types import Rollout, RolloutStats


def generate(model: nn.Module, prompts: list[torch.Tensor], *, num_samples: int, sampling: SamplingConfig,
             seed: int | None = None, draft: object | None = None, return_hidden: bool = False,
             max_new_tokens_per_completion: Sequence[int] | None = None) -> Rollout:
    """Sample ``num_samples`` completions for each prompt with ``model``'s current weights.

    ``prompts``: 1-D int64 token id tensors, one per group. ``seed`` makes the draws reproducible
    (a generator on the model's device); ``None`` uses torch's global generator. ``return_hidden``
    keeps the policy's final hidden state for every generated token. ``draft`` (a
    ``turbogrpo.speculative`` draft head or ``Speculation``) turns on lossless speculative decoding.
    ``max_new_tokens_per_completion``: a length limit for each completion (group by group, as in the
    output), each at most ``sampling.max_new_tokens``; None gives every completion that limit.
    """
    _check_inputs(model, prompts, num_samples, sampling)
    device = next(model.parameters()).device
    limits_N = _length_limits(max_new_tokens_per_completion, len(prompts) * num_samples, sampling, device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    prompts = [p.to(device=device, dtype=torch.long) for p in prompts]
    with torch.no_grad():
        if draft is not None:
            # Imported here: the speculative decoder is built on this engine's pieces.
            from turbogrpo.speculative.decode import speculative_rollout
            return speculative_rollout(model, prompts, num_samples, sampling, generator, return_hidden, draft,
                                       limits_N)
        return _plain_rollout(model, prompts, num_samples, sampling, generator, return_hidden, limits_N)


def _length_limits(limits: Sequence[int] | None, num_completions: int, sampling: SamplingConfig,
                   device: torch.device) -> torch.Tensor:
    """``[N]`` most new tokens per completion."""
    if limits is None:
        return torch.full((num_completions,), sampling.max_new_tokens, dtype=torch.long, device=device)
    limits = list(limits)
    if len(limits) != num_completions:
        raise ValueError(f"max_new_tokens_per_completion has {len(limits)} entries; it needs one per completion "
                         f"({num_completions} = prompts x num_samples)")
    bad = [n for n in limits if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= sampling.max_new_tokens]
    if bad:
        raise ValueError(f"max_new_tokens_per_completion holds {bad[:3]}; each must be an integer in "
                         f"[1, sampling.max_new_tokens={sampling.max_new_tokens}]")
    return torch.tensor(limits, dtype=torch.long, device=device)


def _plain_rollout(model: nn.Module, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig,
                   generator: torch.Generator | None, return_hidden: bool, limits_N: torch.Tensor) -> Rollout:
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
    outputs = OutputBuffers.allocate(num_completions, max_new, device, prompt_hidden_GH if return_hidden else None)
    live = LiveRows.start(limits_N)
    while True:
        tokens_B, logprobs_B = sample_with_logprobs(logits_BV, sampling, generator)
        finished_B = emit(outputs, live, tokens_B[:, None], logprobs_B[:, None], hidden_BH[:, None],
                          torch.ones_like(tokens_B), criteria)
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
    return collect_rollout(prompts, num_samples, outputs, stats, start)


def _drop_finished(finished: list[bool], cache: GroupedKVCache, live: LiveRows,
                   tokens_B: torch.Tensor) -> tuple[LiveRows, torch.Tensor]:
    """Compact the cache and the per-sequence state to the unfinished rows."""
    rows = [row for row, done in enumerate(finished) if not done]
    rows_device = torch.tensor(rows, dtype=torch.long, device=tokens_B.device)
    cache.keep(rows)
    return live.keep(rows_device), tokens_B[rows_device]


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
