"""The trie of a group's token sequences: every shared token stored once.

A group of sequences (G conversations that branch at turns, or G completions of one prompt) is a
forest of *nodes*: maximal runs of tokens that the same set of sequences passes through. A node
ends where sequences part or where a sequence ends, so every sequence is a whole root-to-node path.
Single-turn groups (one prompt, G completions with distinct first tokens) are the one-level case:
a prompt node with G children.

Flat layout: the nodes' tokens in depth-first preorder, each node contiguous, so a node's subtree
is the contiguous range ``[node_start, subtree_end)``. That gives the attention rule in one line:
flat key ``k`` is visible to flat query ``q`` iff ``k <= q < subtree_end_of_token[k]`` (key on
the query's path, at or above it), and each token sits at its depth (its index in every sequence
through it), which is its position id.

The trie is built from token ids as recorded (never re-tokenised), on the host: building reads
every id once (a host sync if the sequences live on a GPU; the rollout engine's are on the host).
Loss masks and weights stay per sequence: two sequences may mark the same trie token differently
(one trains on it, the other treats it as a tool output).

Shape legend: S sequences, N trie tokens, L_s length of sequence s, M_s its loss tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class TokenTrie:
    """A forest of token runs plus, per sequence, its path and its loss tokens. Host tensors only
    (the attention backends upload what they need).

    Node ``n`` holds flat tokens ``[node_start[n], node_start[n] + node_length[n])`` and its subtree
    ends at ``subtree_end[n]``; ``node_parent[n]`` is -1 for a root, ``node_level[n]`` its number of
    ancestors. Nodes are numbered in preorder, so a parent precedes its children.
    """

    input_ids: torch.Tensor          # [N] long
    position_ids: torch.Tensor       # [N] long, the token's depth
    node_start: tuple[int, ...]
    node_length: tuple[int, ...]
    node_parent: tuple[int, ...]
    node_level: tuple[int, ...]
    subtree_end: tuple[int, ...]
    sequence_tokens: tuple[torch.Tensor, ...]   # per sequence, [L_s] flat trie index of each of its tokens
    loss_masks: tuple[torch.Tensor, ...]        # per sequence, [L_s] bool: scored in the loss
    weights: tuple[torch.Tensor, ...]           # per sequence, [L_s] float: the loss weight of each token

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_nodes(self) -> int:
        return len(self.node_start)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_tokens)

    @property
    def sequence_lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.sequence_tokens]

    @property
    def num_row_tokens(self) -> int:
        """Tokens of the one-row-per-sequence layout, i.e. without sharing."""
        return sum(self.sequence_lengths)

    @property
    def max_depth(self) -> int:
        """The longest sequence, i.e. the largest position id + 1."""
        return max(self.sequence_lengths)

    @cached_property
    def node_of_token(self) -> torch.Tensor:
        """``[N]`` node of each flat token."""
        return torch.repeat_interleave(torch.arange(self.num_nodes), torch.tensor(self.node_length))

    @cached_property
    def subtree_end_of_token(self) -> torch.Tensor:
        """``[N]``: one past the last flat token that can see this token (the end of its node's subtree)."""
        return torch.tensor(self.subtree_end)[self.node_of_token]

    @cached_property
    def predictor_of_token(self) -> torch.Tensor:
        """``[N]`` flat index of the token one step up the path, whose hidden state predicts this one
        (-1 at depth 0, which nothing predicts)."""
        # Inside a node the predictor is the flat token before; a node's first token is predicted by its
        # parent's last token, a root's by nothing.
        predictor = torch.arange(self.num_tokens) - 1
        parent_last = [self.node_start[p] + self.node_length[p] - 1 if p >= 0 else -1 for p in self.node_parent]
        predictor[torch.tensor(self.node_start)] = torch.tensor(parent_last)
        return predictor

    @cached_property
    def scored_tokens(self) -> torch.Tensor:
        """``[M]`` sorted flat indices of the trie tokens some sequence scores: the LM head runs on these only."""
        scored = torch.zeros(self.num_tokens, dtype=torch.bool)
        for tokens, mask in zip(self.sequence_tokens, self.loss_masks):
            scored[tokens[mask]] = True
        return torch.nonzero(scored).squeeze(1)

    @cached_property
    def loss_token_index(self) -> torch.Tensor:
        """``[sum M_s]``: for every sequence's loss tokens in order (sequence by sequence), its slot in
        :attr:`scored_tokens` (a trie token shared by several sequences appears once per sequence)."""
        slot = torch.full((self.num_tokens,), -1)
        slot[self.scored_tokens] = torch.arange(self.scored_tokens.numel())
        return torch.cat([slot[tokens[mask]] for tokens, mask in zip(self.sequence_tokens, self.loss_masks)])

    @property
    def num_loss_tokens(self) -> list[int]:
        """``M_s`` per sequence."""
        return [int(mask.sum()) for mask in self.loss_masks]

    @cached_property
    def loss_weights(self) -> torch.Tensor:
        """``[sum M_s]`` the weight of each loss token, in :attr:`loss_token_index` order."""
        return torch.cat([w[mask] for w, mask in zip(self.weights, self.loss_masks)])

    def dense_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """The attention rule as a dense boolean ``[N, N]`` (query, key) mask: the tests' reference.
        Under a sliding window a query also skips keys ``window`` or more depth positions above it."""
        flat = torch.arange(self.num_tokens)
        visible = (flat[None, :] <= flat[:, None]) & (flat[:, None] < self.subtree_end_of_token[None, :])
        if sliding_window is not None:
            visible &= (self.position_ids[:, None] - self.position_ids[None, :]) < sliding_window
        return visible

    def per_sequence(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut a ``[sum M_s, ...]`` tensor of loss-token values into one ``[M_s, ...]`` per sequence."""
        return list(flat.split(self.num_loss_tokens))


class _Node:
    __slots__ = ("source", "begin", "end", "children", "ends")

    def __init__(self, source: int, begin: int, end: int):
        self.source, self.begin, self.end = source, begin, end   # tokens are sequences[source][begin:end]
        self.children: list[_Node] = []
        self.ends: list[int] = []   # the sequences that end with this node


def build_trie(sequences: list[torch.Tensor], loss_masks: list[torch.Tensor] | None = None,
               weights: list[torch.Tensor] | None = None) -> TokenTrie:
    """The trie of ``sequences`` (1-D LongTensors ``[L_s]`` of token ids).

    Args:
        loss_masks: per sequence a bool ``[L_s]``, True where the token is scored (its log-prob enters
            the loss); default: every token but the first. Position 0 cannot be scored (nothing
            predicts a sequence's first token), and every sequence needs at least one loss token.
        weights: per sequence a float ``[L_s]`` loss weight per token (default 1), carried to
            :attr:`TokenTrie.loss_weights`.
    """
    validate_sequences(sequences, loss_masks, weights)
    lists = [s.tolist() for s in sequences]   # host sync when the ids live on a GPU: the trie needs their values
    order = sorted(range(len(lists)), key=lambda i: lists[i])
    lcps = _sorted_common_prefix_lengths([lists[i] for i in order])

    # The radix tree over the sorted sequences: `path` is the previous sequence's root-to-end chain. A
    # sequence sharing `lcp` tokens with the previous one keeps the chain down to depth `lcp`
    # (splitting the node that straddles it) and hangs its remaining tokens below as a new node.
    roots: list[_Node] = []
    path: list[_Node] = []
    for index, lcp in zip(order, lcps):
        while path and path[-1].begin >= lcp:
            path.pop()
        if path and path[-1].end > lcp:
            node = path[-1]
            tail = _Node(node.source, lcp, node.end)
            tail.children, tail.ends = node.children, node.ends
            node.children, node.ends, node.end = [tail], [], lcp
        if lcp == len(lists[index]):   # the same sequence again: it ends where the previous one did
            path[-1].ends.append(index)
            continue
        child = _Node(index, lcp, len(lists[index]))
        child.ends.append(index)
        (path[-1].children if path else roots).append(child)
        path.append(child)
    return _layout(sequences, roots, loss_masks, weights)


def _sorted_common_prefix_lengths(sorted_lists: list[list[int]]) -> list[int]:
    """Common-prefix length of each sequence with the one before it in sorted order (0 for the first)."""
    padded = _padded(sorted_lists)
    # -1 padding never equals a token id, so a shorter sequence's end stops the common prefix.
    same = (padded[1:] == padded[:-1]) & (padded[1:] >= 0)
    lcps = torch.cumprod(same.long(), dim=1).sum(1)
    return [0, *lcps.tolist()]


def common_prefix_lengths(sequences: list[torch.Tensor]) -> list[list[int]]:
    """``[S][S]`` host ints: how many leading tokens sequences ``i`` and ``j`` have in common.

    A trie of some of the sequences holds, over them in any order, each one's length less its longest
    common prefix with one before it: what the trie micro-batch planner counts
    (``turbogrpo.batch.Groups.micro_batches``). One ``[S, L]`` comparison per sequence, no token loop.
    """
    lists = [s.tolist() for s in sequences]   # host sync when the ids live on a GPU
    padded = _padded(lists)
    # A True column past the end stops every comparison, so argmax finds the first mismatch.
    sentinel = torch.ones(len(lists), 1, dtype=torch.bool)
    lengths = torch.tensor([len(s) for s in lists])
    rows = []
    for i in range(len(lists)):
        first_mismatch = torch.cat([padded != padded[i], sentinel], dim=1).int().argmax(1)
        rows.append(torch.minimum(first_mismatch, torch.minimum(lengths, lengths[i])))   # -1 pads match -1 pads
    return torch.stack(rows).tolist()


def _padded(lists: list[list[int]]) -> torch.Tensor:
    """``[S, max L_s]`` long: the sequences right-padded with -1 (never a token id)."""
    padded = torch.full((len(lists), max(len(s) for s in lists)), -1, dtype=torch.long)
    for row, s in enumerate(lists):
        padded[row, :len(s)] = torch.tensor(s, dtype=torch.long)
    return padded


def _layout(sequences, roots: list[_Node], loss_masks, weights) -> TokenTrie:
    """Number the nodes in preorder and lay their tokens out flat (loops over nodes, not tokens)."""
    nodes: list[_Node] = []
    parents, levels = [], []
    stack = [(root, -1, 0) for root in reversed(roots)]
    while stack:
        node, parent, level = stack.pop()
        number = len(nodes)
        nodes.append(node)
        parents.append(parent)
        levels.append(level)
        stack.extend((child, number, level + 1) for child in reversed(node.children))
    lengths = [n.end - n.begin for n in nodes]
    starts = [0] * len(nodes)
    for n in range(1, len(nodes)):
        starts[n] = starts[n - 1] + lengths[n - 1]
    # Subtree sizes bottom-up: in preorder every child comes after its parent.
    subtree_tokens = list(lengths)
    for n in range(len(nodes) - 1, 0, -1):
        if parents[n] >= 0:
            subtree_tokens[parents[n]] += subtree_tokens[n]
    subtree_ends = [start + size for start, size in zip(starts, subtree_tokens)]

    end_of_sequence = {s: n for n, node in enumerate(nodes) for s in node.ends}
    sequence_tokens = []
    for s in range(len(sequences)):
        chain, n = [], end_of_sequence[s]
        while n >= 0:
            chain.append(n)
            n = parents[n]
        sequence_tokens.append(torch.cat([torch.arange(starts[n], starts[n] + lengths[n]) for n in reversed(chain)]))
    input_ids = torch.cat([sequences[n.source][n.begin:n.end].cpu() for n in nodes]).long()
    position_ids = torch.cat([torch.arange(n.begin, n.end) for n in nodes])
    masks = tuple(_default_loss_mask(s.numel()) if loss_masks is None else loss_masks[i].bool().cpu()
                  for i, s in enumerate(sequences))
    token_weights = tuple(torch.ones(s.numel()) if weights is None else weights[i].cpu()
                          for i, s in enumerate(sequences))
    return TokenTrie(input_ids, position_ids, tuple(starts), tuple(lengths), tuple(parents), tuple(levels),
                     tuple(subtree_ends), tuple(sequence_tokens), masks, token_weights)


def micro_batches(sequences: list[torch.Tensor], max_tokens: int) -> list[list[int]]:
    """Split a group's sequences into micro-batches whose tries hold at most ``max_tokens`` tokens each.

    Splits fall between whole sequences (at node boundaries), never inside a path: a micro-batch
    holds complete root-to-end paths, and an ancestor shared across micro-batches is repeated in
    each. Sequences are taken in sorted order, where neighbours share the most, so a sequence adds
    only its tokens past the common prefix with the one before it. Returns the sequence indices of
    each micro-batch; a sequence longer than the budget is a ValueError.
    """
    validate_sequences(sequences, None, None)
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens must be an int >= 2 (a scored sequence has at least 2 tokens), "
                         f"got {max_tokens!r}")
    lists = [s.tolist() for s in sequences]   # host sync when the ids live on a GPU
    order = sorted(range(len(lists)), key=lambda i: lists[i])
    lcps = _sorted_common_prefix_lengths([lists[i] for i in order])
    batches, current, used = [], [], 0
    for index, lcp in zip(order, lcps):
        length = len(lists[index])
        if length > max_tokens:
            raise ValueError(f"sequence {index} has {length} tokens, over the micro-batch token budget of "
                             f"{max_tokens}; a path cannot be split (each token attends to every token before "
                             "it), so raise the budget to at least the longest sequence")
        added = length - lcp if current else length
        if current and used + added > max_tokens:
            batches.append(current)
            current, used, added = [], 0, length
        current.append(index)
        used += added
    batches.append(current)
    return batches


def _default_loss_mask(length: int) -> torch.Tensor:
    mask = torch.ones(length, dtype=torch.bool)
    mask[0] = False
    return mask


def trie_of_groups(prompts: list[torch.Tensor], completions: list[list[torch.Tensor]]) -> TokenTrie:
    """The single-turn case: sequence ``prompt_g + completion_gi``, scoring the completion tokens, group
    by group. Completions that begin alike share their common tokens too."""
    sequences, masks = [], []
    for prompt, group in zip(prompts, completions):
        for completion in group:
            sequences.append(torch.cat([prompt, completion]))
            masks.append(torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool),
                                    torch.ones(completion.numel(), dtype=torch.bool)]))
    return build_trie(sequences, masks)


def validate_sequences(sequences, loss_masks, weights) -> None:
    """ValueError naming the bad sequence and what is allowed."""
    if not isinstance(sequences, (list, tuple)) or len(sequences) == 0:
        raise ValueError("sequences must be a non-empty list of 1-D LongTensors of token ids")
    for name, per_sequence in (("loss_masks", loss_masks), ("weights", weights)):
        if per_sequence is not None and len(per_sequence) != len(sequences):
            raise ValueError(f"{name} has {len(per_sequence)} entries for {len(sequences)} sequences; "
                             "give one per sequence")
    for s, tokens in enumerate(sequences):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"sequence {s} must be a 1-D LongTensor of token ids, got "
                             f"{type(tokens).__name__}{getattr(tokens, 'shape', '')}")
        if tokens.numel() < 2:
            raise ValueError(f"sequence {s} has {tokens.numel()} tokens; a scored sequence needs at least 2 "
                             "(nothing predicts the first)")
        for name, per_sequence in (("loss mask", loss_masks), ("weights", weights)):
            if per_sequence is not None and tuple(per_sequence[s].shape) != tuple(tokens.shape):
                raise ValueError(f"the {name} of sequence {s} has shape {tuple(per_sequence[s].shape)}; "
                                 f"it must match the sequence's {tuple(tokens.shape)}")
        if loss_masks is not None:
            mask = loss_masks[s].bool()
            if bool(mask[0]):
                raise ValueError(f"sequence {s} marks its first token as a loss token; nothing predicts a "
                                 "sequence's first token, so position 0 must be False")
            if not bool(mask.any()):
                raise ValueError(f"sequence {s} has no loss token (its loss mask is all False); drop it "
                                 "from the batch or mark the tokens to train on")
