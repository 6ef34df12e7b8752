"""Tree-shared training forward: a group's sequences as a trie, every shared token encoded once."""

from turbogrpo.tree.attention import TREE_BACKENDS, tree_backend_names
from turbogrpo.tree.logprobs import TreeLogprobs, per_sequence_logprobs, tree_logprobs
from turbogrpo.tree.trie import TokenTrie, build_trie, micro_batches, trie_of_groups

__all__ = ["TREE_BACKENDS", "TokenTrie", "TreeLogprobs", "build_trie", "micro_batches", "per_sequence_logprobs",
           "tree_backend_names", "tree_logprobs", "trie_of_groups"]
