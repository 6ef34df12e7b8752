"""Forward FLOPs of a trie in three layouts: the tree, one row per sequence, and a shared prompt only.

Counted as in :mod:`turbogrpo.prefix.cost`: linear layers per token, attention per visible
query-key pair, the LM head per scored token (the same in every layout). The backward scales all alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from turbogrpo.prefix.cost import ModelDims
from turbogrpo.tree.trie import TokenTrie


@dataclass(frozen=True)
class TreeFlops:
    rows: float          # one row per sequence
    shared_prompt: float  # every sequence's first node (its prompt) once per root, the rest per sequence
    tree: float

    @property
    def ratio_vs_rows(self) -> float:
        return self.rows / self.tree

    @property
    def ratio_vs_shared_prompt(self) -> float:
        return self.shared_prompt / self.tree


def tree_flops(dims: ModelDims, trie: TokenTrie) -> TreeFlops:
    """Forward FLOPs of ``trie`` in each layout (host ints only)."""
    lm_head = 2 * dims.hidden * dims.vocab * sum(trie.num_loss_tokens)

    def total(tokens: int, pairs: int) -> float:
        return tokens * dims.linear_flops_per_token + pairs * dims.attention_flops_per_pair + lm_head

    lengths = trie.sequence_lengths
    rows = total(sum(lengths), sum(n * (n + 1) // 2 for n in lengths))
    tree = total(trie.num_tokens, int((trie.position_ids + 1).sum()))   # a token sees its depth + 1 ancestors
    # Prompt-only sharing: each root node is the prompt of the sequences below it.
    root_of_node = []
    for parent in trie.node_parent:
        root_of_node.append(len(root_of_node) if parent < 0 else root_of_node[parent])
    prompt_tokens = pairs = 0
    for length, parent in zip(trie.node_length, trie.node_parent):
        if parent < 0:
            prompt_tokens += length
            pairs += length * (length + 1) // 2
    completion_tokens = 0
    for tokens, n in zip(trie.sequence_tokens, lengths):
        p = trie.node_length[root_of_node[int(trie.node_of_token[tokens[0]])]]
        completion_tokens += n - p
        pairs += (n - p) * p + (n - p) * (n - p + 1) // 2
    return TreeFlops(rows, total(prompt_tokens + completion_tokens, pairs), tree)
