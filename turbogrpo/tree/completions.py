"""The trie forward in the trainer's form: GRPO groups in, ``CompletionLogprobs`` out.

The groups of one call (a micro-batch) become one trie (:func:`trie_of_groups`): each prompt, then every
completion's ids as recorded, environment ids included, so siblings that begin alike and conversations
that share earlier turns share nodes (and groups whose prompts begin alike, e.g. a system prompt, share
those tokens too). :func:`tree_logprobs` runs every trie token through the decoder once and the LM head
once per scored trie token; the log-probs come back in ``turbogrpo.batch.Groups`` order, exactly the
``CompletionLogprobs`` the shared-prefix forward (``turbogrpo.prefix.compute_logprobs``) returns, so
the update's losses, TIS, KL and metrics read them unchanged.

Environment ids are scored: the forward's interface ``(prompts, completions)`` does not carry
``model_mask``, so every completion id is a loss token of the trie (one LM-head row each, as on the
prompt path), and the update's mask (``Groups.mask``) keeps them out of the loss, KL, entropy and token
counts.

Shape legend: Nq completion tokens of all groups (flat, group-major).
"""

from __future__ import annotations

import torch
from torch import nn

from turbogrpo.moe_routes import BatchRoutes, ReplayCounts, sequence_routes
from turbogrpo.prefix.logprobs import CompletionLogprobs, compute_logprobs, validate_inputs
from turbogrpo.tree.attention import AUTO, TREE_BACKENDS
from turbogrpo.tree.logprobs import tree_logprobs
from turbogrpo.tree.trie import TokenTrie, trie_of_groups

# "auto" runs the tree forward when its trie saves at least this share of the prompt-sharing layout's
# tokens, the prompt path otherwise. With no sharing beyond the prompts the two encode the same tokens
# and the prompt path is the measured one (prefix.auto picks its backend, or no sharing at all, per pack),
# so the tree must save enough to pay for its trie (built on the host per call) and its per-level cascade.
# Measured (bench/results/tree_siblings.json, SmolLM2-135M, 8 GSM8K prompts x 8 x 256 tokens, 2-core EPYC):
# the trie held 98% of the prompt layout's tokens and took 1.05x its time, so a trie token costs about 7%
# more than a prompt-path token; saving 10% keeps the tree ahead with a margin.
AUTO_MIN_SAVED = 0.1


def compute_tree_logprobs(model: nn.Module, prompts: list[torch.Tensor], completions: list[list[torch.Tensor]], *,
                          backend: str = AUTO, temperature: float = 1.0, return_hidden: bool = False,
                          with_entropy: bool = True, routes: BatchRoutes | None = None) -> CompletionLogprobs:
    """Log-prob ``[Nq]`` (and entropy, with ``with_entropy``) of every completion token under ``model``,
    from one trie of all the groups; arguments as ``turbogrpo.prefix.compute_logprobs``.

    ``backend``: a prefix backend name (model.logprob_backend); the tree runs the tree attention backend
    of that name, or "auto" for one it lacks ("varlen").
    """
    validate_inputs(model, prompts, completions, temperature)
    if return_hidden:
        raise ValueError("the tree forward does not return hidden states; use train.sharing = \"prompt\"")
    return trie_logprobs(model, trie_of_groups(prompts, completions), backend, temperature, with_entropy,
                         *_per_sequence(routes, completions))


def compute_auto_logprobs(model: nn.Module, prompts: list[torch.Tensor], completions: list[list[torch.Tensor]], *,
                          backend: str = AUTO, temperature: float = 1.0, return_hidden: bool = False,
                          with_entropy: bool = True, routes: BatchRoutes | None = None) -> CompletionLogprobs:
    """:func:`compute_tree_logprobs` when the groups' trie saves at least ``AUTO_MIN_SAVED`` of the
    prompt-sharing layout's tokens, else ``compute_logprobs``; exact either way."""
    validate_inputs(model, prompts, completions, temperature)
    trie = trie_of_groups(prompts, completions)
    if return_hidden or not saves_enough(trie, prompts, completions):
        return compute_logprobs(model, prompts, completions, share_prefix=True, backend=backend,
                                temperature=temperature, return_hidden=return_hidden, with_entropy=with_entropy,
                                routes=routes)
    return trie_logprobs(model, trie, backend, temperature, with_entropy, *_per_sequence(routes, completions))


def _per_sequence(routes: BatchRoutes | None, completions: list[list[torch.Tensor]]
                  ) -> tuple[list[torch.Tensor] | None, ReplayCounts | None]:
    """The routes of each sequence of ``trie_of_groups`` (prompt + completion) and where to count the replay."""
    if routes is None:
        return None, None
    lengths = [c.numel() for cs in completions for c in cs]
    return sequence_routes(routes, [len(cs) for cs in completions], lengths), routes.counts


def saves_enough(trie: TokenTrie, prompts: list[torch.Tensor], completions: list[list[torch.Tensor]]) -> bool:
    """Whether ``trie`` (of these groups) holds at most ``1 - AUTO_MIN_SAVED`` of the tokens of the
    prompt-sharing layout: each prompt once, every completion whole (shapes only: no device sync)."""
    prompt_layout = sum(p.numel() for p in prompts) + sum(c.numel() for group in completions for c in group)
    return trie.num_tokens <= (1 - AUTO_MIN_SAVED) * prompt_layout


def trie_logprobs(model: nn.Module, trie: TokenTrie, backend: str, temperature: float,
                  with_entropy: bool, routes: list[torch.Tensor] | None = None,
                  route_counts: ReplayCounts | None = None) -> CompletionLogprobs:
    """``tree_logprobs`` of a ``trie_of_groups`` trie as ``CompletionLogprobs`` (its loss tokens are the
    completion tokens, sequence by sequence: ``Groups`` order), replaying ``routes`` (per sequence, MoE)."""
    result = tree_logprobs(model, trie, backend=tree_backend(backend), temperature=temperature,
                           with_entropy=with_entropy, routes=routes, route_counts=route_counts)
    return CompletionLogprobs(result.logps, result.entropy, None)


def tree_backend(prefix_backend: str) -> str:
    """The tree attention backend for a prefix backend name: the one of that name, else "auto"."""
    return prefix_backend if prefix_backend in TREE_BACKENDS else AUTO
