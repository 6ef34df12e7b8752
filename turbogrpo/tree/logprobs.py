"""Per-token log-probs of every sequence of a trie, each shared token run through the model once.

One decoder forward over the trie's N tokens (positions = depth, attention = ancestors), the LM head
on the tokens some sequence scores only, then each sequence's log-probs gathered along its path: a
token shared by k sequences is gathered k times, so its gradient is the sum of the k sequences'
contributions, exactly what the k copies of the one-row-per-sequence layout receive. The normal
per-sequence loss applies unchanged.

A hybrid model of ``architectures.SHARED_IN_TRAINING`` runs shared too: its linear-attention and
convolution layers run every node once, its children from its final state (``turbogrpo.mixers``). A model
whose token mixing the tree backends cannot run (other recurrent models, attention with logit soft-capping)
runs one row per sequence instead, with a warning naming the fallback; the numbers are the same, only the
sharing is lost.

Shape legend: S sequences, N trie tokens, M scored trie tokens, sum M_s loss tokens of all sequences.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import nn

from turbogrpo.hook import check_materialized, check_supported, decoder_of, embedding_table, run_decoder
from turbogrpo.moe_routes import ReplayCounts, maybe_replaying, padded_routes, trie_routes
from turbogrpo.output_head import logits_head
from turbogrpo.prefix.layout import upload
from turbogrpo.prefix.lm_head import lm_head_logprobs
from turbogrpo.tree.attention import AUTO, select_tree_backend
from turbogrpo.tree.trie import TokenTrie

PER_SEQUENCE = "per_sequence"   # the fallback layout: one row per sequence, no sharing


class TreeLogprobs(NamedTuple):
    """Results over every sequence's loss tokens, sequence by sequence (``TokenTrie.per_sequence`` cuts them)."""

    logps: torch.Tensor           # [sum M_s] log p(token) at the given temperature; differentiable
    entropy: torch.Tensor | None  # [sum M_s] entropy of the same distribution; detached (None: not asked)
    layout: str                   # "tree" or PER_SEQUENCE (the fallback ran)


def tree_logprobs(model: nn.Module, trie: TokenTrie, *, backend: str = AUTO, temperature: float = 1.0,
                  with_entropy: bool = False, routes: list[torch.Tensor] | None = None,
                  route_counts: ReplayCounts | None = None) -> TreeLogprobs:
    """Log-prob of every loss token of every sequence of ``trie`` under ``model``.

    Args:
        backend: tree attention backend (``turbogrpo.tree.attention.tree_backend_names()``), or
            ``"per_sequence"`` for the one-row-per-sequence layout; "auto" picks the fastest that
            runs here, and the per-sequence layout (with a warning) for a model the tree cannot run.
        routes: per sequence ``[L_s, L, k]`` int64 MoE routes to replay (``turbogrpo.moe_routes``; -1: the
            router's own choice), or None; ``route_counts`` takes the replay's counts.
    """
    validate_model_inputs(model, trie, temperature)
    lm_head = logits_head(model)
    device = embedding_table(model).weight.device
    if backend != PER_SEQUENCE:
        reason = tree_unsupported_reason(model)
        if reason is not None:
            warnings.warn(f"turbogrpo.tree: {reason}; falling back to one row per sequence "
                          "(the same numbers, no shared tokens)", stacklevel=2)
            backend = PER_SEQUENCE
    if backend == PER_SEQUENCE:
        hidden, targets = _per_sequence_hidden(model, trie, device, routes, route_counts)
        logps, entropy = lm_head_logprobs(hidden, lm_head, targets, temperature, with_entropy=with_entropy)
        return TreeLogprobs(logps, entropy, PER_SEQUENCE)
    plan = select_tree_backend(backend, device, torch.is_grad_enabled()).plan(trie, device)
    # One host buffer, one copy: ids [N], positions [N], predictors [M], targets [M], gather [sum M_s].
    scored = trie.scored_tokens
    host = torch.cat([trie.input_ids, trie.position_ids, trie.predictor_of_token[scored], trie.input_ids[scored],
                      trie.loss_token_index])
    ids, positions, predictors, targets, gather = upload(host, device).split(
        [trie.num_tokens, trie.num_tokens, scored.numel(), scored.numel(), trie.loss_token_index.numel()])
    routes_NLK = None if routes is None else trie_routes(routes, trie.sequence_tokens, trie.num_tokens).to(device)
    with maybe_replaying(model, routes_NLK, route_counts):
        hidden = run_decoder(model, ids[None], positions[None], plan)[0]
    scored_logps, scored_entropy = lm_head_logprobs(hidden[predictors], lm_head, targets, temperature,
                                                    with_entropy=with_entropy)
    return TreeLogprobs(scored_logps[gather], None if scored_entropy is None else scored_entropy[gather], "tree")


def tree_unsupported_reason(model: nn.Module) -> str | None:
    """Why the tree backends cannot run ``model`` (None: they can)."""
    try:
        check_supported(model, training=True)
    except ValueError as error:
        return str(error).split(";")[0]
    return None


def _per_sequence_hidden(model, trie: TokenTrie, device, routes=None, route_counts=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fallback and the baseline: every sequence its own right-padded row of the model's own forward
    (any architecture; padding after the real tokens cannot reach them through causal token mixing).
    Returns the predicting hidden states ``[sum M_s, Hd]`` and the targets ``[sum M_s]``."""
    sequences = [trie.input_ids[tokens] for tokens in trie.sequence_tokens]
    batch = nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    rows = torch.cat([torch.full((int(m.sum()),), s) for s, m in enumerate(trie.loss_masks)])
    cols = torch.cat([torch.nonzero(m).squeeze(1) for m in trie.loss_masks])
    batch, rows, cols = (upload(t, device) for t in (batch, rows, cols))
    routes_TLK = None if routes is None else padded_routes(routes, batch.shape[1]).to(device)
    with maybe_replaying(model, routes_TLK, route_counts):
        hidden = decoder_of(model)(input_ids=batch, use_cache=False).last_hidden_state
    return hidden[rows, cols - 1], batch[rows, cols]


def per_sequence_logprobs(model: nn.Module, trie: TokenTrie, *, temperature: float = 1.0) -> TreeLogprobs:
    """The one-row-per-sequence layout of :func:`tree_logprobs` (the baseline it must equal)."""
    return tree_logprobs(model, trie, backend=PER_SEQUENCE, temperature=temperature)


def validate_model_inputs(model: nn.Module, trie: TokenTrie, temperature: float) -> None:
    """ValueError naming the bad setting and what is allowed."""
    if not isinstance(trie, TokenTrie):
        raise ValueError(f"trie must be a TokenTrie (turbogrpo.tree.build_trie), got {type(trie).__name__}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_materialized(model)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and trie.max_depth > max_positions:
        longest = max(range(trie.num_sequences), key=lambda s: trie.sequence_lengths[s])
        raise ValueError(f"sequence {longest} is {trie.max_depth} tokens, beyond the model's "
                         f"max_position_embeddings={max_positions}")
    vocab = embedding_table(model).num_embeddings
    low, high = int(trie.input_ids.min()), int(trie.input_ids.max())   # host tensors: no device sync
    if low < 0 or high >= vocab:
        raise ValueError(f"the trie has token id {low if low < 0 else high}, outside the model's vocabulary "
                         f"[0, {vocab})")
