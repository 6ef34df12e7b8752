"""Lossless acceptance of draft trees: "sample, then match".

Starting at the root, draw ``x ~ p(. | node)`` from the policy's warped distribution (the same
temperature/top-k/top-p processing as plain sampling). If ``x`` is the token of one of the node's
children, move to that child and repeat; otherwise emit ``x`` and stop. Every emitted token is a draw
from the policy's own distribution given the tokens before it, so the output has exactly plain
sampling's distribution whatever the draft proposed, as long as the tree depends only on the draft.
It is multi-candidate rejection sampling with a one-hot proposal. At temperature 0 the draw is the
argmax, so a child is accepted exactly when it is the policy's greedy choice.

Batched without a loop over nodes: one independent draw is made at *every* node up front (only the
draws along the walked path are ever used, and those are independent, so this is the same process).
A node is on the accepted path when every edge from the root to it matches its parent's draw.

Legend: B sequences, N tree nodes, D = L + 1 path slots (root at slot 0), V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from turbogrpo.rollout.sampling import SamplingConfig, sample_tokens
from turbogrpo.speculative.tree import DraftTree


class TreeVerdict(NamedTuple):
    """What each sequence keeps from its tree."""

    path_nodes: torch.Tensor    # [B, D] long: node at each depth of the accepted path (slot 0 = root);
    #                             slots past num_accepted repeat the last accepted node
    num_accepted: torch.Tensor  # [B] long: draft tokens accepted (0..L); the step emits num_accepted + 1
    next_token: torch.Tensor    # [B] long: the policy's draw at the last accepted node (the bonus token)


def verify_tree(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None = None, uniform_BN: torch.Tensor | None = None) -> TreeVerdict:
    """Accept the longest tree path that the policy's own draws follow.

    ``target_logits`` [B, N, V]: the policy's logits at every node (the distribution of the token
    after the node's path). ``sampling`` is the plain sampler's config; draws go through the plain
    sampler's own ``sample_tokens``, so both warp logits identically. ``uniform_BN``: the draws'
    uniform numbers, drawn by the caller (e.g. outside a compiled step); None draws them from ``generator``.
    """
    draws = sample_tokens(target_logits, sampling, generator, uniform_BN)                    # [B, N]
    return accept_paths(tree, draws)


def accept_paths(tree: DraftTree, draws: torch.Tensor) -> TreeVerdict:
    """Walk every tree along ``draws`` [B, N] (one policy draw per node)."""
    edge_matches = draws.gather(1, tree.parents) == tree.tokens                               # [B, N]
    edge_matches[:, 0] = True
    on_path = ~(tree.ancestors & ~edge_matches[:, None, :]).any(-1)                          # [B, N]
    # Sibling tokens are distinct, so the accepted nodes form one path; its end is the deepest.
    last = torch.where(on_path, tree.depths, -1).argmax(-1)                                  # [B]
    num_accepted = tree.depths.gather(1, last[:, None]).squeeze(1)
    path_nodes = path_to(tree, last)
    return TreeVerdict(path_nodes, num_accepted, draws.gather(1, last[:, None]).squeeze(1))


def path_to(tree: DraftTree, last: torch.Tensor) -> torch.Tensor:
    """``[B, L+1]`` nodes on the path root..``last`` [B] by depth, padded with ``last``."""
    B, N = tree.tokens.shape
    D = tree.max_depth + 1
    on_path = tree.ancestors.gather(1, last[:, None, None].expand(B, 1, N)).squeeze(1)       # [B, N]
    slot = torch.where(on_path, tree.depths, D)  # off-path nodes go to a spare column, dropped below
    path_nodes = last[:, None].expand(B, D + 1).clone()
    path_nodes.scatter_(1, slot, torch.arange(N, device=last.device).expand(B, N))
    return path_nodes[:, :D]
