"""Per-token log-probs of GRPO completions, with the prompt run through the model once per group.

Host syncs: none in :func:`compute_logprobs`, forward or backward, on the shared-prefix path. Lengths
are read from tensor shapes, index tensors are built on the host and copied without waiting
(``layout.upload``), and the token-range check is an asynchronous device assert (see
:func:`check_token_range`). The standard path (``share_prefix=False``) is sync-free the same way.

Shape legend: Ng groups, Nc completions, Nq completion tokens, Hd hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from turbogrpo.hook import check_materialized, check_supported, embedding_table, lm_head_of, run_decoder
from turbogrpo.moe_routes import BatchRoutes, maybe_replaying, packed_routes, padded_routes, sequence_routes
from turbogrpo.output_head import logits_head
from turbogrpo.prefix.auto import STANDARD, choose_auto
from turbogrpo.prefix.backends import AUTO, PaddedCausalAttention, select_backend
from turbogrpo.batch import Groups
from turbogrpo.prefix.layout import PackedGroups, pack_groups, upload
from turbogrpo.prefix.lm_head import lm_head_logprobs


class CompletionLogprobs(NamedTuple):
    """Per-token results over every completion token, flat in ``turbogrpo.batch.Groups`` order (group by
    group, completion by completion); ``Groups.per_completion`` cuts them per completion."""

    logps: torch.Tensor               # [Nq] log p(token) at the given temperature; differentiable
    entropy: torch.Tensor | None      # [Nq] entropy of the same distribution; detached (None: not asked)
    hidden: torch.Tensor | None       # [Nq, Hd] final hidden state that predicts each token


def completion_logprobs(model: nn.Module, prompts: list[torch.Tensor],
                        completions: list[list[torch.Tensor]], *, share_prefix: bool = True,
                        backend: str = "auto", temperature: float = 1.0, return_hidden: bool = False):
    """Log-prob of every completion token under ``model``, per group.

    Args:
        prompts: one 1-D LongTensor ``[P_g]`` per group.
        completions: per group, a list of 1-D LongTensors ``[S_gi]`` (the group's G completions).
        share_prefix: run each prompt once for its whole group (True) or once per completion, the
            standard way (False; the baseline). Both give the same values and gradients.
        backend: attention backend for the shared layout (one of ``turbogrpo.prefix.backend_names()``:
            "auto", "cascade", "varlen", "reference", "flex"). "auto" picks the fastest for the device
            and pack by a measured rule (``turbogrpo.prefix.auto``), which runs the standard layout
            where sharing cannot pay (a prompt short against its completions); exact either way.
            "varlen" runs the cascade on unpadded cu_seqlens segments: flash-attention's varlen
            kernel on CUDA (float16/bfloat16), a per-segment reference loop elsewhere.
        temperature: log-probs of ``softmax(logits / temperature)``.
        return_hidden: also return the final hidden states ``[S_gi, Hd]`` that predict each token.

    Returns:
        per group a list of ``[S_gi]`` float tensors (differentiable); with ``return_hidden``, the
        pair ``(logps, hidden)`` of such nested lists.
    """
    result = compute_logprobs(model, prompts, completions, share_prefix=share_prefix, backend=backend,
                              temperature=temperature, return_hidden=return_hidden, with_entropy=False)
    batch = Groups.from_nested(prompts, completions)
    logps = batch.split(batch.per_completion(result.logps))
    if return_hidden:
        return logps, batch.split(batch.per_completion(result.hidden))
    return logps


def compute_logprobs(model: nn.Module, prompts: list[torch.Tensor],
                     completions: list[list[torch.Tensor]], *, share_prefix: bool = True,
                     backend: str = "auto", temperature: float = 1.0, return_hidden: bool = False,
                     with_entropy: bool = True, routes: BatchRoutes | None = None) -> CompletionLogprobs:
    """Like :func:`completion_logprobs` but returns flat tensors plus entropy (for the trainer). ``routes``: the
    sampler's MoE routes, replayed in the forward (``turbogrpo.moe_routes``; algo.routing_replay); None: the
    routers choose."""
    validate_inputs(model, prompts, completions, temperature)
    check_token_range(model, prompts, completions)
    head = logits_head(model)
    if share_prefix and backend == AUTO:
        check_supported(model, training=True)   # before reading attention dimensions off its config
        backend = choose_auto(model, [p.numel() for p in prompts], [[c.numel() for c in cs] for cs in completions],
                              prompts[0].device, lm_head_of(model).weight.dtype, torch.is_grad_enabled())
        share_prefix = backend != STANDARD
    if share_prefix:
        hidden = _shared_prefix_hidden(model, prompts, completions, backend, routes)
    else:
        hidden = _standard_hidden(model, prompts, completions, routes)
    targets = torch.cat([c for cs in completions for c in cs])
    logps, entropy = lm_head_logprobs(hidden, head, targets, temperature, with_entropy=with_entropy)
    return CompletionLogprobs(logps, entropy, hidden if return_hidden else None)


def _shared_prefix_hidden(model, prompts, completions, backend_name, routes=None) -> torch.Tensor:
    """``[Nq, Hd]`` predictor hidden states from one packed forward with each prompt stored once (the prompt's
    routes replayed once too)."""
    layout: PackedGroups = pack_groups(prompts, completions)
    backend = select_backend(backend_name, layout.device, torch.is_grad_enabled())
    routes_TLK = None if routes is None else packed_routes(routes, layout.flat_completion_lengths).to(layout.device)
    with maybe_replaying(model, routes_TLK, None if routes is None else routes.counts):
        hidden = run_decoder(model, layout.input_ids[None], layout.position_ids[None], backend.plan(layout))
    return hidden[0, layout.predictor_index]


def _standard_hidden(model, prompts, completions, routes=None) -> torch.Tensor:
    """The baseline: every completion with its own copy of the prompt, right-padded into a batch
    ``[B, T]`` and run with plain causal attention (:class:`PaddedCausalAttention`)."""
    sequences = [torch.cat([p, c]) for p, cs in zip(prompts, completions) for c in cs]
    length = max(s.numel() for s in sequences)
    input_ids = nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    rows, cols = [], []
    row = 0
    for p, cs in zip(prompts, completions):
        for c in cs:
            cols.append(torch.arange(p.numel() - 1, p.numel() + c.numel() - 1))
            rows.append(torch.full((c.numel(),), row))
            row += 1
    # One host buffer, one copy: position ids [T] (the same for every row), then rows and columns [Nq].
    indices = upload(torch.cat([torch.arange(length), torch.cat(rows), torch.cat(cols)]), input_ids.device)
    num_tokens = (len(indices) - length) // 2
    position_ids, rows_t, cols_t = indices.split([length, num_tokens, num_tokens])
    routes_TLK = None if routes is None else padded_routes(
        sequence_routes(routes, [len(cs) for cs in completions], [c.numel() for cs in completions for c in cs]),
        length).to(input_ids.device)
    with maybe_replaying(model, routes_TLK, None if routes is None else routes.counts):
        hidden = run_decoder(model, input_ids, position_ids.expand(len(sequences), -1), PaddedCausalAttention(length))
    return hidden[rows_t, cols_t]


def validate_inputs(model: nn.Module, prompts, completions, temperature: float) -> None:
    """Raise ValueError naming the offending group/completion and what is allowed."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of 1-D LongTensors (one per group)")
    if not isinstance(completions, (list, tuple)):
        raise ValueError(f"completions must be a list of lists of 1-D LongTensors (one list per prompt), got "
                         f"{type(completions).__name__}")
    if len(completions) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but completions for {len(completions)} groups; "
                         "pass one list of completions per prompt")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_materialized(model)
    device = embedding_table(model).weight.device
    max_positions = getattr(model.config, "max_position_embeddings", None)

    def check_tokens(t, what):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{what} must be a 1-D LongTensor, got {type(t).__name__}"
                             f"{'' if not isinstance(t, torch.Tensor) else f' of shape {tuple(t.shape)}'}")
        if t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{what} has dtype {t.dtype}; token ids must be torch.long")
        if t.device != device:
            raise ValueError(f"{what} is on {t.device} but the model is on {device}; move it with .to()")
        if t.numel() == 0:
            raise ValueError(f"{what} is empty; every prompt and completion needs at least one token")

    for g, (prompt, group) in enumerate(zip(prompts, completions)):
        check_tokens(prompt, f"prompt of group {g}")
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"completions[{g}] must be the list of group {g}'s completions (1-D LongTensors), got "
                             f"{type(group).__name__}; completions is a list of lists, one per prompt "
                             "(for one completion per prompt: [[c] for c in completions])")
        if len(group) == 0:
            raise ValueError(f"group {g} has no completions; each group needs at least one")
        for i, completion in enumerate(group):
            check_tokens(completion, f"completion {i} of group {g}")
            total = prompt.numel() + completion.numel()
            if max_positions is not None and total > max_positions:
                raise ValueError(f"group {g}, completion {i}: prompt + completion is {total} tokens, beyond "
                                 f"the model's max_position_embeddings={max_positions}")


def check_token_range(model: nn.Module, prompts, completions) -> None:
    """Every token id must lie in ``[0, vocab)``: out-of-range ids would index garbage (CPU) or fail
    inside the embedding kernel (CUDA).

    Without a host sync: the check is a device-side assert, queued like a kernel. On the CPU it
    fails at once and we name the culprit with a ValueError; on CUDA a failure surfaces as an
    asynchronous device assert carrying the same vocabulary bound (reading the ids back to raise a
    ValueError would stall every call to save only the failing one).
    """
    vocab = embedding_table(model).num_embeddings
    every_token = torch.cat([*prompts, *(c for group in completions for c in group)])
    low_high = torch.aminmax(every_token)
    in_range = (low_high.min >= 0) & (low_high.max < vocab)
    try:
        torch._assert_async(in_range, f"turbogrpo: a token id is outside the model's vocabulary [0, {vocab})")
    except RuntimeError:  # only the CPU raises here, so reading values back costs no device sync
        for g, (prompt, group) in enumerate(zip(prompts, completions)):
            _raise_if_out_of_range(prompt, vocab, f"prompt of group {g}")
            for i, completion in enumerate(group):
                _raise_if_out_of_range(completion, vocab, f"completion {i} of group {g}")
        raise


def _raise_if_out_of_range(tokens: torch.Tensor, vocab: int, what: str) -> None:
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"{what} has token id {low if low < 0 else high}, outside the model's "
                         f"vocabulary [0, {vocab})")
