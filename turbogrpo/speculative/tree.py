"""EAGLE-2 dynamic draft trees, built for every live sequence at once.

A tree is grown level by level from the root (the last committed token, which the policy has not
seen yet). At each depth every frontier node proposes its ``K`` most likely children under the draft;
a child's score is its path's cumulative draft log-prob, and the ``K`` best-scoring children become
the next frontier. Every child ever proposed is a candidate; the final tree is the ``N - 1`` best
candidates by score, plus the root. Because a child always scores strictly below its parent, the
best ``N - 1`` candidates are closed under "parent of": the selection is a tree.

All sequences share one shape ``(K, L, N)``, so a level is one batched draft call; the only Python
loop is over depth.

Legend: B live sequences, K top-k width, L depth (levels below the root), N nodes (root included),
M = K + (L - 1) * K * K candidates, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# Children score strictly below their parent even when the draft is certain (log-prob 0), which is
# what makes the top-(N-1) candidates a connected tree. Small enough not to reorder real scores.
_MIN_STEP_LOGPROB = -1e-3


class TreeShape(NamedTuple):
    """The size of one step's draft trees (the same for all live sequences)."""

    top_k: int      # K: children proposed per frontier node, and frontier nodes kept per depth
    depth: int      # L: levels below the root
    num_nodes: int  # N: nodes the policy verifies per sequence, root included

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    def validate(self, vocab_size: int | None = None) -> "TreeShape":
        if self.top_k < 1 or self.depth < 1:
            raise ValueError(f"tree shape {tuple(self)}: top_k and depth must be >= 1")
        if not 2 <= self.num_nodes <= self.num_candidates + 1:
            raise ValueError(
                f"tree shape {tuple(self)}: num_nodes must be in [2, 1 + top_k + (depth-1)*top_k^2] "
                f"= [2, {self.num_candidates + 1}]")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"tree shape {tuple(self)}: top_k must be <= the vocabulary size {vocab_size}")
        return self


def chain_shape(shape: TreeShape) -> TreeShape:
    """The chain (K = 1) a step of ``shape`` runs where trees cannot (a hybrid policy: its recurrent states
    follow one path, ``rollout.states``): as deep as the shape, within its N - 1 nodes."""
    depth = max(1, min(shape.depth, shape.num_nodes - 1))
    return TreeShape(1, depth, depth + 1)


class DraftTree(NamedTuple):
    """B draft trees of N nodes. Node 0 is the root; parents precede their children.

    Sibling tokens are distinct, so at most one child of a node can match a sampled token.
    """

    tokens: torch.Tensor           # [B, N] long: node tokens; tokens[:, 0] is the root token
    parents: torch.Tensor          # [B, N] long: parent node index; the root is its own parent (0)
    depths: torch.Tensor           # [B, N] long: 0 at the root
    ancestors: torch.Tensor        # [B, N, N] bool: [b, i, j] is True when node j is on the path root..i
    path_logprobs: torch.Tensor    # [B, N] float: cumulative draft log-prob of each node (0 at the root)
    candidate_logprobs: torch.Tensor  # [B, M] float: cumulative draft log-prob of every candidate
    max_depth: int                 # L: no node is deeper


class DraftLevel(NamedTuple):
    """The frontier handed to the draft at one depth: K nodes per sequence to expand."""

    tokens: torch.Tensor        # [B, K] long: tokens of the frontier nodes
    parent_slots: torch.Tensor  # [B, K] long: slot (0..K-1) of each node's parent in the previous level;
    #                             0 at depth 1, whose parent is the root
    attend: torch.Tensor        # [B, K, d*K] bool: which expanded nodes (depths 1..d, level-major, this
    #                             level last) each frontier node sees: its ancestors and itself
    depth: int                  # d, 1-based


class Proposals(NamedTuple):
    """A draft's log-probs of the next token over a draft vocabulary: ``logprobs [..., Vd]`` of the tokens
    ``token_ids [Vd]`` (every other token has probability 0). The tree reads its top-K off these Vd
    entries: padding them to ``[..., V]`` with -inf and taking the top-K there cost 15-16x as much
    (SmolLM2's 49,152-token vocabulary, a 4,096-token draft vocabulary, K = 4, 2 CPU threads: 1.9 ms
    against 0.12 ms a level at 16 rows, 7.1 against 0.49 ms at 64; ``bench/decode_ops.py --parts
    tree_levels``)."""

    logprobs: torch.Tensor
    token_ids: torch.Tensor


# The draft model's step: frontier -> draft log-probs of each frontier node's children, [B, K, V] over
# the whole vocabulary or ``Proposals`` over a draft vocabulary.
DraftStep = Callable[[DraftLevel], torch.Tensor | Proposals]


def top_proposals(logprobs: torch.Tensor | Proposals, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely next tokens and their log-probs (float32), ``[..., k]`` each, from log-probs
    over the whole vocabulary ``[..., V]`` or ``Proposals``."""
    if isinstance(logprobs, Proposals):
        scores, index = logprobs.logprobs.float().topk(k, dim=-1)
        return scores, logprobs.token_ids[index]
    return logprobs.float().topk(k, dim=-1)


def _num_proposable(logprobs: torch.Tensor | Proposals) -> int:
    return (logprobs.logprobs if isinstance(logprobs, Proposals) else logprobs).shape[-1]


def build_tree(root_tokens: torch.Tensor, root_logprobs: torch.Tensor | Proposals, draft_step: DraftStep,
               shape: TreeShape) -> DraftTree:
    """Grow the EAGLE-2 tree of ``shape`` for every sequence.

    ``root_tokens`` [B]: the last committed token; ``root_logprobs`` [B, V] (or ``Proposals``): the
    draft's log-probs of the token after it. ``draft_step`` is called ``L - 1`` times (the last level's
    candidates need no expansion).
    """
    K, L, N = shape.validate(_num_proposable(root_logprobs))
    B = root_tokens.shape[0]
    device = root_tokens.device
    slots = torch.arange(K, device=device)

    frontier_scores, frontier_tokens = top_proposals(root_logprobs, K)                   # [B, K]
    frontier_scores = frontier_scores.clamp(max=_MIN_STEP_LOGPROB)
    frontier_pool = slots.expand(B, K)
    parent_slots = torch.zeros(B, K, dtype=torch.long, device=device)
    attend = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
    pool_scores, pool_tokens = [frontier_scores], [frontier_tokens]
    pool_parents = [torch.full((B, K), -1, dtype=torch.long, device=device)]  # -1: the root
    pool_depths = [torch.ones(K, dtype=torch.long, device=device)]
    pool_size = K

    for depth in range(1, L):
        child_logprobs, child_tokens = top_proposals(
            draft_step(DraftLevel(frontier_tokens, parent_slots, attend, depth)), K)             # [B, K, K]
        child_scores = (frontier_scores[:, :, None] + child_logprobs.clamp(max=_MIN_STEP_LOGPROB)).flatten(1)
        child_tokens = child_tokens.flatten(1)                                               # [B, K*K]
        pool_scores.append(child_scores)
        pool_tokens.append(child_tokens)
        pool_parents.append(frontier_pool.repeat_interleave(K, dim=1))
        pool_depths.append(torch.full((K * K,), depth + 1, dtype=torch.long, device=device))

        frontier_scores, best = child_scores.topk(K, dim=-1)                                 # [B, K]
        frontier_tokens = child_tokens.gather(1, best)
        parent_slots = best // K
        frontier_pool = pool_size + best
        pool_size += K * K
        # A new node sees what its parent saw, plus itself.
        seen_by_parent = attend.gather(1, parent_slots[:, :, None].expand(-1, -1, attend.shape[-1]))
        attend = torch.cat([seen_by_parent, torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)], -1)

    scores = torch.cat(pool_scores, 1)                                                        # [B, M]
    chosen = scores.topk(N - 1, dim=-1).indices.sort(dim=-1).values  # pool order is level-major, so
    #                                                                 parents come before children
    tokens = torch.cat([root_tokens[:, None], torch.cat(pool_tokens, 1).gather(1, chosen)], 1)
    depths = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device),
                        torch.cat(pool_depths).expand(B, -1).gather(1, chosen)], 1)
    # Pool index -> node index; the root (pool parent -1) maps through the extra last column to 0.
    node_of_pool = torch.zeros(B, shape.num_candidates + 1, dtype=torch.long, device=device)
    node_of_pool.scatter_(1, chosen, torch.arange(1, N, device=device).expand(B, -1))
    pool_parent = torch.cat(pool_parents, 1).gather(1, chosen)
    parents = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device),
                         node_of_pool.gather(1, torch.where(pool_parent < 0, shape.num_candidates, pool_parent))], 1)
    path_logprobs = torch.cat([torch.zeros(B, 1, device=device), scores.gather(1, chosen)], 1)
    return DraftTree(tokens, parents, depths, ancestors_from_parents(parents, L), path_logprobs, scores, L)


def ancestors_from_parents(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N, N]`` ancestor-or-self relation of trees given by ``parents`` [B, N] (root parent 0)."""
    B, N = parents.shape
    ancestors = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    index = parents[:, :, None].expand(B, N, N)
    for _ in range(max_depth):  # each pass adds one more generation of ancestors
        ancestors = ancestors | ancestors.gather(1, index)
    return ancestors


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """The tree of a single path: ``tokens`` [B, N] with the root first (a K=1 tree)."""
    B, N = tokens.shape
    device = tokens.device
    parents = (torch.arange(N, device=device) - 1).clamp(min=0).expand(B, N)
    depths = torch.arange(N, device=device).expand(B, N)
    zeros = torch.zeros(B, N, device=device)
    return DraftTree(tokens, parents, depths, ancestors_from_parents(parents, N - 1), zeros, zeros[:, 1:], N - 1)
